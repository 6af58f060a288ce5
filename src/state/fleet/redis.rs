//! The fleet view in Redis, for replicas: the same rules as
//! [`TenantView`](crate::policy::fleet::TenantView), as server-side scripts
//! (`src/state/redis/fleet_*.lua`), so every replica's failures count into one view and
//! each decision (hot or not, a probe or a refusal, a cool-down) is taken once for all
//! of them. Times are the replicas' clocks (passed in, like the embedded view's), never
//! Redis's.
//!
//! Keys, all under the tenant's hash tag (`{prefix}:{tenant}:fleet:...`), each expiring
//! two windows after its last write (give or take a refresh: see below):
//! - `index`: zset of full signatures by last activity; `e:{sig}`: its fields
//!   (description, shape, state, times, failure sums, the record, and of each session
//!   that failed `s:{session}` = `{count}|{last failure}`, `n` of them); `q:{sig}`:
//!   zset of the sessions that failed `min_failures` times; `p:{sig}`: hash of sessions
//!   predicted to fail, verdict pending;
//! - `singles` / `singles:t`: signatures seen failing once (session, when, cost) and
//!   their times;
//! - `watch`: hash `{shape}:{sig}` → `{state}|{until_ms}` of hot signatures and those with
//!   predictions pending, which replicas copy ([`WATCH_REFRESH`]);
//! - `stats`: trips by reason (`trip:{reason}`), `untracked`, `expired`.
//!
//! A failure is counted in the same script as the session guard's write-back
//! ([`FLEET_FAILED_AND_SAVE`]), so the trip it decides is imposed in that write, one
//! round trip after the request's call. That script is on the failure path, and each command it
//! runs costs a few microseconds of Redis's one thread (issue 28's target is 0.1 ms at
//! p50 for the whole path), so a signature's upkeep is done once per refresh (an eighth
//! of the window, its `kept` time), not at each failure: its index time, its keys'
//! expiry, and the sweep of sessions whose last failure left the window (until then
//! `n` counts them too; a session's own count restarts as soon as its last failure is
//! out of the window). A failure that is not the refresh reads the entry (the session's
//! count with it) and writes it back: two commands. A signature holding its most
//! sessions ([`SESSIONS_PER_SIGNATURE`]) makes room for a new one by dropping its least
//! recent eighth in one read, where the embedded view drops the least recent one.
//!
//! Upgrading from the release that kept a signature's sessions in `f:{sig}` (a zset) and
//! `c:{sig}` (their counts): the two releases count sessions in different places, so
//! while both run, a signature's sessions are split between them and it turns hot later;
//! nothing is misread. The old keys are deleted when a signature is forgotten.
//!
//! Sessions are the hex of their hash ([`crate::policy::fleet::session_key`]). One
//! difference from the embedded view: a full table makes room by pushing out the least
//! shared of its 16 least recently active signatures, not of all of them.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use redis::Script;
use tokio::time::Instant;

use crate::{
    clock::Clock,
    policy::fleet::{
        session_key, sort_reports, Check, Failed, FleetPolicy, Hot, Record, ShapeKey, Signature,
        SignatureId, SignatureReport, SignatureState, Succeeded, Totals, EXACT_SIGNATURES,
        PREDICTIONS_PER_SIGNATURE, SESSIONS_PER_SIGNATURE, SINGLES,
    },
    state::{
        redis::{
            FLEET_AVOIDED, FLEET_CHECK, FLEET_FAILED, FLEET_FAILED_AND_SAVE, FLEET_REPORT,
            FLEET_SUCCEEDED,
        },
        sessions::Candidates,
        shared::{Redis, Unavailable},
    },
    store::{format, WindowSave},
};

/// How stale a replica's copy of a tenant's watched shapes may get before it is read
/// again (in the background: the request that notices does not wait, unless the copy is
/// older than [`WATCH_STALE`]).
pub const WATCH_REFRESH: Duration = Duration::from_secs(1);

/// How stale a copy may be and still be used while it is read again: older than this,
/// the request waits for the read.
pub const WATCH_STALE: Duration = Duration::from_secs(10);

/// Signatures the admin report lists at most.
const REPORT_LIMIT: usize = 500;

/// The fields [`FLEET_REPORT`] sends per signature, in order.
const REPORT_FIELDS: usize = 18;

