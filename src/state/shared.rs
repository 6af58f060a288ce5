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
    policy::budget::{CapNames, Caps, Exceeded, Usage},
    store::connection::ms,
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
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub usd: f64,
    pub ts_ms: i64,
}

fn micro(usd: f64) -> i64 {
    (usd * 1e6).round().clamp(0.0, i64::MAX as f64) as i64
}

fn cap(v: Option<u64>) -> i64 {
    v.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX))
}

fn cap_usd(v: Option<f64>) -> i64 {
    v.map_or(-1, micro)
}

/// Shared by the admission and settle scripts: a reservation record is
/// `day_key|session_key|calls|tokens|micro_usd`; `unreserve` takes it off both scopes.
const UNRESERVE: &str = r#"
local function split(s)
  local out, start = {}, 1
  while true do
    local i = string.find(s, '|', start, true)
    if not i then table.insert(out, string.sub(s, start)); return out end
    table.insert(out, string.sub(s, start, i - 1)); start = i + 1
  end
end
local function unreserve(rec)
  local r = split(rec)
  for _, k in ipairs({r[1], r[2]}) do
    if k ~= '' then
      redis.call('HINCRBY', k, 'rcalls', -tonumber(r[3]))
      redis.call('HINCRBY', k, 'rtokens', -tonumber(r[4]))
      redis.call('HINCRBY', k, 'rusd', -tonumber(r[5]))
    end
  end
end
"#;

/// The admission: one script over the tenant's generation, reservations, day and
/// session. Replies `{"ok"}`, `{"lost"}` or `{"over", scope, which, limit, used}`.
const ADMIT: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {'lost'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 256)) do
  local rec = redis.call('HGET', KEYS[3], id)
  if rec then unreserve(rec); redis.call('HDEL', KEYS[3], id) end
  redis.call('ZREM', KEYS[2], id)
end
local want = {tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])}
local function over(key, caps, scope)
  local v = redis.call('HMGET', key, 'calls', 'tokens', 'usd', 'rcalls', 'rtokens', 'rusd')
  for i = 1, 3 do
    local used = (tonumber(v[i]) or 0) + (tonumber(v[i + 3]) or 0)
    if caps[i] >= 0 and used + want[i] > caps[i] then
      return {'over', scope, tostring(i), tostring(caps[i]), tostring(used)}
    end
  end
  return nil
end
local day_caps = {tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])}
local refused = over(KEYS[4], day_caps, 'day')
if refused then return refused end
local has_session = ARGV[13] == '1'
if has_session then
  refused = over(KEYS[5], {tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])}, 'session')
  if refused then return refused end
end
local fields = {'rcalls', 'rtokens', 'rusd'}
local session_key = ''
for i = 1, 3 do redis.call('HINCRBY', KEYS[4], fields[i], want[i]) end
redis.call('EXPIRE', KEYS[4], 259200)
if has_session then
  session_key = KEYS[5]
  for i = 1, 3 do redis.call('HINCRBY', KEYS[5], fields[i], want[i]) end
  redis.call('EXPIRE', KEYS[5], tonumber(ARGV[14]))
end
redis.call('HSET', KEYS[3], ARGV[2], KEYS[4] .. '|' .. session_key .. '|' .. ARGV[4] .. '|' .. ARGV[5] .. '|' .. ARGV[6])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
return {'ok'}
"#;

/// Settles a reservation once: unreserves it if it is still held, charges the actual
/// usage either way, and appends the charge to the spend stream. 1 = settled now, 0 =
/// it was already.
const SETTLE: &str = r#"
if not redis.call('SET', KEYS[5], '1', 'NX', 'EX', 86400) then return 0 end
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then unreserve(rec); redis.call('HDEL', KEYS[2], ARGV[1]) end
redis.call('ZREM', KEYS[1], ARGV[1])
local fields = {'calls', 'tokens', 'usd'}
for i = 1, 3 do redis.call('HINCRBY', KEYS[3], fields[i], tonumber(ARGV[i + 1])) end
redis.call('EXPIRE', KEYS[3], 259200)
if ARGV[5] == '1' then
  for i = 1, 3 do redis.call('HINCRBY', KEYS[4], fields[i], tonumber(ARGV[i + 1])) end
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[6]))
end
redis.call('XADD', KEYS[6], 'MAXLEN', '~', 1000000, '*',
  'reservation', ARGV[1], 'session', ARGV[7], 'model', ARGV[8], 'input_tokens', ARGV[9],
  'output_tokens', ARGV[10], 'usd_micro', ARGV[4], 'ts_ms', ARGV[11])
return 1
"#;

