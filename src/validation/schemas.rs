//! Compiled JSON Schemas, cached per tenant by content hash: the same schema sent with
//! every request of an agent is compiled once.
//!
//! Each tenant has its own cache, bounded by `validation.schema_cache_bytes` (estimated
//! compiled memory) and `validation.schema_cache_size` (entries), so one tenant's
//! schemas never evict another's nor grow memory past those bounds. Compilation is
//! blocking work: callers run [`Schemas::compile`] on a blocking thread while holding a
//! [`Schemas::permit`], which caps the compilations running at once.

use std::{
    collections::HashMap,
    hash::Hasher,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use jsonschema::Validator;
use moka::sync::Cache;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::shape::{self, ShapeLimits};

/// Measured with jsonschema 0.33: a compiled schema holds about ten times its serialized
/// size, plus a fixed part (its registry and root node).
const COMPILED_PER_BYTE: u64 = 10;
const COMPILED_FIXED: u64 = 2048;
/// A recursive schema compiles another copy of itself, kept in the validator, for each
/// level of an answer's nesting it meets (at most 128: serde_json's nesting limit).
const RECURSIVE_COPIES: u64 = 128;

/// A schema's cache key and serialized size. The key never leaves this process (it keys
/// the in-memory cache only), so std's `DefaultHasher`, whose output Rust may change
/// between releases, is enough; a hash compared across processes is a specified one
/// (see the guard's `fingerprint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaFingerprint {
    pub key: u64,
    pub bytes: usize,
}

/// Hashes and counts what serde_json writes, and stops it past `limit` bytes.
struct Meter {
    hasher: std::collections::hash_map::DefaultHasher,
    bytes: usize,
    limit: usize,
}

impl std::io::Write for Meter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes += buf.len();
        if self.bytes > self.limit {
            return Err(std::io::Error::other("too large"));
        }
        self.hasher.write(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The schema's key and size, or `None` when it serializes to more than `limit` bytes
/// (found without serializing the rest). serde_json's map is ordered by key, so equal
/// schemas serialize, and hash, equally.
pub fn fingerprint(schema: &Value, limit: usize) -> Option<SchemaFingerprint> {
    let mut meter = Meter {
        hasher: std::collections::hash_map::DefaultHasher::new(),
        bytes: 0,
        limit,
    };
    serde_json::to_writer(&mut meter, schema).ok()?;
    Some(SchemaFingerprint {
        key: meter.hasher.finish(),
        bytes: meter.bytes,
    })
}

/// A cached schema and what it is estimated to hold in memory.
#[derive(Clone)]
struct Cached {
    validator: Arc<Validator>,
    weight: u32,
}

/// The limits on what one request may carry, checked before anything is compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    pub max_schema_bytes: usize,
    pub max_request_schema_bytes: usize,
    pub max_tools: usize,
}

/// What [`Schemas`] may accept, hold and do at once (from `[validation]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaSettings {
    pub request: RequestLimits,
    pub shape: ShapeLimits,
    /// The compiled-schema cache's weight per tenant, in estimated bytes.
    pub cache_bytes: u64,
    /// The most schemas a tenant's cache holds, however light.
    pub cache_entries: u64,
    pub max_concurrent_compiles: usize,
}