/// A watched signature, as a replica's copy has it.
#[derive(Debug, Clone, Copy)]
struct Watched {
    id: SignatureId,
    /// Until when it is watched (ms), unless it is counted again meanwhile.
    until: i64,
    /// Hot (else cooled, with predictions pending).
    hot: bool,
}

/// A replica's copy of a tenant's watched shapes.
#[derive(Default)]
struct Watch {
    shapes: HashMap<ShapeKey, Vec<Watched>>,
    fetched: Option<Instant>,
    refreshing: bool,
}

pub struct SharedFleet {
    redis: Arc<Redis>,
    clock: Clock,
    failed: Script,
    failed_and_save: Script,
    check: Script,
    succeeded: Script,
    avoided: Script,
    report: Script,
    watch: Arc<Mutex<HashMap<String, Watch>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

fn parse_hex(s: &str) -> Option<u64> {
    u64::from_str_radix(s, 16).ok()
}

fn num(s: Option<&String>) -> i64 {
    s.and_then(|s| s.parse::<f64>().ok())
        .map_or(0, |v| v as i64)
}

fn float(s: Option<&String>) -> f64 {
    s.and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

fn micro(usd: f64) -> i64 {
    (usd * 1e6)
        .round()
        .clamp(0.0, crate::state::shared::MAX_AMOUNT as f64) as i64
}

/// The keys' expiry: two windows, and at least a cool-down more.
fn ttl_ms(policy: &FleetPolicy) -> i64 {
    policy
        .window_ms()
        .saturating_mul(2)
        .saturating_add(policy.cool_down_ms())
}

/// Reads a tenant's watched shapes into this replica's copy.
async fn refresh(
    redis: Arc<Redis>,
    all: Arc<Mutex<HashMap<String, Watch>>>,
    tenant: String,
    prefix: String,
    clock: Clock,
) {
    let key = format!("{prefix}watch");
    let fields: Result<Vec<String>, _> = redis
        .run("fleet_watch", |mut c| async move {
            redis::cmd("HGETALL").arg(&key).query_async(&mut c).await
        })
        .await;
    let mut all = lock(&all);
    let watch = all.entry(tenant).or_default();
    watch.refreshing = false;
    // Unreachable: the copy stays as it is, and is asked for again at the next request.
    let Ok(fields) = fields else { return };
    watch.shapes.clear();
    for pair in fields.chunks(2) {
        let [field, value] = pair else { continue };
        let Some((shape, sig)) = field.split_once(':') else {
            continue;
        };
        let Some((state, until)) = value.split_once('|') else {
            continue;
        };
        if let (Some(shape), Some(id), Ok(until)) =
            (parse_hex(shape), parse_hex(sig), until.parse())
        {
            watch
                .shapes
                .entry(ShapeKey(shape))
                .or_default()
                .push(Watched {
                    id: SignatureId(id),
                    until,
                    hot: state == "hot",
                });
        }
    }
    watch.fetched = Some(clock.now());
}

/// [`FLEET_FAILED`]'s arguments after the common ones.
fn failed_args(
    inv: &mut redis::ScriptInvocation<'_>,
    policy: &FleetPolicy,
    sig: &Signature,
    session: u64,
    calls: u32,
    usd: f64,
) {
    inv.arg(hex(sig.id.0))
        .arg(hex(sig.shape.0))
        .arg(&*sig.description)
        .arg(hex(session))
        .arg(calls)
        .arg(micro(usd))
        .arg(policy.min_failures)
        .arg(policy.min_sessions)
        .arg(policy.cool_down_ms())
        .arg(SINGLES)
        .arg(EXACT_SIGNATURES)
        .arg(SESSIONS_PER_SIGNATURE)
        .arg(PREDICTIONS_PER_SIGNATURE);
}

fn hot_of(
    id: SignatureId,
    description: &str,
    sessions: &str,
    qualified: &str,
    probe_at: &str,
    now: i64,
) -> Hot {
    let wait = probe_at
        .parse::<i64>()
        .unwrap_or(0)
        .saturating_sub(now)
        .max(0);
    Hot {
        id,
        description: description.into(),
        sessions: sessions.parse().unwrap_or(0),
        qualified: qualified.parse().unwrap_or(0),
        retry_after: Duration::from_millis(wait as u64),
    }
}

impl SharedFleet {
    pub fn new(redis: Arc<Redis>, clock: Clock) -> SharedFleet {
        SharedFleet {
            redis,
            clock,
            failed: Script::new(FLEET_FAILED),
            failed_and_save: Script::new(FLEET_FAILED_AND_SAVE),
            check: Script::new(FLEET_CHECK),
            succeeded: Script::new(FLEET_SUCCEEDED),
            avoided: Script::new(FLEET_AVOIDED),
            report: Script::new(FLEET_REPORT),
            watch: Arc::default(),
        }
    }

    fn prefix(&self, tenant: &str) -> String {
        self.redis.key(tenant, "fleet:")
    }

    /// A script's invocation with the common arguments.
    fn invoke<'s>(
        &self,
        script: &'s Script,
        tenant: &str,
        policy: &FleetPolicy,
    ) -> redis::ScriptInvocation<'s> {
        let prefix = self.prefix(tenant);
        let mut inv = script.prepare_invoke();
        inv.key(format!("{prefix}index"))
            .arg(prefix)
            .arg(self.clock.now_ms())
            .arg(policy.window_ms())
            .arg(ttl_ms(policy));
        inv
    }