/// GCRA over the tenant's and the session's limiters, both or neither: `{"ok"}` or
/// `{scope, wait_us}`. Times in microseconds on the server's clock.
const RATE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function probe(key, interval, burst)
  if interval <= 0 then return nil, 0 end
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  local new_tat = tat + interval
  local allow_at = new_tat - burst * interval
  if allow_at > now then return nil, allow_at - now end
  return new_tat, 0
end
local tn, tw = probe(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
if tw > 0 then return {'tenant', tostring(tw)} end
local sn, sw = probe(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
if sw > 0 then return {'session', tostring(sw)} end
if tn then redis.call('SET', KEYS[1], string.format('%.0f', tn), 'PX', math.ceil((tn - now) / 1000) + 1000) end
if sn then redis.call('SET', KEYS[2], string.format('%.0f', sn), 'PX', math.ceil((sn - now) / 1000) + 1000) end
return {'ok'}
"#;

/// A session concurrency slot: 1 = taken, 0 = the session is at its limit.
const ENTER: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"#;

/// Pushes the expiry of held members (reservations, slots) of one sorted set.
const RENEW: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2) end
return 1
"#;

/// Most spend-stream entries one admin read sums.
pub const MAX_STREAM_READ: usize = 100_000;

/// What one admission asks for.
pub struct Admission<'a> {
    pub tenant: &'a str,
    pub session: Option<&'a str>,
    pub day: i64,
    pub want: Usage,
    pub day_caps: &'a Caps,
    pub session_caps: &'a Caps,
    pub session_names: CapNames,
    pub day_names: CapNames,
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
    rate: Script,
    enter: Script,
    renew: Script,
    /// Sorted-set key → members held by this replica.
    held: Mutex<HashMap<String, HashSet<String>>>,
    session_ttl_s: u64,
}

impl SharedBudgets {
    pub fn new(redis: Arc<Redis>, session_retention: Duration) -> Arc<SharedBudgets> {
        Arc::new(SharedBudgets {
            redis,
            admit: Script::new(&format!("{UNRESERVE}{ADMIT}")),
            settle: Script::new(&format!("{UNRESERVE}{SETTLE}")),
            rate: Script::new(RATE),
            enter: Script::new(ENTER),
            renew: Script::new(RENEW),
            held: Mutex::default(),
            session_ttl_s: session_retention.as_secs().max(60),
        })
    }

