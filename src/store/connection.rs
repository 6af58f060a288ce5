//! The Redis connection replicas share (`[state] backend = "redis"`): every call bounded
//! by `command_timeout`, a local breaker on Redis itself (after [`FAILURES_TO_OPEN`]
//! outages in a row, calls fail at once for `retry_interval`, then one call probes; an
//! error Redis answers with, such as a script error, is that call's alone and never
//! opens it), and the per-tenant generation markers that notice a Redis that came back
//! empty, with the replica-wide adoption marker that lets one operator call clear it on
//! every replica. Used by the shared budgets
//! ([`crate::state::shared`]) and the shared store ([`super::RedisStore`]); it lives
//! here, below both, so neither depends on the other for it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use crate::config::{OnUnavailable, StateConfig};

/// Why Redis could not decide: down, slow, refused this one call, or its data was lost.
#[derive(Debug, Clone, PartialEq)]
pub enum Unavailable {
    /// Down or slower than `command_timeout` (or the breaker is open after that).
    Down(String),
    /// Redis answered this call with an error (a script error, a wrong type): Redis is
    /// up, and only this call failed.
    Refused { op: &'static str, error: String },
    /// The tenant's generation marker is gone or changed: Redis restarted empty.
    Lost,
}

/// Outages in a row (connection errors, timeouts) that open the breaker on Redis: one
/// slow answer in a burst must not refuse everyone else's calls.
pub const FAILURES_TO_OPEN: u32 = 3;

/// Whether an error means Redis could not be reached or did not answer in time, as
/// opposed to an answer that refused this call (which says Redis is up).
fn is_outage(err: &redis::RedisError) -> bool {
    use redis::ErrorKind as K;
    !matches!(
        err.kind(),
        K::ResponseError | K::ExtensionError | K::TypeError | K::ExecAbortError | K::NoScriptError
    ) || err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
}

/// The breaker on Redis itself, with the clock passed in. Closed, calls go through;
/// after [`FAILURES_TO_OPEN`] outages in a row it opens for `open_for`, failing calls at
/// once; then one call probes while the others still fail fast; any answer closes it.
#[derive(Debug, Default)]
struct Breaker {
    /// Outages in a row.
    failures: u32,
    /// Until when calls fail at once.
    open_until: Option<Instant>,
    /// A probe is out.
    probing: bool,
}

/// What the breaker says of one call.
#[derive(Debug, PartialEq)]
enum Pass {
    Go,
    /// The one call that tests a Redis that failed.
    Probe,
    FailFast(&'static str),
}

impl Breaker {
    fn pass(&mut self, now: Instant) -> Pass {
        match self.open_until {
            None => Pass::Go,
            Some(until) if now < until => Pass::FailFast("recent failures (retrying shortly)"),
            Some(_) if self.probing => Pass::FailFast("probing after failures"),
            Some(_) => {
                self.probing = true;
                Pass::Probe
            }
        }
    }

    /// Redis answered (even with an error of its own): closed. Whether it was open.
    fn answered(&mut self) -> bool {
        let was_open = self.open_until.is_some();
        *self = Breaker::default();
        was_open
    }

    /// An outage (a connection error, a timeout). Whether the breaker opened (or, after
    /// a failed probe, stays open) for `open_for` from `now`.
    fn outage(&mut self, now: Instant, probe: bool, open_for: Duration) -> bool {
        self.failures = self.failures.saturating_add(1);
        if probe {
            self.probing = false;
        }
        if probe || self.failures >= FAILURES_TO_OPEN {
            self.open_until = Some(now + open_for);
            return true;
        }
        false
    }

    fn is_open(&self, now: Instant) -> bool {
        self.open_until.is_some_and(|until| now < until)
    }
}

impl std::fmt::Display for Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unavailable::Down(why) => write!(f, "redis is unavailable: {why}"),
            Unavailable::Refused { op, error } => {
                write!(f, "redis refused the {op} call: {error}")
            }
            Unavailable::Lost => f.write_str(
                "redis has lost Backstop's state (its generation marker changed: it restarted empty); restore it from the AOF or the spend streams, then POST /admin/state/adopt",
            ),
        }
    }
}

/// A connection to one Redis server, or to a Redis Cluster (which routes each command,
/// and each script by its first key, to the node that holds the slot: every script
/// here works on one tenant's keys, which share the `{tenant}` hash tag).
#[derive(Clone)]
pub enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

