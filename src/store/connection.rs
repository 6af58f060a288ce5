//! The Redis connection replicas share (`[state] backend = "redis"`): every call bounded
//! by `command_timeout`, a local breaker on Redis itself (after a failure, calls fail at
//! once for `retry_interval`, then one call probes), and the per-tenant generation
//! markers that notice a Redis that came back empty. Used by the shared budgets
//! ([`crate::state::shared`]) and the shared store ([`super::RedisStore`]); it lives
//! here, below both, so neither depends on the other for it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use redis::aio::ConnectionManager;
use tokio::sync::OnceCell;

use crate::config::{OnUnavailable, StateConfig};

/// Why Redis could not decide: down, slow, or its data was lost.
#[derive(Debug, Clone, PartialEq)]
pub enum Unavailable {
    /// Down or slower than `command_timeout` (or the breaker is open after that).
    Down(String),
    /// The tenant's generation marker is gone or changed: Redis restarted empty.
    Lost,
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::Down(why) => write!(f, "redis is unavailable: {why}"),
            Unavailable::Lost => f.write_str(
                "redis has lost Backstop's state (its generation marker changed: it restarted empty); restore it from the AOF or the spend streams, then POST /admin/state/adopt",
            ),
        }
    }
}

/// The connection, its bounds and its breaker.
pub struct Redis {
    client: redis::Client,
    conn: OnceCell<ConnectionManager>,
    timeout: Duration,
    retry_interval: Duration,
    prefix: String,
    /// Until when calls fail at once (the breaker on Redis itself).
    down_until: Mutex<Option<Instant>>,
    probing: AtomicBool,
    pub on_unavailable: OnUnavailable,
    pub replicas: u32,
    pub reservation_ttl: Duration,
    /// Per tenant, the generation this replica works under.
    generations: Mutex<HashMap<String, String>>,
    blind: AtomicU64,
}

/// Milliseconds of a duration, as Redis takes them.
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Redis {
    pub fn new(config: &StateConfig) -> Result<Arc<Redis>, String> {
        let url = config.url.as_deref().unwrap_or_default();
        let client = redis::Client::open(url).map_err(|e| format!("state.url: {e}"))?;
        Ok(Arc::new(Redis {
            client,
            conn: OnceCell::new(),
            timeout: config.command_timeout,
            retry_interval: config.retry_interval,
            prefix: config.key_prefix.clone(),
            down_until: Mutex::new(None),
            probing: AtomicBool::new(false),
            on_unavailable: config.on_unavailable,
            replicas: config.replicas,
            reservation_ttl: config.reservation_ttl,
            generations: Mutex::default(),
            blind: AtomicU64::new(0),
        }))
    }

    /// A key of one tenant: `prefix:{tenant}:rest`.
    pub fn key(&self, tenant: &str, rest: &str) -> String {
        format!(
            "{}:{{{}}}:{rest}",
            self.prefix,
            tenant.replace(['{', '}'], "_")
        )
    }

    /// A key of no tenant: `prefix:rest`.
    pub fn global(&self, rest: &str) -> String {
        format!("{}:{rest}", self.prefix)
    }

    /// Admissions made without Redis (`on_unavailable = "open"`).
    pub fn blind_admissions(&self) -> u64 {
        self.blind.load(Ordering::Relaxed)
    }

    pub fn count_blind(&self, what: &'static str) {
        self.blind.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("backstop_state_blind_admissions_total", "what" => what).increment(1);
        tracing::warn!(
            what,
            "redis unavailable; admitted on this replica's own state (on_unavailable = \"open\")"
        );
    }

    /// Runs one Redis operation, bounded by `command_timeout` and behind the breaker.
    pub async fn run<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, Unavailable>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let probe = {
            let down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
            match *down {
                Some(until) if Instant::now() < until => {
                    metrics::counter!("backstop_state_fallbacks_total", "op" => op).increment(1);
                    return Err(Unavailable::Down(
                        "recent failures (retrying shortly)".into(),
                    ));
                }
                Some(_) => true,
                None => false,
            }
        };
        // While one call probes a Redis that failed, the others fail at once.
        if probe && self.probing.swap(true, Ordering::AcqRel) {
            metrics::counter!("backstop_state_fallbacks_total", "op" => op).increment(1);
            return Err(Unavailable::Down("probing after failures".into()));
        }
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, async {
            let conn = self
                .conn
                .get_or_try_init(|| {
                    let config = redis::aio::ConnectionManagerConfig::new()
                        .set_connection_timeout(self.timeout)
                        .set_response_timeout(self.timeout)
                        .set_number_of_retries(1);
                    ConnectionManager::new_with_config(self.client.clone(), config)
                })
                .await?
                .clone();
            f(conn).await
        })
        .await;
        if probe {
            self.probing.store(false, Ordering::Release);
        }
        metrics::histogram!("backstop_state_seconds", "op" => op)
            .record(started.elapsed().as_secs_f64());
        let err = match result {
            Ok(Ok(value)) => {
                if probe {
                    tracing::info!("redis is reachable again");
                }
                *self.down_until.lock().unwrap_or_else(|e| e.into_inner()) = None;
                return Ok(value);
            }
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        metrics::counter!("backstop_state_errors_total", "op" => op).increment(1);
        let mut down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        if down.is_none() {
            tracing::error!(op, error = %err, "redis call failed; failing fast for {:?}", self.retry_interval);
        }
        *down = Some(Instant::now() + self.retry_interval);
        Err(Unavailable::Down(err))
    }

    /// The generation this replica works under for `tenant`: the marker in Redis,
    /// written now if there is none yet.
    pub(crate) async fn generation(&self, tenant: &str) -> Result<String, Unavailable> {
        if let Some(g) = self
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(tenant)
        {
            return Ok(g.clone());
        }
        self.adopt_tenant(tenant).await
    }

    async fn adopt_tenant(&self, tenant: &str) -> Result<String, Unavailable> {
        let key = self.key(tenant, "generation");
        let fresh = uuid::Uuid::new_v4().to_string();
        let g: String = self
            .run("generation", |mut c| async move {
                let (g,): (String,) = redis::pipe()
                    .cmd("SET")
                    .arg(&key)
                    .arg(&fresh)
                    .arg("NX")
                    .ignore()
                    .cmd("GET")
                    .arg(&key)
                    .query_async(&mut c)
                    .await?;
                Ok(g)
            })
            .await?;
        self.generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tenant.to_string(), g.clone());
        Ok(g)
    }

    /// Takes whatever Redis holds now as the state to work under (after an operator
    /// restored it, or accepted that it starts over).
    pub async fn adopt(&self) -> Result<(), Unavailable> {
        let tenants: Vec<String> = self
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        for t in tenants {
            self.generations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&t);
            self.adopt_tenant(&t).await?;
        }
        tracing::warn!("an operator adopted the shared state as it is now");
        Ok(())
    }
}