pub struct Schemas {
    request: RequestLimits,
    tenants: Mutex<HashMap<Arc<str>, Cache<u64, Cached>>>,
    cache_bytes: u64,
    /// The least an entry weighs, so that at most `schema_cache_size` fit.
    min_weight: u64,
    limits: ShapeLimits,
    compiles: Arc<Semaphore>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Schemas {
    pub fn new(settings: SchemaSettings) -> Self {
        Schemas {
            request: settings.request,
            tenants: Mutex::new(HashMap::new()),
            cache_bytes: settings.cache_bytes,
            min_weight: settings.cache_bytes.div_ceil(settings.cache_entries.max(1)),
            limits: settings.shape,
            compiles: Arc::new(Semaphore::new(settings.max_concurrent_compiles.max(1))),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    pub fn request_limits(&self) -> RequestLimits {
        self.request
    }

    fn cache(&self, tenant: &str) -> Cache<u64, Cached> {
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cache) = tenants.get(tenant) {
            return cache.clone();
        }
        let cache = Cache::builder()
            .max_capacity(self.cache_bytes)
            .weigher(|_key, entry: &Cached| entry.weight)
            .build();
        // Tenants come from the config, so this map stays small.
        tenants.insert(Arc::from(tenant), cache.clone());
        cache
    }

    /// The compiled schema, if this tenant has it cached.
    pub fn cached(&self, tenant: &str, key: u64) -> Option<Arc<Validator>> {
        let found = self.cache(tenant).get(&key).map(|e| e.validator);
        let result = if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
            "hit"
        } else {
            "miss"
        };
        metrics::counter!("backstop_schema_cache_total", "result" => result).increment(1);
        found
    }

    /// Blocking: checks the schema's shape (unless the operator wrote it), compiles it
    /// and caches it for the tenant.
    pub fn compile(
        &self,
        tenant: &str,
        print: SchemaFingerprint,
        schema: &Value,
        trusted: bool,
    ) -> Result<Arc<Validator>, String> {
        let cache = self.cache(tenant);
        // Another request (or this one, for a repeated tool schema) may have compiled it.
        if let Some(entry) = cache.get(&print.key) {
            return Ok(entry.validator);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let recursive = !trusted && shape::check(schema, &self.limits)?.recursive;
        let compiled = Arc::new(jsonschema::validator_for(schema).map_err(|e| e.to_string())?);
        let weight = (print.bytes as u64)
            .saturating_mul(COMPILED_PER_BYTE)
            .saturating_add(COMPILED_FIXED)
            .saturating_mul(if recursive { RECURSIVE_COPIES } else { 1 })
            .max(self.min_weight);
        cache.insert(
            print.key,
            Cached {
                validator: compiled.clone(),
                weight: u32::try_from(weight).unwrap_or(u32::MAX),
            },
        );
        Ok(compiled)
    }

    /// A slot among the compilations allowed to run at once.
    pub async fn permit(&self) -> OwnedSemaphorePermit {
        self.compiles
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed")
    }

    /// Cached, or compiled now on this thread (for tests and start-up, not requests).
    pub fn get(
        &self,
        tenant: &str,
        schema: &Value,
        trusted: bool,
    ) -> Result<Arc<Validator>, String> {
        let print = fingerprint(schema, usize::MAX).ok_or("the schema cannot be serialized")?;
        match self.cached(tenant, print.key) {
            Some(v) => Ok(v),
            None => self.compile(tenant, print, schema, trusted),
        }
    }

    /// (hits, misses) since start.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ValidationConfig;
    use serde_json::json;

    fn schemas(edit: impl FnOnce(&mut ValidationConfig)) -> Schemas {
        let mut config = ValidationConfig::default();
        edit(&mut config);
        Schemas::new(config.schema_settings())
    }

    #[test]
    fn equal_schemas_compile_once() {
        let s = schemas(|_| {});
        let a = json!({"type": "object", "required": ["x"]});
        let b: Value = serde_json::from_str(r#"{"required": ["x"], "type": "object"}"#).unwrap();
        s.get("t", &a, false).unwrap();
        s.get("t", &b, false).unwrap();
        s.get("t", &json!({"type": "string"}), false).unwrap();
        assert_eq!(s.stats(), (1, 2));
        assert!(s.get("t", &json!({"type": 12}), false).is_err());
    }

    #[test]
    fn the_fingerprint_stops_at_the_limit() {
        let schema = json!({"description": "x".repeat(100)});
        let print = fingerprint(&schema, 1000).unwrap();
        assert_eq!(print.bytes, schema.to_string().len());
        assert_eq!(fingerprint(&schema, 50), None);
    }

    #[test]
    fn each_tenant_has_its_own_bounded_cache() {
        // Room for about two 1 KB schemas per tenant.
        let s = schemas(|c| c.schema_cache_bytes = 2 * (1100 * COMPILED_PER_BYTE + COMPILED_FIXED));
        let big = |i: usize| json!({"description": format!("{i:04}{}", "x".repeat(1000))});
        let kept = fingerprint(&big(0), usize::MAX).unwrap();
        s.get("quiet", &big(0), false).unwrap();
        for i in 1..50 {
            s.get("noisy", &big(i), false).unwrap();
        }
        let noisy = s.cache("noisy");
        noisy.run_pending_tasks();
        assert!(noisy.weighted_size() <= 2 * (1100 * COMPILED_PER_BYTE + COMPILED_FIXED));
        assert!(noisy.entry_count() <= 2, "{}", noisy.entry_count());
        assert!(
            s.cached("quiet", kept.key).is_some(),
            "another tenant's schemas stay"
        );

        // schema_cache_size still bounds the number of entries.
        let s = schemas(|c| c.schema_cache_size = 3);
        for i in 0..20 {
            s.get("t", &json!({"const": i}), false).unwrap();
        }
        let cache = s.cache("t");
        cache.run_pending_tasks();
        assert!(cache.entry_count() <= 3, "{}", cache.entry_count());
    }

    #[test]
    fn shape_limits_apply_unless_the_operator_wrote_the_schema() {
        let s = schemas(|_| {});
        let cyclic = json!({"allOf": [{"$ref": "#"}]});
        assert!(s
            .get("t", &cyclic, false)
            .unwrap_err()
            .contains("reference cycle"));
        let mut deep = json!({});
        for _ in 0..40 {
            deep = json!({"items": deep});
        }
        assert!(s
            .get("t", &deep, false)
            .unwrap_err()
            .contains("max_schema_depth"));
        // Trusted (a route's schema, checked when the config was loaded): no limits.
        let mut deep = json!({});
        for _ in 0..35 {
            deep = json!({"items": deep});
        }
        assert!(s.get("t", &deep, true).is_ok());
    }
}
