//! The state replicas share, in Redis (`[state] backend = "redis"`): budget counters and
//! reservations of every scope, GCRA rate limits, session concurrency slots; the store
//! side (idempotency, guard trips, response owners) is [`crate::store::RedisStore`] over
//! the same [`Redis`].
//!
//! Each decision is one server-side script, so one round trip decides it for every
//! replica at once, all-or-nothing:
//! - admission checks the tenant's day and the session's caps against settled plus
//!   reserved, and reserves on both; the reservation has its own expiry (the server's
//!   clock), renewed every `reservation_ttl / 3` while its call runs, so a replica killed
//!   with `kill -9` frees what it held within `reservation_ttl`;
//! - settle is idempotent per reservation id, charges the actual usage even when the
//!   reservation already expired, and appends the charge to the tenant's spend stream
//!   (`XADD`), from which the counters can be rebuilt;
//! - a per-tenant generation marker, written once when a replica first sees the tenant,
//!   is checked by every admission: a Redis that came back empty is noticed and budgeted
//!   calls are refused until an operator adopts the new state (`POST /admin/state/adopt`).
//!
//! Amounts are integers: USD in micro-dollars. All of a tenant's keys share the hash tag
//! `{tenant}`, so the scripts also run on Redis Cluster.
//!
//! Every call is bounded by `command_timeout`; a failure opens a local breaker on Redis
//! for `retry_interval`, during which calls fail at once (only the first request after an
//! outage waits), then one call probes.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use redis::Script;

pub use crate::store::connection::{Redis, Unavailable};
use crate::{
    billing::Tokens,
    policy::budget::{CapNames, Caps, Exceeded, SessionSeen, Usage},
    state::guard_view::{Write, Written},
    state::redis::{ADMIT, GATE, RENEW, SETTLE},
    store::format::{beside_write, from_beside, WindowWrite},
    store::{connection::ms, Books, QueuedSettle},
};

/// A reservation held in Redis.
#[derive(Debug, Clone)]
pub struct SharedReservation {
    pub id: String,
    pub session: Option<String>,
    /// The day and session (or no-session) keys it was reserved on: settled there.
    day_key: String,
    session_key: String,
}

/// One charge, as settled and appended to the spend stream.
pub struct SharedCharge<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub tokens: Tokens,
    pub usd: f64,
    pub ts_ms: i64,
    /// 1, or 0 for a release ([`SharedSettle::calls`]).
    pub calls: u64,
}

/// Everything one settle needs, so that a settle Redis could not take now can be kept in
/// the replica's store and replayed later, by this process or the next one on the same
/// store. Encoded as versioned JSON ([`SharedSettle::encode`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SharedSettle {
    /// The format version ([`SETTLE_FORMAT`]).
    pub v: u32,
    pub tenant: String,
    pub reservation: String,
    pub day_key: String,
    pub session_key: String,
    pub session: Option<String>,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The kinds beyond input and output (format 3 only: a replica that knows only
    /// versions 1 and 2 keeps such a settle, refused and counted, for a newer one to
    /// replay, rather than replay it short of them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_write_1h_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_read_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reasoning_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub web_searches: u64,
    pub usd_micro: i64,
    pub ts_ms: i64,
    /// 1 for a call made; 0 for a release, the reservation given back because no call
    /// was made under it (format 2 only: version 1 has no such field and is always 1).
    #[serde(default = "one_call", skip_serializing_if = "is_one_call")]
    pub calls: u64,
}

fn one_call() -> u64 {
    1
}

fn is_one_call(calls: &u64) -> bool {
    *calls == 1
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The version of [`SharedSettle`]'s encoding this binary writes for a call made; a
/// release is [`RELEASE_FORMAT`], so that a replica that knows only version 1 keeps it
/// (refused, counted) instead of replaying it as a call.
pub const SETTLE_FORMAT: u32 = 1;

/// The version of a kept release's encoding (version 1 with `calls: 0`).
pub const RELEASE_FORMAT: u32 = 2;

/// The version of a kept charge with token kinds beyond input and output (cache writes
/// and reads, reasoning, searches): version 1 with those fields.
pub const KINDS_FORMAT: u32 = 3;

impl SharedSettle {
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// `None` for a version this binary does not know (or a damaged entry).
    pub fn decode(text: &str) -> Option<SharedSettle> {
        serde_json::from_str::<SharedSettle>(text)
            .ok()
            .filter(|s| match s.v {
                SETTLE_FORMAT => s.calls == 1 && !s.tokens().has_extra_kinds(),
                RELEASE_FORMAT => s.calls == 0,
                KINDS_FORMAT => s.calls == 1 && s.tokens().has_extra_kinds(),
                _ => false,
            })
    }

    /// Every kind of token the settle charges.
    pub fn tokens(&self) -> Tokens {
        let hour = self.cache_write_1h_tokens.min(self.cache_write_tokens);
        Tokens {
            input: self.input_tokens,
            cache_write_5m: self.cache_write_tokens - hour,
            cache_write_1h: hour,
            cache_read: self.cache_read_tokens,
            output: self.output_tokens,
            reasoning: self.reasoning_tokens,
            web_searches: self.web_searches,
        }
    }
}

/// How a settle went in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Charged now.
    Now,
    /// Its lease had expired and charged the reserved amount: corrected to the usage.
    Corrected,
    /// It had been settled already (a replay): nothing changed.
    Already,
}