    async fn run_script<T: redis::FromRedisValue + Send>(
        &self,
        op: &'static str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<T, Unavailable> {
        self.redis
            .run(op, |mut c| async move { inv.invoke_async(&mut c).await })
            .await
    }

    /// Whether the replica's copy of the tenant's watched shapes holds any. A copy older
    /// than [`WATCH_REFRESH`] is read again in the background; one older than
    /// [`WATCH_STALE`] (a replica that has not served the tenant for a while, or never),
    /// before the request is judged.
    pub async fn watching(&self, tenant: &str) -> bool {
        let now = self.clock.now();
        let age = {
            let mut all = lock(&self.watch);
            let watch = all.entry(tenant.to_string()).or_default();
            let age = watch.fetched.map(|at| now.saturating_duration_since(at));
            let due = age.is_none_or(|age| age >= WATCH_REFRESH);
            if due && !watch.refreshing {
                watch.refreshing = true;
                Some(age)
            } else {
                None
            }
        };
        if let Some(age) = age {
            let refresh = refresh(
                self.redis.clone(),
                self.watch.clone(),
                tenant.to_string(),
                self.prefix(tenant),
                self.clock.clone(),
            );
            if age.is_none_or(|age| age >= WATCH_STALE) {
                refresh.await;
            } else {
                tokio::spawn(refresh);
            }
        }
        let now_ms = self.clock.now_ms();
        lock(&self.watch)
            .get(tenant)
            .is_some_and(|w| w.shapes.values().flatten().any(|w| w.until >= now_ms))
    }