    fn hold(&self, set: &str, member: &str) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(set.to_string())
            .or_default()
            .insert(member.to_string());
    }

    fn unhold(&self, set: &str, member: &str) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(members) = held.get_mut(set) {
            members.remove(member);
            if members.is_empty() {
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
        let generation = self
            .redis
            .generation(a.tenant)
            .await
            .map_err(AdmitError::Unavailable)?;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let day_key = self.day_key(a.tenant, a.day);
        let session_key = match a.session {
            Some(s) => self.session_key(a.tenant, s),
            None => self.redis.key(a.tenant, "no-session"),
        };
        let set = self.redis.key(a.tenant, "reservations");
        let mut inv = self.admit.prepare_invoke();
        inv.key(self.redis.key(a.tenant, "generation"))
            .key(&set)
            .key(self.redis.key(a.tenant, "reservation-records"))
            .key(&day_key)
            .key(&session_key)
            .arg(&generation)
            .arg(&id)
            .arg(ms(self.redis.reservation_ttl))
            .arg(cap(Some(a.want.calls)))
            .arg(cap(Some(a.want.tokens)))
            .arg(micro(a.want.usd))
            .arg(cap(a.day_caps.calls))
            .arg(cap(a.day_caps.tokens))
            .arg(cap_usd(a.day_caps.usd))
            .arg(cap(a.session_caps.calls))
            .arg(cap(a.session_caps.tokens))
            .arg(cap_usd(a.session_caps.usd))
            .arg(if a.session.is_some() { "1" } else { "0" })
            .arg(self.session_ttl_s);
        let reply: Vec<String> = self
            .redis
            .run(
                "admit",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await
            .map_err(AdmitError::Unavailable)?;
        match reply.first().map(String::as_str) {
            Some("ok") => {
                self.hold(&set, &id);
                Ok(SharedReservation {
                    id,
                    session: a.session.map(str::to_string),
                    day_key,
                    session_key,
                })
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
            _ => {
                // The marker is gone or changed under us: Redis restarted empty.
                metrics::counter!("backstop_state_lost_total").increment(1);
                tracing::error!(tenant = a.tenant, "{}", Unavailable::Lost);
                Err(AdmitError::Unavailable(Unavailable::Lost))
            }
        }
    }

    /// Settles a reservation with the actual usage (once, even if called again).
    pub async fn settle(
        &self,
        reservation: &SharedReservation,
        charge: SharedCharge<'_>,
    ) -> Result<(), Unavailable> {
        let tenant = charge.tenant;
        let set = self.redis.key(tenant, "reservations");
        self.unhold(&set, &reservation.id);
        let mut inv = self.settle.prepare_invoke();
        inv.key(&set)
            .key(self.redis.key(tenant, "reservation-records"))
            .key(&reservation.day_key)
            .key(&reservation.session_key)
            .key(
                self.redis
                    .key(tenant, &format!("settled:{}", reservation.id)),
            )
            .key(self.redis.key(tenant, "spend"))
            .arg(&reservation.id)
            .arg(1)
            .arg(charge.input_tokens.saturating_add(charge.output_tokens))
            .arg(micro(charge.usd))
            .arg(if reservation.session.is_some() {
                "1"
            } else {
                "0"
            })
            .arg(self.session_ttl_s)
            .arg(reservation.session.as_deref().unwrap_or(""))
            .arg(charge.model)
            .arg(charge.input_tokens)
            .arg(charge.output_tokens)
            .arg(charge.ts_ms);
        let _: i64 = self
            .redis
            .run(
                "settle",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await?;
        Ok(())
    }

    /// The tenant's and the session's rate limiters (per minute), both or neither.
    /// `Ok(None)`: admitted; `Ok(Some((scope, wait)))`: refused.
    pub async fn rate(
        &self,
        tenant: &str,
        session: Option<&str>,
        tenant_rpm: Option<u32>,
        session_rpm: Option<u32>,
    ) -> Result<Option<(&'static str, Duration)>, Unavailable> {
        let interval = |rpm: Option<u32>| rpm.map_or(0, |n| 60_000_000 / u64::from(n.max(1)));
        let burst = |rpm: Option<u32>| rpm.unwrap_or(0);
        let session_rpm = session.and(session_rpm);
        let mut inv = self.rate.prepare_invoke();
        inv.key(self.redis.key(tenant, "rate"))
            .key(
                self.redis
                    .key(tenant, &format!("rate:{}", session.unwrap_or(""))),
            )
            .arg(interval(tenant_rpm))
            .arg(burst(tenant_rpm))
            .arg(interval(session_rpm))
            .arg(burst(session_rpm));
        let reply: Vec<String> = self
            .redis
            .run(
                "rate",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await?;
        let wait = |v: Option<&String>| {
            Duration::from_micros(v.and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as u64)
        };
        Ok(match reply.first().map(String::as_str) {
            Some("tenant") => Some(("tenant.requests_per_minute", wait(reply.get(1)))),
            Some("session") => Some(("session.requests_per_minute", wait(reply.get(1)))),
            _ => None,
        })
    }

    /// Takes one of the session's `limit` concurrency slots. `Ok(None)`: at the limit.
    pub async fn enter(
        self: &Arc<Self>,
        tenant: &str,
        session: &str,
        limit: u32,
    ) -> Result<Option<SharedSlot>, Unavailable> {
        let set = self.redis.key(tenant, &format!("concurrent:{session}"));
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mut inv = self.enter.prepare_invoke();
        inv.key(&set)
            .arg(limit)
            .arg(ms(self.redis.reservation_ttl))
            .arg(&id);
        let taken: i64 = self
            .redis
            .run(
                "enter",
                |mut c| async move { inv.invoke_async(&mut c).await },
            )
            .await?;
        if taken == 0 {
            return Ok(None);
        }
        self.hold(&set, &id);
        Ok(Some(SharedSlot {
            budgets: self.clone(),
            set,
            id,
        }))
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
        let mut by_model: std::collections::BTreeMap<String, Usage> = Default::default();
        for (_, fields) in entries {
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv[0] == name)
                    .and_then(|kv| kv.get(1))
                    .map(String::as_str)
            };
            let n = |name: &str| field(name).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            let usage = by_model
                .entry(field("model").unwrap_or_default().to_string())
                .or_default();
            usage.calls += 1;
            usage.tokens += n("input_tokens") + n("output_tokens");
            usage.usd += n("usd_micro") as f64 / 1e6;
        }
        Ok(by_model.into_iter().collect())
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
                let held: Vec<(String, Vec<String>)> = this
                    .held
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .map(|(k, v)| (k.clone(), v.iter().cloned().collect()))
                    .collect();
                for (set, members) in held {
                    let mut inv = this.renew.prepare_invoke();
                    inv.key(&set).arg(ms(this.redis.reservation_ttl));
                    for m in &members {
                        inv.arg(m);
                    }
                    // A failure is counted by `run`; the next tick tries again.
                    let _ = this
                        .redis
                        .run("renew", |mut c| async move {
                            inv.invoke_async::<i64>(&mut c).await
                        })
                        .await;
                }
            }
        })
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