/// The largest amount (calls, tokens, micro-dollars) a script takes: Lua's numbers are
/// doubles, exact up to 2^53. Anything larger is clamped here ($9 billion, 9e15 tokens).
pub const MAX_AMOUNT: i64 = (1 << 53) - 1;

fn micro(usd: f64) -> i64 {
    (usd * 1e6).round().clamp(0.0, MAX_AMOUNT as f64) as i64
}

fn amount(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX).min(MAX_AMOUNT)
}

fn cap(v: Option<u64>) -> i64 {
    v.map_or(-1, amount)
}

fn cap_usd(v: Option<f64>) -> i64 {
    v.map_or(-1, micro)
}

/// A name inside a reservation record: `%` and `|` percent-encoded (the scripts split
/// records on `|` and decode these two back).
fn record_name(name: &str) -> String {
    name.replace('%', "%25").replace('|', "%7C")
}

/// The version of the reservation records this binary writes (see
/// `src/state/redis/prelude_budget.lua`).
pub const RESERVATION_FORMAT: u32 = 1;

/// A reservation's record, version 1 (`src/state/redis/prelude_budget.lua` says what it
/// holds; `session_key` is `""` without a session). Made here rather than in the script,
/// where building it cost the admission a tenth of its time.
fn reservation_record(
    day_key: &str,
    session_key: &str,
    want: [i64; 3],
    model: &str,
    session: &str,
) -> String {
    format!(
        "{}|{}|{}|{}|{}|1|{}|{}",
        record_name(day_key),
        record_name(session_key),
        want[0],
        want[1],
        want[2],
        record_name(model),
        record_name(session)
    )
}

/// Most spend-stream entries one admin read sums.
pub const MAX_STREAM_READ: usize = 100_000;

/// What one admission asks for.
pub struct Admission<'a> {
    pub tenant: &'a str,
    pub session: Option<&'a str>,
    /// Named in the reservation record, so a lease that expires is charged to it.
    pub model: &'a str,
    pub day: i64,
    pub want: Usage,
    pub day_caps: &'a Caps,
    pub session_caps: &'a Caps,
    pub session_names: CapNames,
    pub day_names: CapNames,
}

/// What one client request asks of [`SharedBudgets::gate`] before it runs.
pub struct Gate<'a> {
    pub tenant: &'a str,
    pub session: Option<&'a str>,
    pub tenant_rpm: Option<u32>,
    pub session_rpm: Option<u32>,
    /// The session's concurrency limit (ignored without a session).
    pub max_concurrent: Option<u32>,
    /// The session guard's write-back after deciding this request ([`GATE`] says how).
    pub guard: Option<GuardWrite>,
    /// The first upstream attempt's reservation, made in the same round trip if the
    /// request passes (and the guard admits it).
    pub prepay: Option<Admission<'a>>,
}

/// A session guard's write-back.
pub struct GuardWrite {
    pub write: Write,
    pub ttl_ms: u64,
    /// The guard refuses this request: no concurrency slot is taken.
    pub refuses: bool,
}

/// How [`SharedBudgets::gate`] decided.
pub enum GateReply {
    /// Admitted by the limits (and the guard's state written, if one was asked to be).
    Passed {
        slot: Option<SharedSlot>,
        guard: Option<Written>,
        /// The reservation asked for, when the budgets admitted it.
        prepaid: Option<SharedReservation>,
    },
    RateLimited {
        scope: &'static str,
        retry_after: Duration,
    },
    /// The session is at its concurrency limit.
    Busy { limit: u32 },
    /// Another replica wrote the guard's state first: its version and state. Nothing
    /// was written.
    Moved(u64, String),
}

/// Why an admission was refused.
pub enum AdmitError {
    Over(Exceeded),
    Unavailable(Unavailable),
}

/// The budget scripts, and the members this replica holds (renewed while held).
pub struct SharedBudgets {
    pub redis: Arc<Redis>,
    admit: Script,
    settle: Script,
    gate: Script,
    renew: Script,
    /// Sorted-set key → members held by this replica.
    held: Mutex<HashMap<String, Holding>>,
    session_ttl_s: u64,
    /// Wakes the replayer when a settle was kept.
    kept: tokio::sync::Notify,
}