enum Client {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
}

/// The connection, its bounds and its breaker.
pub struct Redis {
    client: Client,
    conn: OnceCell<Conn>,
    timeout: Duration,
    retry_interval: Duration,
    prefix: String,
    breaker: Mutex<Breaker>,
    pub on_unavailable: OnUnavailable,
    pub replicas: u32,
    pub reservation_ttl: Duration,
    /// Per tenant, the generation this replica works under.
    generations: Mutex<HashMap<String, String>>,
    /// The replicas' adoption marker as this replica last read it: an operator's adopt on
    /// any replica changes it, and every replica then adopts too.
    adoption: Mutex<Option<String>>,
    /// Tenants whose admissions found the state lost, until it is adopted.
    lost: Mutex<std::collections::BTreeSet<String>>,
    blind: AtomicU64,
}

/// Milliseconds of a duration, as Redis takes them.
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Redis {
    pub fn new(config: &StateConfig) -> Result<Arc<Redis>, String> {
        let url = config.url.as_deref().unwrap_or_default();
        let client = if config.cluster {
            Client::Cluster(
                redis::cluster::ClusterClientBuilder::new(vec![url])
                    .connection_timeout(config.command_timeout)
                    .response_timeout(config.command_timeout)
                    .retries(1)
                    .build()
                    .map_err(|e| format!("state.url: {e}"))?,
            )
        } else {
            Client::Single(redis::Client::open(url).map_err(|e| format!("state.url: {e}"))?)
        };
        Ok(Arc::new(Redis {
            client,
            conn: OnceCell::new(),
            timeout: config.command_timeout,
            retry_interval: config.retry_interval,
            prefix: config.key_prefix.clone(),
            breaker: Mutex::default(),
            on_unavailable: config.on_unavailable,
            replicas: config.replicas,
            reservation_ttl: config.reservation_ttl,
            generations: Mutex::default(),
            adoption: Mutex::default(),
            lost: Mutex::default(),
            blind: AtomicU64::new(0),
        }))
    }

    /// A key of one tenant: `prefix:{tenant}:rest`.
    pub fn key(&self, tenant: &str, rest: &str) -> String {
        // Built in place: a request names some twenty keys.
        let mut key = String::with_capacity(self.prefix.len() + tenant.len() + rest.len() + 4);
        key.push_str(&self.prefix);
        key.push_str(":{");
        if tenant.contains(['{', '}']) {
            key.extend(
                tenant
                    .chars()
                    .map(|c| if matches!(c, '{' | '}') { '_' } else { c }),
            );
        } else {
            key.push_str(tenant);
        }
        key.push_str("}:");
        key.push_str(rest);
        key
    }

    /// The key of a session guard's state shared by replicas (a hash: `v`, `state`,
    /// `brief`), under its tenant's hash tag like the tenant's other keys.
    pub fn guard_window_key(&self, tenant: &str, session: &str) -> String {
        self.key(tenant, &format!("guard-window:{session}"))
    }

    /// [`Redis::guard_window_key`], then the keys of the window kept beside it
    /// ([`super::format::to_beside`]): its entries (a list) and each request's count in
    /// it (a hash). One hash tag: one slot.
    pub fn guard_window_keys(&self, tenant: &str, session: &str) -> [String; 3] {
        let key = self.guard_window_key(tenant, session);
        [key.clone(), format!("{key}:recent"), format!("{key}:seen")]
    }

    /// A key of no tenant: `prefix:rest`.
    pub fn global(&self, rest: &str) -> String {
        format!("{}:{rest}", self.prefix)
    }

    /// How long the breaker stays open; also how often kept settles are replayed.
    pub fn retry_interval(&self) -> Duration {
        self.retry_interval
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
        F: FnOnce(Conn) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let pass = self
            .breaker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pass(Instant::now());
        let probe = match pass {
            Pass::Go => false,
            Pass::Probe => true,
            Pass::FailFast(why) => {
                metrics::counter!("backstop_state_fallbacks_total", "op" => op).increment(1);
                return Err(Unavailable::Down(why.into()));
            }
        };
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, async {
            let conn = self
                .conn
                .get_or_try_init(|| async {
                    Ok::<_, redis::RedisError>(match &self.client {
                        Client::Single(client) => {
                            let config = redis::aio::ConnectionManagerConfig::new()
                                .set_connection_timeout(self.timeout)
                                .set_response_timeout(self.timeout)
                                .set_number_of_retries(1);
                            Conn::Single(
                                ConnectionManager::new_with_config(client.clone(), config).await?,
                            )
                        }
                        Client::Cluster(client) => {
                            Conn::Cluster(client.get_async_connection().await?)
                        }
                    })
                })
                .await?
                .clone();
            f(conn).await
        })
        .await;
        metrics::histogram!("backstop_state_seconds", "op" => op)
            .record(started.elapsed().as_secs_f64());
        let outage = match result {
            Ok(Ok(value)) => {
                self.answered();
                return Ok(value);
            }
            Ok(Err(err)) if !is_outage(&err) => {
                // Redis is up and said no to this call alone (a script error, a wrong
                // type): that call fails, nobody else's does.
                self.answered();
                metrics::counter!("backstop_state_script_errors_total", "op" => op).increment(1);
                tracing::error!(op, error = %err, "redis refused a call (script error)");
                return Err(Unavailable::Refused {
                    op,
                    error: err.to_string(),
                });
            }
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no answer within {:?}", self.timeout),
        };
        metrics::counter!("backstop_state_errors_total", "op" => op).increment(1);
        let mut breaker = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let was_open = breaker.open_until.is_some();
        if breaker.outage(Instant::now(), probe, self.retry_interval) {
            if !was_open {
                tracing::error!(op, error = %outage, failures = breaker.failures, "redis call failed; failing fast for {:?}", self.retry_interval);
            }
        } else {
            tracing::warn!(op, error = %outage, failures = breaker.failures, "redis call failed");
        }
        Err(Unavailable::Down(outage))
    }

    /// Redis answered: the breaker closes (a probe that got through lets everyone in).
    fn answered(&self) {
        let was_open = self
            .breaker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .answered();
        if was_open {
            tracing::info!("redis is reachable again");
        }
    }

    /// Whether calls fail at once now (the breaker is open).
    pub fn failing_fast(&self) -> bool {
        self.breaker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_open(Instant::now())
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
        let adoption_key = self.global(ADOPTION);
        let fresh = uuid::Uuid::new_v4().to_string();
        // Two round trips, not one pipeline: the adoption marker is in no tenant's slot.
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
        let adoption: Option<String> = self
            .run("adoption", |mut c| async move {
                redis::cmd("GET")
                    .arg(&adoption_key)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        self.generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tenant.to_string(), g.clone());
        let mut known = self.adoption.lock().unwrap_or_else(|e| e.into_inner());
        if known.is_none() {
            *known = adoption;
        }
        Ok(g)
    }

    /// An admission found `tenant`'s generation marker gone or changed. If an operator
    /// adopted the state since this replica last looked (on any replica), this replica
    /// adopts it too and the caller tries again (`Ok(true)`); otherwise the state stays
    /// lost for this tenant (`Ok(false)`), and `GET /admin/state` says so.
    pub(crate) async fn on_lost(&self, tenant: &str) -> Result<bool, Unavailable> {
        let adoption_key = self.global(ADOPTION);
        let now: Option<String> = self
            .run("adoption", |mut c| async move {
                redis::cmd("GET")
                    .arg(&adoption_key)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let adopted_since = {
            let mut known = self.adoption.lock().unwrap_or_else(|e| e.into_inner());
            let changed = now.is_some() && *known != now;
            if changed {
                *known = now;
            }
            changed
        };
        if adopted_since {
            tracing::warn!(
                tenant,
                "the shared state was adopted on another replica; adopting it here"
            );
            self.forget_generations();
            self.lost.lock().unwrap_or_else(|e| e.into_inner()).clear();
            return Ok(true);
        }
        metrics::counter!("backstop_state_lost_total").increment(1);
        tracing::error!(tenant, "{}", Unavailable::Lost);
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tenant.to_string());
        Ok(false)
    }

    fn forget_generations(&self) {
        self.generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// The tenants whose admissions found their state lost (empty once adopted).
    pub fn lost_tenants(&self) -> Vec<String> {
        self.lost
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Which of the tenants this replica works for have lost their state now: their
    /// generation marker in Redis is gone or is not the one this replica works under.
    pub async fn check_generations(&self) -> Result<Vec<String>, Unavailable> {
        let known: Vec<(String, String)> = self
            .generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(t, g)| (t.clone(), g.clone()))
            .collect();
        let mut lost = self.lost_tenants();
        for (tenant, generation) in known {
            let key = self.key(&tenant, "generation");
            let now: Option<String> = self
                .run("generation", |mut c| async move {
                    redis::cmd("GET").arg(&key).query_async(&mut c).await
                })
                .await?;
            if now.as_deref() != Some(generation.as_str()) && !lost.contains(&tenant) {
                lost.push(tenant);
            }
        }
        lost.sort();
        Ok(lost)
    }

    /// Takes whatever Redis holds now as the state to work under (after an operator
    /// restored it, or accepted that it starts over), here and, through the replicas'
    /// adoption marker, on every replica at its next admission.
    pub async fn adopt(&self) -> Result<(), Unavailable> {
        let adoption_key = self.global(ADOPTION);
        let stamp = uuid::Uuid::new_v4().to_string();
        let mine = stamp.clone();
        self.run("adopt", |mut c| async move {
            redis::cmd("SET")
                .arg(&adoption_key)
                .arg(&stamp)
                .query_async::<()>(&mut c)
                .await
        })
        .await?;
        *self.adoption.lock().unwrap_or_else(|e| e.into_inner()) = Some(mine);
        self.forget_generations();
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clear();
        tracing::warn!("an operator adopted the shared state as it is now");
        Ok(())
    }
}

/// The replicas' adoption marker (a key of no tenant): rewritten by every adopt.
const ADOPTION: &str = "adoption";

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN_FOR: Duration = Duration::from_secs(1);

    #[test]
    fn a_tenants_keys_share_one_hash_tag_that_braces_in_its_name_cannot_split() {
        let redis = Redis::new(&crate::config::StateConfig {
            backend: crate::config::StateBackend::Redis,
            url: Some("redis://127.0.0.1:1".into()),
            key_prefix: "bk".into(),
            ..crate::config::StateConfig::default()
        })
        .unwrap();
        assert_eq!(redis.key("team-a", "day:1"), "bk:{team-a}:day:1");
        assert_eq!(redis.key("a{b}c", "x"), "bk:{a_b_c}:x");
        assert_eq!(redis.key("", ""), "bk:{}:");
    }

    #[test]
    fn one_outage_in_a_burst_refuses_nobody_else() {
        let (mut b, t0) = (Breaker::default(), Instant::now());
        for _ in 1..FAILURES_TO_OPEN {
            assert!(!b.outage(t0, false, OPEN_FOR));
            assert_eq!(b.pass(t0), Pass::Go);
        }
        // An answer in between starts the count over.
        assert!(!b.answered());
        for _ in 1..FAILURES_TO_OPEN {
            assert!(!b.outage(t0, false, OPEN_FOR));
        }
        assert_eq!(b.pass(t0), Pass::Go);
    }

    #[test]
    fn outages_in_a_row_open_it_then_one_probe_and_an_answer_lets_everyone_in() {
        let (mut b, t0) = (Breaker::default(), Instant::now());
        for _ in 1..FAILURES_TO_OPEN {
            b.outage(t0, false, OPEN_FOR);
        }
        assert!(b.outage(t0, false, OPEN_FOR), "opens at the third");
        assert!(b.is_open(t0));
        assert!(matches!(b.pass(t0 + OPEN_FOR / 2), Pass::FailFast(_)));
        let later = t0 + OPEN_FOR;
        assert_eq!(b.pass(later), Pass::Probe);
        assert!(
            matches!(b.pass(later), Pass::FailFast(_)),
            "one probe at a time"
        );
        assert!(b.answered(), "it was open");
        for _ in 0..30 {
            assert_eq!(b.pass(later), Pass::Go);
        }
    }

    #[test]
    fn a_failed_probe_opens_it_again_at_once() {
        let (mut b, t0) = (Breaker::default(), Instant::now());
        for _ in 0..FAILURES_TO_OPEN {
            b.outage(t0, false, OPEN_FOR);
        }
        let later = t0 + OPEN_FOR;
        assert_eq!(b.pass(later), Pass::Probe);
        assert!(b.outage(later, true, OPEN_FOR));
        assert!(matches!(b.pass(later), Pass::FailFast(_)));
        assert_eq!(b.pass(later + OPEN_FOR), Pass::Probe);
    }
}