    /// The watched signatures of `shape`, as this replica's copy has them (`hot`: only
    /// the hot ones).
    fn watched(&self, tenant: &str, shape: ShapeKey, hot: bool) -> Vec<SignatureId> {
        let now = self.clock.now_ms();
        lock(&self.watch)
            .get(tenant)
            .and_then(|w| w.shapes.get(&shape))
            .map(|all| {
                all.iter()
                    .filter(|w| w.until >= now && (w.hot || !hot))
                    .map(|w| w.id)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What this replica learnt of a signature from a script's reply: watched (hot or
    /// not) until a time, or not any more.
    fn note(&self, tenant: &str, shape: ShapeKey, id: SignatureId, watched: Option<(i64, bool)>) {
        let mut all = lock(&self.watch);
        let ids = all
            .entry(tenant.to_string())
            .or_default()
            .shapes
            .entry(shape)
            .or_default();
        ids.retain(|w| w.id != id);
        if let Some((until, hot)) = watched {
            ids.push(Watched { id, until, hot });
        }
    }

    pub async fn failed(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
        sig: &Signature,
        session: u64,
        calls: u32,
        usd: f64,
    ) -> Result<Failed, Unavailable> {
        let mut inv = self.invoke(&self.failed, tenant, policy);
        failed_args(&mut inv, policy, sig, session, calls, usd);
        let reply: Vec<String> = self.run_script("fleet_failed", inv).await?;
        Ok(self.counted(tenant, policy, sig, &reply))
    }

    /// [`SharedFleet::failed`] and the session's guard write-back in one round trip
    /// ([`FLEET_FAILED_AND_SAVE`]): the failure counted, and the guard state written as the
    /// count decides (`guard.tripped` when it trips the session), or handed back when
    /// another replica wrote first. A trip's description is the failure's own (`sig`),
    /// as the state written holds it.
    #[allow(clippy::too_many_arguments)]
    pub async fn failed_and_save(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
        sig: &Signature,
        session: &str,
        calls: u32,
        usd: f64,
        guard: &Candidates,
    ) -> Result<(Failed, WindowSave), Unavailable> {
        let mut inv = self.invoke(&self.failed_and_save, tenant, policy);
        for key in self.redis.guard_window_keys(tenant, session) {
            inv.key(key);
        }
        failed_args(&mut inv, policy, sig, session_key(session), calls, usd);
        let (recorded, op, arg) =
            format::beside_write(&guard.recorded, format::WindowWrite::Keep, guard.version);
        inv.arg(guard.version)
            .arg(guard.ttl_ms.max(1000))
            .arg(recorded)
            .arg(op)
            .arg(arg);
        if let Some(parts) = &guard.tripped {
            for part in format::parts_beside(parts) {
                inv.arg(part);
            }
        }
        let reply: Vec<String> = self.run_script("fleet_failed_and_save", inv).await?;
        let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or_default();
        let version = field(1).parse().unwrap_or(0);
        let saved = match field(0) {
            "saved" => WindowSave::Saved(version),
            _ => WindowSave::Moved(version, format::from_beside(field(2), field(3))),
        };
        let mut failed = self.counted(tenant, policy, sig, reply.get(4..).unwrap_or_default());
        if let Some(hot) = &mut failed.trip {
            hot.description = sig.description.clone();
        }
        Ok((failed, saved))
    }

    /// [`FLEET_FAILED`]'s reply, read (and a trip noted in this replica's watched shapes).
    fn counted(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
        sig: &Signature,
        reply: &[String],
    ) -> Failed {
        let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or("");
        match field(0) {
            "counted" => {
                let now = self.clock.now_ms();
                let trip = (field(1) == "1")
                    .then(|| hot_of(sig.id, field(6), field(2), field(3), field(5), now));
                if trip.is_some() {
                    self.note(
                        tenant,
                        sig.shape,
                        sig.id,
                        Some((now + policy.window_ms(), true)),
                    );
                }
                Failed {
                    trip,
                    confirmed: field(4) == "1",
                    untracked: false,
                }
            }
            "untracked" => Failed {
                untracked: true,
                ..Failed::default()
            },
            _ => Failed::default(),
        }
    }

    pub async fn check(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
        shape: ShapeKey,
        session: u64,
    ) -> Result<Check, Unavailable> {
        let ids = self.watched(tenant, shape, true);
        if ids.is_empty() {
            return Ok(Check::Clear);
        }
        let mut inv = self.invoke(&self.check, tenant, policy);
        inv.arg(hex(session))
            .arg(policy.cool_down_ms())
            .arg(PREDICTIONS_PER_SIGNATURE);
        for id in &ids {
            inv.arg(hex(id.0));
        }
        let reply: Vec<String> = self.run_script("fleet_check", inv).await?;
        let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or("");
        let id = || parse_hex(field(1)).map(SignatureId);
        Ok(match (field(0), id()) {
            ("probe", Some(id)) => Check::Probe(id),
            ("refuse", Some(id)) => Check::Refuse(hot_of(
                id,
                field(2),
                field(3),
                field(4),
                field(5),
                self.clock.now_ms(),
            )),
            _ => {
                // None of them is hot any more (cooled by another replica, or forgotten):
                // still watched for their predictions until the next refresh says.
                let until = self.clock.now_ms() + policy.window_ms();
                for id in ids {
                    self.note(tenant, shape, id, Some((until, false)));
                }
                Check::Clear
            }
        })
    }

    pub async fn succeeded(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
        shape: ShapeKey,
        session: u64,
    ) -> Result<Succeeded, Unavailable> {
        let ids = self.watched(tenant, shape, false);
        if ids.is_empty() {
            return Ok(Succeeded::default());
        }
        let mut inv = self.invoke(&self.succeeded, tenant, policy);
        inv.arg(hex(session));
        for id in &ids {
            inv.arg(hex(id.0));
        }
        let reply: Vec<String> = self.run_script("fleet_succeeded", inv).await?;
        let cooled: u32 = reply.first().and_then(|v| v.parse().ok()).unwrap_or(0);
        if cooled > 0 {
            // Cooled: no longer refused here; the next refresh says whether predictions
            // keep them watched.
            let until = self.clock.now_ms() + policy.window_ms();
            for id in ids {
                self.note(tenant, shape, id, Some((until, false)));
            }
        }
        Ok(Succeeded {
            cooled,
            unconfirmed: reply.get(1).is_some_and(|v| v == "1"),
        })
    }

    /// Credits refusals to a signature, off the request's path.
    pub fn spawn_avoided(&self, tenant: &str, id: SignatureId, requests: u32) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let prefix = self.prefix(tenant);
        let redis = self.redis.clone();
        let script = self.avoided.clone();
        let now = self.clock.now_ms();
        rt.spawn(async move {
            let mut inv = script.prepare_invoke();
            inv.key(format!("{prefix}index"))
                .arg(&prefix)
                .arg(now)
                .arg(0)
                .arg(0)
                .arg(hex(id.0))
                .arg(requests);
            let _ = redis
                .run("fleet_avoided", |mut c| async move {
                    inv.invoke_async::<i64>(&mut c).await
                })
                .await;
        });
    }

    /// Counts a trip by reason, off the request's path.
    pub fn spawn_tripped(&self, tenant: &str, reason: &'static str) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let key = format!("{}stats", self.prefix(tenant));
        let redis = self.redis.clone();
        rt.spawn(async move {
            let _ = redis
                .run("fleet_tripped", |mut c| async move {
                    redis::pipe()
                        .cmd("HINCRBY")
                        .arg(&key)
                        .arg(format!("trip:{reason}"))
                        .arg(1)
                        .ignore()
                        .cmd("PEXPIRE")
                        .arg(&key)
                        .arg(7 * 86_400_000u64)
                        .ignore()
                        .query_async::<()>(&mut c)
                        .await
                })
                .await;
        });
    }

    pub async fn report(
        &self,
        tenant: &str,
        policy: &FleetPolicy,
    ) -> Result<(Totals, Vec<SignatureReport>), Unavailable> {
        let mut inv = self.invoke(&self.report, tenant, policy);
        inv.arg(REPORT_LIMIT);
        let reply: Vec<String> = self.run_script("fleet_report", inv).await?;
        let count: usize = reply.first().and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut signatures = Vec::with_capacity(count);
        let rows = reply.get(1..1 + count * REPORT_FIELDS).unwrap_or_default();
        for row in rows.chunks(REPORT_FIELDS) {
            let f = |i: usize| row.get(i);
            let Some(id) = f(0).and_then(|s| parse_hex(s)) else {
                continue;
            };
            let state = match f(2).map(String::as_str) {
                Some("hot") => SignatureState::Hot {
                    since_ms: num(f(13)),
                    probe_at_ms: num(f(12)),
                },
                Some("cooled") => SignatureState::Cooled { at_ms: num(f(14)) },
                _ => SignatureState::Warm,
            };
            signatures.push(SignatureReport {
                id: SignatureId(id),
                description: f(1).map_or("", String::as_str).into(),
                state,
                first_ms: num(f(3)),
                last_ms: num(f(4)),
                failures: num(f(5)).max(0) as u64,
                record: Record {
                    tripped: num(f(6)).max(0) as u64,
                    preempted: num(f(7)).max(0) as u64,
                    confirmed: num(f(8)).max(0) as u64,
                    unconfirmed: num(f(9)).max(0) as u64,
                    avoided_calls: float(f(10)),
                    avoided_usd: float(f(11)),
                },
                sessions: num(f(15)).max(0) as u32,
                qualified: num(f(16)).max(0) as u32,
                pending: num(row.get(17)).max(0) as u32,
            });
        }
        sort_reports(&mut signatures);
        let mut totals = Totals::default();
        let stats = reply.get(1 + count * REPORT_FIELDS..).unwrap_or_default();
        for pair in stats.chunks(2) {
            let [field, value] = pair else { continue };
            let past = &mut totals.past;
            let float_value = float(Some(value));
            let value = num(Some(value)).max(0) as u64;
            match field.as_str() {
                "untracked" => totals.untracked = value,
                "expired" => totals.expired = value,
                "r:tripped" => past.tripped = value,
                "r:preempted" => past.preempted = value,
                "r:confirmed" => past.confirmed = value,
                "r:unconfirmed" => past.unconfirmed = value,
                "r:avoided_calls" => past.avoided_calls = float_value,
                "r:avoided_usd" => past.avoided_usd = float_value,
                other => {
                    if let Some(reason) = other.strip_prefix("trip:") {
                        totals.trips_by_reason.insert(reason.to_string(), value);
                    }
                }
            }
        }
        Ok((totals, signatures))
    }
}