/// What this replica holds in one sorted set.
#[derive(Default)]
struct Holding {
    /// The set expires with its members' leases ([`RENEW`]): a session's slots, not a
    /// tenant's reservations.
    set_expires: bool,
    members: HashSet<String>,
}

/// Kept settles one replay pass takes on.
const REPLAY_BATCH: usize = 256;

impl SharedBudgets {
    pub fn new(redis: Arc<Redis>, session_retention: Duration) -> Arc<SharedBudgets> {
        Arc::new(SharedBudgets {
            redis,
            admit: Script::new(ADMIT),
            settle: Script::new(SETTLE),
            gate: Script::new(GATE),
            renew: Script::new(RENEW),
            held: Mutex::default(),
            session_ttl_s: session_retention.as_secs().max(60),
            kept: tokio::sync::Notify::new(),
        })
    }

    fn hold(&self, set: &str, member: &str, set_expires: bool) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let holding = held.entry(set.to_string()).or_default();
        holding.set_expires = set_expires;
        holding.members.insert(member.to_string());
    }

    fn unhold(&self, set: &str, member: &str) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(holding) = held.get_mut(set) {
            holding.members.remove(member);
            if holding.members.is_empty() {
                held.remove(set);
            }
        }
    }

    fn day_key(&self, tenant: &str, day: i64) -> String {
        self.redis.key(tenant, &format!("day:{day}"))
    }

    fn session_key(&self, tenant: &str, session: &str) -> String {
        self.redis.key(tenant, &format!("session:{session}"))
    }

    /// Checks and reserves the worst case on the day and the session, in one script.
    pub async fn admit(&self, a: Admission<'_>) -> Result<SharedReservation, AdmitError> {
        let mut adopted_again = false;
        loop {
            match self.admit_once(&a).await {
                Err(AdmitError::Unavailable(Unavailable::Lost)) if !adopted_again => {
                    // Adopted on another replica since? Then work under it and try again.
                    adopted_again = true;
                    if !self
                        .redis
                        .on_lost(a.tenant)
                        .await
                        .map_err(AdmitError::Unavailable)?
                    {
                        return Err(AdmitError::Unavailable(Unavailable::Lost));
                    }
                }
                other => return other,
            }
        }
    }

    async fn admit_once(&self, a: &Admission<'_>) -> Result<SharedReservation, AdmitError> {
        let generation = self
            .redis
            .generation(a.tenant)
            .await
            .map_err(AdmitError::Unavailable)?;
        let mut inv = self.admit.prepare_invoke();
        let held = self.admission(&mut inv, a, &generation);
        let reply: Vec<String> = self
            .redis
            .run(
                "admit",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await
            .map_err(AdmitError::Unavailable)?;
        self.admitted(&reply, a, held)
    }

    /// [`ADMIT`]'s keys and arguments for `a`, added to `inv` under a new reservation
    /// id: the reservation they make, if the script admits it.
    fn admission(
        &self,
        inv: &mut redis::ScriptInvocation<'_>,
        a: &Admission<'_>,
        generation: &str,
    ) -> SharedReservation {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let day_key = self.day_key(a.tenant, a.day);
        let session_key = match a.session {
            Some(s) => self.session_key(a.tenant, s),
            None => self.redis.key(a.tenant, "no-session"),
        };
        let want = [
            amount(a.want.calls),
            amount(a.want.tokens),
            micro(a.want.usd),
        ];
        let record = reservation_record(
            &day_key,
            if a.session.is_some() {
                &session_key
            } else {
                ""
            },
            want,
            a.model,
            a.session.unwrap_or_default(),
        );
        inv.key(self.redis.key(a.tenant, "generation"))
            .key(self.redis.key(a.tenant, "reservations"))
            .key(self.redis.key(a.tenant, "reservation-records"))
            .key(&day_key)
            .key(&session_key)
            .key(self.redis.key(a.tenant, "lease-expired"))
            .key(self.redis.key(a.tenant, "lease-expired-at"))
            .key(self.redis.key(a.tenant, "spend"))
            .arg(generation)
            .arg(&id)
            .arg(ms(self.redis.reservation_ttl))
            .arg(want[0])
            .arg(want[1])
            .arg(want[2])
            .arg(cap(a.day_caps.calls))
            .arg(cap(a.day_caps.tokens))
            .arg(cap_usd(a.day_caps.usd))
            .arg(cap(a.session_caps.calls))
            .arg(cap(a.session_caps.tokens))
            .arg(cap_usd(a.session_caps.usd))
            .arg(if a.session.is_some() { "1" } else { "0" })
            .arg(self.session_ttl_s)
            .arg(record);
        SharedReservation {
            id,
            session: a.session.map(str::to_string),
            day_key,
            session_key,
        }
    }

    /// How [`ADMIT`] replied (`reply`) to the admission of `held`.
    fn admitted(
        &self,
        reply: &[String],
        a: &Admission<'_>,
        held: SharedReservation,
    ) -> Result<SharedReservation, AdmitError> {
        match reply.first().map(String::as_str) {
            Some("ok") => {
                let unknown = reply
                    .get(1)
                    .and_then(|n| n.parse::<u64>().ok())
                    .unwrap_or(0);
                if unknown > 0 {
                    metrics::counter!("backstop_state_unknown_format_total", "record" => "reservation")
                        .increment(unknown);
                    tracing::error!(
                        tenant = a.tenant,
                        records = unknown,
                        known_version = RESERVATION_FORMAT,
                        "expired reservations in a format this replica does not know were left reserved"
                    );
                }
                self.hold(&self.redis.key(a.tenant, "reservations"), &held.id, false);
                Ok(held)
            }
            Some("over") => {
                let names = if reply.get(1).map(String::as_str) == Some("day") {
                    a.day_names
                } else {
                    a.session_names
                };
                let num = |i: usize| {
                    reply
                        .get(i)
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(0.0)
                };
                let (budget, limit, used, requested) = match reply.get(2).map(String::as_str) {
                    Some("1") => (names.calls, num(3), num(4), a.want.calls as f64),
                    Some("2") => (names.tokens, num(3), num(4), a.want.tokens as f64),
                    _ => (names.usd, num(3) / 1e6, num(4) / 1e6, a.want.usd),
                };
                Err(AdmitError::Over(Exceeded {
                    budget,
                    limit,
                    used,
                    requested,
                }))
            }
            // The marker is gone or changed under us: Redis restarted empty.
            _ => Err(AdmitError::Unavailable(Unavailable::Lost)),
        }
    }

    /// What settling `reservation` with `charge` sends to Redis (and keeps, if Redis
    /// cannot take it now).
    pub fn settle_of(
        &self,
        reservation: &SharedReservation,
        charge: SharedCharge<'_>,
    ) -> SharedSettle {
        let t = charge.tokens;
        SharedSettle {
            v: match charge.calls {
                0 => RELEASE_FORMAT,
                _ if t.has_extra_kinds() => KINDS_FORMAT,
                _ => SETTLE_FORMAT,
            },
            calls: charge.calls.min(1),
            tenant: charge.tenant.to_string(),
            reservation: reservation.id.clone(),
            day_key: reservation.day_key.clone(),
            session_key: reservation.session_key.clone(),
            session: reservation.session.clone(),
            model: charge.model.to_string(),
            input_tokens: t.input,
            output_tokens: t.output,
            cache_write_tokens: t.cache_write(),
            cache_write_1h_tokens: t.cache_write_1h,
            cache_read_tokens: t.cache_read,
            reasoning_tokens: t.reasoning,
            web_searches: t.web_searches,
            usd_micro: micro(charge.usd),
            ts_ms: charge.ts_ms,
        }
    }

    /// Settles a reservation with the actual usage: once, however often it is called
    /// (a replay of a settle that did reach Redis changes nothing).
    pub async fn settle(
        &self,
        s: &SharedSettle,
    ) -> Result<(Settled, Option<SessionSeen>), Unavailable> {
        let tenant = s.tenant.as_str();
        let set = self.redis.key(tenant, "reservations");
        self.unhold(&set, &s.reservation);
        let tokens = amount(s.tokens().total());
        let mut inv = self.settle.prepare_invoke();
        inv.key(&set)
            .key(self.redis.key(tenant, "reservation-records"))
            .key(&s.day_key)
            .key(&s.session_key)
            .key(self.redis.key(tenant, "lease-expired"))
            .key(self.redis.key(tenant, "lease-expired-at"))
            .key(self.redis.key(tenant, "spend"))
            .key(
                self.redis
                    .guard_window_key(tenant, s.session.as_deref().unwrap_or("")),
            )
            .arg(&s.reservation)
            .arg(s.calls.min(1))
            .arg(tokens)
            .arg(s.usd_micro.clamp(0, MAX_AMOUNT))
            .arg(if s.session.is_some() { "1" } else { "0" })
            .arg(self.session_ttl_s)
            .arg(s.session.as_deref().unwrap_or(""))
            .arg(&s.model)
            .arg(amount(s.input_tokens))
            .arg(amount(s.output_tokens))
            .arg(s.ts_ms)
            .arg(amount(s.cache_write_tokens))
            .arg(amount(s.cache_read_tokens));
        let reply: Vec<String> = self
            .redis
            .run(
                "settle",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await?;
        let n = |i: usize| {
            reply
                .get(i)
                .and_then(|v| v.parse::<i64>().ok())
                .unwrap_or(0)
                .max(0) as u64
        };
        let how = match reply.first().map(String::as_str) {
            Some("1") => Settled::Now,
            Some("2") => Settled::Corrected,
            _ => Settled::Already,
        };
        match how {
            Settled::Now => {}
            Settled::Corrected => {
                metrics::counter!("backstop_ledger_corrections_total", "outcome" => "corrected", "books" => "redis").increment(1);
                tracing::error!(
                    tenant,
                    reservation = %s.reservation,
                    usd = s.usd_micro as f64 / 1e6,
                    "this replica's reservation outlived its lease in redis (the replica was taken for dead) and was charged at its reserved amount; corrected to the call's true charge"
                );
            }
            Settled::Already => {
                metrics::counter!("backstop_ledger_corrections_total", "outcome" => "discarded", "books" => "redis").increment(1);
                tracing::info!(
                    tenant,
                    reservation = %s.reservation,
                    "a settle found its reservation settled already in redis (a replay); discarded"
                );
            }
        }
        let seen = (reply.len() >= 9).then(|| SessionSeen {
            settled: Usage {
                calls: n(1),
                tokens: n(2),
                usd: n(3) as f64 / 1e6,
            },
            reserved: Usage {
                calls: n(4),
                tokens: n(5),
                usd: n(6) as f64 / 1e6,
            },
            guard_version: n(7),
            guard_quiet: reply.get(8).is_some_and(|q| q == "1"),
        });
        Ok((how, seen))
    }

    /// Keeps a settle Redis could not take in the replica's store, for the replayer.
    /// If even the store cannot take it, the reservation's lease (no longer renewed)
    /// expires within `reservation_ttl` and charges the reserved amount: never nothing.
    pub async fn keep(
        &self,
        store: &Arc<dyn Books>,
        settle: SharedSettle,
        err: Unavailable,
        now_ms: i64,
    ) {
        let queued = QueuedSettle {
            reservation: settle.reservation.clone(),
            body: settle.encode(),
            queued_ms: now_ms,
        };
        match store.queue_settle(queued).await {
            Ok(()) => {
                metrics::counter!("backstop_state_settles_kept_total").increment(1);
                tracing::warn!(
                    tenant = %settle.tenant,
                    reservation = %settle.reservation,
                    usd_micro = settle.usd_micro,
                    error = %err,
                    "redis cannot settle a charge now; kept in the store and replayed until it can"
                );
                self.kept.notify_one();
            }
            Err(store_err) => {
                metrics::counter!("backstop_state_unsettled_total").increment(1);
                tracing::error!(
                    tenant = %settle.tenant,
                    session = settle.session.as_deref(),
                    model = %settle.model,
                    reservation = %settle.reservation,
                    input_tokens = settle.input_tokens,
                    output_tokens = settle.output_tokens,
                    usd_micro = settle.usd_micro,
                    error = %err,
                    store_error = %store_err,
                    "cannot settle a charge in redis nor keep it; its lease will charge the reserved amount"
                );
            }
        }
    }

    /// Replays the settles kept in `store` until Redis takes them: at once (what a
    /// predecessor on the same store left), whenever one is kept, and every
    /// `retry_interval` while any are left.
    pub fn spawn_replayer(self: &Arc<Self>, store: Arc<dyn Books>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let every = this.redis.retry_interval().max(Duration::from_millis(100));
            loop {
                let left = this.replay(&store).await;
                metrics::gauge!("backstop_state_settles_pending").set(left as f64);
                if left == 0 {
                    this.kept.notified().await;
                }
                tokio::time::sleep(every).await;
            }
        })
    }

    /// One replay pass; how many kept settles are left (at least those it could not
    /// replay).
    pub async fn replay(&self, store: &Arc<dyn Books>) -> usize {
        let queued = match store.queued_settles(REPLAY_BATCH).await {
            Ok(queued) => queued,
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the kept settles; trying again");
                return 1;
            }
        };
        let fetched = queued.len();
        let mut left = fetched;
        for q in queued {
            let Some(settle) = SharedSettle::decode(&q.body) else {
                metrics::counter!("backstop_state_unknown_format_total", "record" => "kept_settle")
                    .increment(1);
                tracing::error!(
                    reservation = %q.reservation,
                    known_version = SETTLE_FORMAT,
                    "a kept settle in a format this replica does not know stays kept"
                );
                continue;
            };
            match self.settle(&settle).await {
                Ok((how, _)) => {
                    if let Err(err) = store.unqueue_settle(q.reservation.clone()).await {
                        // Replayed again later: idempotent.
                        tracing::warn!(error = %err, "cannot forget a replayed settle");
                        continue;
                    }
                    left -= 1;
                    metrics::counter!("backstop_state_settles_replayed_total").increment(1);
                    tracing::info!(
                        tenant = %settle.tenant,
                        reservation = %settle.reservation,
                        outcome = ?how,
                        "a kept settle was replayed"
                    );
                }
                // Down: the rest would fail too; the next pass tries again.
                Err(Unavailable::Down(_)) => break,
                Err(_) => continue,
            }
        }
        if left == 0 && fetched == REPLAY_BATCH {
            // A full batch went: there may be more behind it.
            return 1;
        }
        left
    }

    /// Everything a client request asks of the shared state before it runs, in one
    /// round trip ([`GATE`]): rate limits, a concurrency slot, the guard's write-back.
    pub async fn gate(self: &Arc<Self>, ask: Gate<'_>) -> Result<GateReply, Unavailable> {
        let interval = |rpm: Option<u32>| rpm.map_or(0, |n| 60_000_000 / u64::from(n.max(1)));
        let burst = |rpm: Option<u32>| rpm.unwrap_or(0);
        let (tenant, session) = (ask.tenant, ask.session.unwrap_or(""));
        let session_rpm = ask.session.and(ask.session_rpm);
        let limit = ask.session.and(ask.max_concurrent).unwrap_or(0);
        let set = self.redis.key(tenant, &format!("concurrent:{session}"));
        let id = uuid::Uuid::new_v4().simple().to_string();
        // A reservation is asked for under the generation this replica knows; without
        // one (Redis unreachable), the meter asks alone.
        let generation = match &ask.prepay {
            Some(_) => self.redis.generation(tenant).await.ok(),
            None => None,
        };
        let mut inv = self.gate.prepare_invoke();
        inv.key(self.redis.key(tenant, "rate"))
            .key(self.redis.key(tenant, &format!("rate:{session}")))
            .key(&set);
        for key in self.redis.guard_window_keys(tenant, session) {
            inv.key(key);
        }
        inv.arg(interval(ask.tenant_rpm))
            .arg(burst(ask.tenant_rpm))
            .arg(interval(session_rpm))
            .arg(burst(session_rpm))
            .arg(limit)
            .arg(ms(self.redis.reservation_ttl))
            .arg(&id);
        match &ask.guard {
            Some(g) => {
                let (whole, join) = match &g.write {
                    Write::Whole {
                        version,
                        state,
                        window,
                    } => (Some((*version, state, *window)), None),
                    Write::Join(join) => (None, Some(join)),
                    Write::WholeOrJoin {
                        version,
                        state,
                        join,
                    } => (
                        Some((
                            *version,
                            state,
                            WindowWrite::Append {
                                at_ms: join.at_ms,
                                request: join.request,
                                since_ms: join.since_ms,
                            },
                        )),
                        Some(join),
                    ),
                };
                let (state, op, arg) = match whole {
                    Some((version, state, window)) => {
                        let (state, op, arg) = beside_write(state, window, version);
                        inv.arg(version);
                        (state, op, arg)
                    }
                    None => {
                        inv.arg("join");
                        (String::new(), "", String::new())
                    }
                };
                inv.arg(state)
                    .arg(g.ttl_ms.max(1000))
                    .arg(if g.refuses { "1" } else { "0" })
                    .arg(op)
                    .arg(arg);
                match join {
                    Some(j) => inv.arg(j.at_ms).arg(j.request).arg(j.limit).arg(j.since_ms),
                    None => inv.arg("").arg("").arg("").arg(""),
                };
            }
            None => {
                inv.arg("").arg("").arg(0).arg("0").arg("").arg("");
                inv.arg("").arg("").arg("").arg("");
            }
        };
        let prepaid = match (&ask.prepay, &generation) {
            (Some(a), Some(generation)) => Some(self.admission(&mut inv, a, generation)),
            _ => None,
        };
        let reply: Vec<String> = self
            .redis
            .run(
                "gate",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await?;
        let num = |i: usize| reply.get(i).and_then(|v| v.parse::<f64>().ok());
        Ok(match reply.first().map(String::as_str) {
            Some("ok") => {
                let refuses = ask.guard.as_ref().is_some_and(|g| g.refuses);
                let slot = (limit > 0 && !refuses).then(|| {
                    self.hold(&set, &id, true);
                    SharedSlot {
                        budgets: self.clone(),
                        set,
                        id,
                    }
                });
                let version = |i: usize| num(i).map(|v| v as u64);
                // Refused by the budgets or lost: the meter asks again and says why.
                let prepaid = match (prepaid, &ask.prepay) {
                    (Some(held), Some(a)) if reply.len() > 3 => {
                        self.admitted(&reply[3..], a, held).ok()
                    }
                    _ => None,
                };
                GateReply::Passed {
                    slot,
                    guard: version(1).map(|to| Written {
                        from: version(2).unwrap_or(0),
                        to,
                    }),
                    prepaid,
                }
            }
            Some("moved") => GateReply::Moved(
                num(1).map_or(0, |v| v as u64),
                from_beside(
                    reply.get(2).map_or("", String::as_str),
                    reply.get(3).map_or("", String::as_str),
                ),
            ),
            Some("busy") => GateReply::Busy { limit },
            Some(scope) => GateReply::RateLimited {
                scope: if scope == "tenant" {
                    "tenant.requests_per_minute"
                } else {
                    "session.requests_per_minute"
                },
                retry_after: Duration::from_micros(num(1).unwrap_or(0.0) as u64),
            },
            None => GateReply::Passed {
                slot: None,
                guard: None,
                prepaid: None,
            },
        })
    }

    /// A session's settled and reserved usage (calls, tokens, USD).
    pub async fn session_usage(
        &self,
        tenant: &str,
        session: &str,
    ) -> Result<(Usage, Usage), Unavailable> {
        self.usage(self.session_key(tenant, session)).await
    }

    /// A tenant's settled and reserved usage on one day.
    pub async fn day_usage(&self, tenant: &str, day: i64) -> Result<(Usage, Usage), Unavailable> {
        self.usage(self.day_key(tenant, day)).await
    }

    async fn usage(&self, key: String) -> Result<(Usage, Usage), Unavailable> {
        let v: Vec<Option<i64>> = self
            .redis
            .run("read", |mut c| async move {
                redis::cmd("HMGET")
                    .arg(&key)
                    .arg(&["calls", "tokens", "usd", "rcalls", "rtokens", "rusd"])
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let n = |i: usize| v.get(i).copied().flatten().unwrap_or(0).max(0) as u64;
        Ok((
            Usage {
                calls: n(0),
                tokens: n(1),
                usd: n(2) as f64 / 1e6,
            },
            Usage {
                calls: n(3),
                tokens: n(4),
                usd: n(5) as f64 / 1e6,
            },
        ))
    }

    /// A tenant's spend on one UTC day by model, in model order, summed from its spend
    /// stream (whose entry ids are the Redis clock's milliseconds). For the admin view:
    /// it reads the day's entries (at most [`MAX_STREAM_READ`]).
    pub async fn day_by_model(
        &self,
        tenant: &str,
        day: i64,
    ) -> Result<Vec<(String, Usage)>, Unavailable> {
        let key = self.redis.key(tenant, "spend");
        let start = day.saturating_mul(86_400_000);
        let entries: Vec<(String, Vec<String>)> = self
            .redis
            .run("spend_by_model", |mut c| async move {
                redis::cmd("XRANGE")
                    .arg(&key)
                    .arg(start)
                    .arg(start + 86_399_999)
                    .arg("COUNT")
                    .arg(MAX_STREAM_READ)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let mut by_model: std::collections::BTreeMap<String, (i64, i64, i64)> = Default::default();
        for (_, fields) in entries {
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv[0] == name)
                    .and_then(|kv| kv.get(1))
                    .map(String::as_str)
            };
            // Corrections of a lease-expired charge are negative; a settle has no
            // `calls` field before format 1 and counts one call.
            let n = |name: &str| field(name).and_then(|v| v.parse::<i64>().ok());
            let sum = by_model
                .entry(field("model").unwrap_or_default().to_string())
                .or_insert((0i64, 0i64, 0i64));
            sum.0 += n("calls").unwrap_or(1);
            sum.1 += [
                "input_tokens",
                "output_tokens",
                "cache_write_tokens",
                "cache_read_tokens",
            ]
            .into_iter()
            .map(|name| n(name).unwrap_or(0))
            .sum::<i64>();
            sum.2 += n("usd_micro").unwrap_or(0);
        }
        let by_model: Vec<(String, Usage)> = by_model
            .into_iter()
            .map(|(model, (calls, tokens, usd))| {
                let usage = Usage {
                    calls: calls.max(0) as u64,
                    tokens: tokens.max(0) as u64,
                    usd: usd.max(0) as f64 / 1e6,
                };
                (model, usage)
            })
            .collect();
        Ok(by_model)
    }

    /// A session's requests holding a concurrency slot now (on any replica).
    pub async fn in_flight(&self, tenant: &str, session: &str) -> Result<u32, Unavailable> {
        let set = self.redis.key(tenant, &format!("concurrent:{session}"));
        let now_ms = crate::clock::Clock::system().now_ms();
        self.redis
            .run("in_flight", |mut c| async move {
                redis::cmd("ZCOUNT")
                    .arg(&set)
                    .arg(format!("({now_ms}"))
                    .arg("+inf")
                    .query_async(&mut c)
                    .await
            })
            .await
    }

    /// Starts a session's usage over (what is reserved stays).
    pub async fn reset_session(&self, tenant: &str, session: &str) -> Result<(), Unavailable> {
        let key = self.session_key(tenant, session);
        self.redis
            .run("reset", |mut c| async move {
                redis::cmd("HSET")
                    .arg(&key)
                    .arg(&["calls", "0", "tokens", "0", "usd", "0"])
                    .query_async::<()>(&mut c)
                    .await
            })
            .await
    }

    /// Renews every reservation and slot this replica holds, every `reservation_ttl / 3`,
    /// so they outlive their calls only by a replica's death.
    pub fn spawn_renewer(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let every = (this.redis.reservation_ttl / 3).max(Duration::from_millis(100));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                this.renew_held().await;
            }
        })
    }

    /// One renewal of what this replica holds ([`RENEW`], a round trip per set).
    pub async fn renew_held(&self) {
        let held: Vec<(String, bool, Vec<String>)> = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, h)| {
                (
                    k.clone(),
                    h.set_expires,
                    h.members.iter().cloned().collect(),
                )
            })
            .collect();
        for (set, set_expires, members) in held {
            let mut inv = self.renew.prepare_invoke();
            inv.key(&set)
                .arg(ms(self.redis.reservation_ttl))
                .arg(if set_expires { "1" } else { "0" });
            for m in &members {
                inv.arg(m);
            }
            // A failure is counted by `run`; the next tick tries again.
            let _ = self
                .redis
                .run("renew", |mut c| async move {
                    inv.invoke_async::<i64>(&mut c).await
                })
                .await;
        }
    }
}

