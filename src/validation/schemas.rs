//! Compiled JSON Schemas, cached by content hash: the same schema sent with every
//! request of an agent is compiled once.

use std::{
    hash::{Hash, Hasher},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use jsonschema::Validator;
use moka::sync::Cache;
use serde_json::Value;

pub struct Schemas {
    cache: Cache<u64, Arc<Validator>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

fn content_hash(schema: &Value) -> u64 {
    // serde_json's map is ordered by key, so equal schemas serialise equally.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    schema.to_string().hash(&mut hasher);
    hasher.finish()
}

impl Schemas {
    pub fn new(capacity: u64) -> Self {
        Schemas {
            cache: Cache::new(capacity),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The compiled schema, from the cache or compiled now.
    pub fn get(&self, schema: &Value) -> Result<Arc<Validator>, String> {
        let key = content_hash(schema);
        if let Some(v) = self.cache.get(&key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("backstop_schema_cache_total", "result" => "hit").increment(1);
            return Ok(v);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("backstop_schema_cache_total", "result" => "miss").increment(1);
        let compiled = Arc::new(jsonschema::validator_for(schema).map_err(|e| e.to_string())?);
        self.cache.insert(key, compiled.clone());
        Ok(compiled)
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
    use serde_json::json;

    #[test]
    fn equal_schemas_compile_once() {
        let s = Schemas::new(8);
        let a = json!({"type": "object", "required": ["x"]});
        let b: Value = serde_json::from_str(r#"{"required": ["x"], "type": "object"}"#).unwrap();
        s.get(&a).unwrap();
        s.get(&b).unwrap();
        s.get(&json!({"type": "string"})).unwrap();
        assert_eq!(s.stats(), (1, 2));
        assert!(s.get(&json!({"type": 12})).is_err());
    }
}