/// A concurrency slot held in Redis; dropping it gives it back.
pub struct SharedSlot {
    budgets: Arc<SharedBudgets>,
    set: String,
    id: String,
}

impl Drop for SharedSlot {
    fn drop(&mut self) {
        self.budgets.unhold(&self.set, &self.id);
        let (budgets, set, id) = (
            self.budgets.clone(),
            std::mem::take(&mut self.set),
            std::mem::take(&mut self.id),
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                // If this fails the slot expires within reservation_ttl.
                let _ = budgets
                    .redis
                    .run("leave", |mut c| async move {
                        redis::cmd("ZREM")
                            .arg(&set)
                            .arg(&id)
                            .query_async::<i64>(&mut c)
                            .await
                    })
                    .await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(calls: u64) -> SharedSettle {
        SharedSettle {
            v: match calls {
                0 => RELEASE_FORMAT,
                _ => SETTLE_FORMAT,
            },
            tenant: "t".into(),
            reservation: "r1".into(),
            day_key: "bk:{t}:day:20000".into(),
            session_key: "bk:{t}:session:s".into(),
            session: Some("s".into()),
            model: "m".into(),
            input_tokens: 10,
            output_tokens: 20,
            cache_write_tokens: 0,
            cache_write_1h_tokens: 0,
            cache_read_tokens: 0,
            reasoning_tokens: 0,
            web_searches: 0,
            usd_micro: 30,
            ts_ms: 40,
            calls,
        }
    }

    /// A kept charge is written as it always was (version 1, no `calls`); a kept
    /// release is version 2 with `calls: 0`, which a replica that knows only version 1
    /// refuses instead of replaying as a call.
    #[test]
    fn kept_settles_and_releases_have_pinned_bytes() {
        let charge = r#"{"v":1,"tenant":"t","reservation":"r1","day_key":"bk:{t}:day:20000","session_key":"bk:{t}:session:s","session":"s","model":"m","input_tokens":10,"output_tokens":20,"usd_micro":30,"ts_ms":40}"#;
        let release = r#"{"v":2,"tenant":"t","reservation":"r1","day_key":"bk:{t}:day:20000","session_key":"bk:{t}:session:s","session":"s","model":"m","input_tokens":10,"output_tokens":20,"usd_micro":30,"ts_ms":40,"calls":0}"#;
        assert_eq!(kept(1).encode(), charge);
        assert_eq!(kept(0).encode(), release);
        assert_eq!(SharedSettle::decode(charge), Some(kept(1)));
        assert_eq!(SharedSettle::decode(release), Some(kept(0)));
        // A version and a call count that disagree, or a version not known: refused.
        for text in [
            release.replace(r#""v":2"#, r#""v":1"#),
            charge.replace(r#""v":1"#, r#""v":2"#),
            charge.replace(r#""v":1"#, r#""v":3"#),
            charge.replace(r#""v":1"#, r#""v":4"#),
        ] {
            assert_eq!(SharedSettle::decode(&text), None, "{text}");
        }
        // A charge with cache tokens is version 3, which versions 1 and 2 refuse.
        let cached = SharedSettle {
            v: KINDS_FORMAT,
            cache_write_tokens: 7,
            cache_write_1h_tokens: 2,
            cache_read_tokens: 5,
            ..kept(1)
        };
        let text = cached.encode();
        assert_eq!(
            text,
            r#"{"v":3,"tenant":"t","reservation":"r1","day_key":"bk:{t}:day:20000","session_key":"bk:{t}:session:s","session":"s","model":"m","input_tokens":10,"output_tokens":20,"cache_write_tokens":7,"cache_write_1h_tokens":2,"cache_read_tokens":5,"usd_micro":30,"ts_ms":40}"#
        );
        assert_eq!(SharedSettle::decode(&text), Some(cached.clone()));
        assert_eq!(cached.tokens().total(), 42);
        assert_eq!(
            SharedSettle::decode(&text.replace(r#""v":3"#, r#""v":1"#)),
            None,
            "a version 1 reader's own check"
        );
    }
}
