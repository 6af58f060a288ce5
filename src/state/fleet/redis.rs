//! The fleet view in Redis, for replicas: the same rules as
//! [`TenantView`](crate::policy::fleet::TenantView), as server-side scripts, so every
//! replica's failures count into one view and each decision (hot or not, a probe or a
//! refusal, a cool-down) is taken once for all of them. Times are the replicas' clocks
//! (passed in, like the embedded view's), never Redis's.
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
//! ([`FAILED_AND_SAVE`]), so the trip it decides is imposed in that write, one round trip
//! after the request's call. That script is on the failure path, and each command it
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

/// Shared by the scripts: ARGV[1] the tenant's key prefix, ARGV[2] now (ms), ARGV[3] the
/// window (ms), ARGV[4] the keys' expiry (ms).
const COMMON: &str = r#"
local P, now, window, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local function forget(sig)
  local e, stats = P .. 'e:' .. sig, P .. 'stats'
  local v = redis.call('HMGET', e, 'shape', 'tripped', 'preempted', 'confirmed', 'unconfirmed',
    'acalls', 'ausd')
  local shape = v[1]
  local pending = redis.call('HLEN', P .. 'p:' .. sig)
  if pending > 0 then redis.call('HINCRBY', stats, 'expired', pending) end
  local names = {'tripped', 'preempted', 'confirmed', 'unconfirmed'}
  for i = 1, 4 do
    if v[i + 1] then redis.call('HINCRBY', stats, 'r:' .. names[i], v[i + 1]) end
  end
  if v[6] then redis.call('HINCRBYFLOAT', stats, 'r:avoided_calls', v[6]) end
  if v[7] then redis.call('HINCRBYFLOAT', stats, 'r:avoided_usd', v[7]) end
  redis.call('PEXPIRE', stats, 604800000)
  redis.call('DEL', e, P .. 'f:' .. sig, P .. 'c:' .. sig, P .. 'q:' .. sig, P .. 'p:' .. sig)
  redis.call('ZREM', P .. 'index', sig)
  if shape then redis.call('HDEL', P .. 'watch', shape .. ':' .. sig) end
end
local function touch(sig)
  for _, k in ipairs({'e:', 'q:', 'p:'}) do redis.call('PEXPIRE', P .. k .. sig, ttl) end
  for _, k in ipairs({'index', 'watch', 'singles', 'singles:t'}) do redis.call('PEXPIRE', P .. k, ttl) end
end
local function predict(sig, session, cap)
  local p = P .. 'p:' .. sig
  if redis.call('HEXISTS', p, session) == 1 then return end
  if redis.call('HLEN', p) >= cap then
    redis.call('HINCRBY', P .. 'stats', 'expired', 1)
    return
  end
  redis.call('HSET', p, session, now)
end
local function watch(sig, shape, state)
  redis.call('HSET', P .. 'watch', shape .. ':' .. sig, state .. '|' .. (now + window))
end
"#;

/// A failure: ARGV[5..] sig, shape, description, session, calls, micro-USD, min_failures,
/// min_sessions, cool_down, the singles' cap, the table's cap, the sessions' cap, the
/// predictions' cap. Replies `{"single"}`, `{"untracked"}` or
/// `{"counted", trip, sessions, qualified, confirmed, probe_at}`.
const FAILED: &str = r#"
local sig, shape, desc, session = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local calls, usd = tonumber(ARGV[9]), tonumber(ARGV[10])
local min_failures, min_sessions, cool_down = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local index, singles, singles_t = P .. 'index', P .. 'singles', P .. 'singles:t'
-- Times as integers' strings: Lua would print a number as a float, slowly.
local now_s, stale = ARGV[2], string.format('%d', now - window - 1)
-- A signature's place in the index, like its keys' expiry, is refreshed once per
-- `refresh` (its 'kept' time), not at each failure: an index time is up to that old.
local refresh = math.floor(window / 8)
local e = P .. 'e:' .. sig
local qz, pz = P .. 'q:' .. sig, P .. 'p:' .. sig
-- The session's count and last failure, in the entry: `s:{session}` = 'count|last'.
local own = 's:' .. session
-- 'state' is set whenever the entry exists.
local st = redis.call('HMGET', e, 'state', 'last', 'probe_at', 'fails', 'fcalls', 'fusd', 'tripped',
  'confirmed', 'kept', 'n', own)
if st[1] and now - tonumber(st[2] or '0') > window then
  forget(sig)
  st = {}
end
-- Helpers are made where they are used: a closure made at each call costs it too.
if not st[1] then
  local function sweep_index()
    for _, old in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', stale, 'LIMIT', 0, 16)) do
      local last = tonumber(redis.call('HGET', P .. 'e:' .. old, 'last') or '0')
      if now - last > window then forget(old) else redis.call('ZADD', index, last, old) end
    end
  end
  local function keep_single(s, at, c, u)
    for _, old in ipairs(redis.call('ZRANGEBYSCORE', singles_t, '-inf', stale, 'LIMIT', 0, 64)) do
      redis.call('HDEL', singles, old); redis.call('ZREM', singles_t, old)
    end
    redis.call('HSET', singles, sig, s .. '|' .. at .. '|' .. c .. '|' .. u)
    redis.call('ZADD', singles_t, at, sig)
    local over = redis.call('ZCARD', singles_t) - tonumber(ARGV[14])
    if over > 0 then
      local popped = redis.call('ZPOPMIN', singles_t, over)
      for i = 1, #popped, 2 do redis.call('HDEL', singles, popped[i]) end
    end
    redis.call('PEXPIRE', singles, ttl); redis.call('PEXPIRE', singles_t, ttl)
  end
  -- Stale signatures are swept (their records kept in the stats) as new ones come.
  sweep_index()
  local kept = redis.call('HGET', singles, sig)
  local first = kept and {string.match(kept, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')}
  if not first or not first[2] or now - tonumber(first[2]) > window then
    keep_single(session, now_s, ARGV[9], ARGV[10])
    return {'single'}
  end
  redis.call('HDEL', singles, sig); redis.call('ZREM', singles_t, sig)
  if redis.call('ZCARD', index) >= tonumber(ARGV[15]) then
    local victim, best = nil, nil
    for _, old in ipairs(redis.call('ZRANGE', index, 0, 15)) do
      if redis.call('HGET', P .. 'e:' .. old, 'state') ~= 'hot' then
        local n = tonumber(redis.call('HGET', P .. 'e:' .. old, 'n') or '0')
        local rank = redis.call('ZCARD', P .. 'q:' .. old) * 1e6 + n
        if not best or rank < best then best, victim = rank, old end
      end
    end
    if not victim then
      keep_single(first[1], first[2], first[3], first[4])
      redis.call('HINCRBY', P .. 'stats', 'untracked', 1)
      return {'untracked'}
    end
    forget(victim)
  end
  redis.call('HSET', e, 'shape', shape, 'desc', desc, 'first', first[2], 'last', first[2],
    'state', 'warm', 's:' .. first[1], '1|' .. first[2])
  st = {'warm', first[2], nil, 1, first[3], first[4], nil, nil, nil, 1}
  if first[1] == session then st[11] = '1|' .. first[2] end
end
local state = st[1]
-- The keys this call may have made are given their expiry; all of them once per refresh.
local written = {}
local kept = st[9] and now - tonumber(st[9]) < refresh
if not kept then
  redis.call('ZADD', index, now_s, sig)
  written = {e, qz, pz, index}
end
-- The sessions that failed (the entry's `s:` fields), `n` of them: those whose last
-- failure left the window are dropped once per refresh, and the least recent when there
-- are `cap`; a session's count starts again once its last failure left the window.
local cap, n = tonumber(ARGV[16]), tonumber(st[10] or '0')
-- The session is among the `n` while its field is there: fresh, or stale and not swept.
local count, counted = 1, false
if st[11] then
  local c, at = string.match(st[11], '^(%d+)|(%d+)$')
  if c and now - tonumber(at) <= window then count = tonumber(c) + 1 end
  counted = count > 1 or kept
end
if not kept or (not counted and n >= cap) then
  local function sweep(limit)
    local all = redis.call('HGETALL', e)
    local live, drop, sessions = {}, {}, 0
    for i = 1, #all, 2 do
      if string.sub(all[i], 1, 2) == 's:' then
        sessions = sessions + 1
        local at = tonumber(string.match(all[i + 1], '|(%d+)$') or '0')
        if now - at > window then table.insert(drop, all[i]) else table.insert(live, {at, all[i]}) end
      end
    end
    if #live > limit then
      table.sort(live, function(a, b) return a[1] < b[1] end)
      for i = 1, #live - limit do table.insert(drop, live[i][2]) end
    end
    for i = 1, #drop, 1000 do
      local fields, ids = {}, {}
      for j = i, math.min(i + 999, #drop) do
        table.insert(fields, drop[j]); table.insert(ids, string.sub(drop[j], 3))
      end
      redis.call('HDEL', e, unpack(fields)); redis.call('ZREM', qz, unpack(ids))
    end
    return sessions - #drop
  end
  if not kept then n = sweep(cap) end
  if not counted and n >= cap then n = sweep(cap - math.max(1, math.floor(cap / 8))) end
end
if not counted then n = n + 1 end
if count >= min_failures and redis.call('ZADD', qz, now_s, session) == 1 and kept then
  table.insert(written, qz)
end
-- Only a signature that has been hot has predictions, or a place among the watched.
local confirmed = 0
if state ~= 'warm' then confirmed = redis.call('HDEL', pz, session) end
local hot = state == 'hot'
local probe_at = tonumber(st[3] or '0') or 0
-- Sessions qualify only by failing: none did unless this one did.
local qualified = 0
if hot or count >= min_failures then
  qualified = redis.call('ZCOUNT', qz, string.format('%d', now - window), '+inf')
end
local fmt = string.format
local fields = {'last', now_s, 'n', fmt('%d', n), 'fails', fmt('%d', tonumber(st[4] or '0') + 1),
  'fcalls', fmt('%d', tonumber(st[5] or '0') + calls), 'fusd', fmt('%d', tonumber(st[6] or '0') + usd),
  own, count .. '|' .. now_s}
if not kept then table.insert(fields, 'kept'); table.insert(fields, now_s) end
if confirmed == 1 then
  table.insert(fields, 'confirmed'); table.insert(fields, fmt('%d', tonumber(st[8] or '0') + 1))
end
if not hot and qualified >= min_sessions then
  hot, probe_at = true, now + cool_down
  for _, v in ipairs({'state', 'hot', 'since', now_s, 'probe_at', fmt('%d', probe_at)}) do
    table.insert(fields, v)
  end
end
local trip, sessions = 0, 0
if hot then
  trip = 1
  table.insert(fields, 'tripped'); table.insert(fields, fmt('%d', tonumber(st[7] or '0') + 1))
  predict(sig, session, tonumber(ARGV[17]))
  watch(sig, shape, 'hot')
  table.insert(written, pz)
  table.insert(written, P .. 'watch')
  sessions = n
elseif state ~= 'warm' and redis.call('HLEN', pz) == 0 then
  redis.call('HDEL', P .. 'watch', shape .. ':' .. sig)
end
redis.call('HSET', e, unpack(fields))
for _, k in ipairs(written) do redis.call('PEXPIRE', k, ttl) end
return {'counted', tostring(trip), tostring(sessions), tostring(qualified),
  tostring(confirmed), fmt('%d', probe_at), desc}
"#;

/// A failure counted ([`FAILED`], as a function of the same arguments) and the session
/// guard's write-back in the same round trip, for replicas: the compare-and-set of
/// [`crate::store::RedisStore`]'s `save_guard_window` on KEYS[2] (the session's guard
/// state, under the same hash tag as the fleet's keys; KEYS[3] and KEYS[4] its window and
/// the window's counts, see [`crate::store::format::to_beside`]), of ARGV[20] (the
/// failure recorded) or, when the count trips the session and ARGV[23..25] are given, of
/// the state with the trip imposed: ARGV[23] .. sessions .. ARGV[24] .. qualified ..
/// ARGV[25], the counts the reply gives. ARGV[18] the guard state's version, ARGV[19]
/// its expiry (ms), ARGV[21] and ARGV[22] the window's op and argument (a failure adds no
/// request). Replies `{"saved", version, "", ""}` or `{"moved", version, state, window}`
/// (nothing written: another replica wrote first), then [`FAILED`]'s reply, whose count
/// stands either way.
const FAILED_AND_SAVE: &str = r#"
local fleet = count()
local g, list, seen = KEYS[2], KEYS[3], KEYS[4]
local version, gttl = tonumber(ARGV[18]), tonumber(ARGV[19])
local state = ARGV[20]
if fleet[1] == 'counted' and fleet[2] == '1' and ARGV[25] then
  state = ARGV[23] .. fleet[3] .. ARGV[24] .. fleet[4] .. ARGV[25]
end
local cur = redis.call('HMGET', g, 'v', 'state')
local v = tonumber(cur[1] or '0')
local out
if v ~= version then
  out = {'moved', tostring(v), cur[2] or '', (cur[2] and beside(cur[2])) and window_text(list) or ''}
else
  redis.call('HSET', g, 'v', v + 1, 'state', state, 'brief', brief(v + 1, state), 'x', '0')
  window_write(list, seen, cur[2], ARGV[21], ARGV[22])
  redis.call('PEXPIRE', g, gttl)
  window_expire(list, seen, gttl)
  out = {'saved', tostring(v + 1), '', ''}
end
for _, f in ipairs(fleet) do table.insert(out, f) end
return out
"#;

/// The preemptive check: ARGV[5] the session, ARGV[6] cool_down, ARGV[7] the
/// predictions' cap, ARGV[8..] the signatures of the shape. Replies `{"clear"}`,
/// `{"probe", sig}` or `{"refuse", sig, description, sessions, qualified, probe_at}`.
const CHECK: &str = r#"
local session, cool_down = ARGV[5], tonumber(ARGV[6])
for i = 8, #ARGV do
  local sig = ARGV[i]
  local e = P .. 'e:' .. sig
  local st = redis.call('HMGET', e, 'state', 'probe_at', 'last', 'desc', 'n')
  if st[1] == 'hot' and now - tonumber(st[3]) <= window then
    local probe_at = tonumber(st[2])
    if now >= probe_at then
      redis.call('HSET', e, 'probe_at', now + cool_down)
      return {'probe', sig}
    end
    redis.call('HINCRBY', e, 'preempted', 1)
    predict(sig, session, tonumber(ARGV[7]))
    touch(sig)
    return {'refuse', sig, st[4], st[5] or '0',
      tostring(redis.call('ZCOUNT', P .. 'q:' .. sig, now - window, '+inf')), tostring(probe_at)}
  end
end
return {'clear'}
"#;

/// A request of a watched shape succeeded: ARGV[5] the session, ARGV[6..] the
/// signatures of the shape. Replies `{cooled, unconfirmed}`.
const SUCCEEDED: &str = r#"
local session = ARGV[5]
local cooled, unconfirmed = 0, 0
for i = 6, #ARGV do
  local sig = ARGV[i]
  local e = P .. 'e:' .. sig
  if redis.call('EXISTS', e) == 1 then
    local p = P .. 'p:' .. sig
    if redis.call('HDEL', p, session) == 1 then
      redis.call('HINCRBY', e, 'unconfirmed', 1)
      unconfirmed = 1
    end
    local st = redis.call('HMGET', e, 'state', 'shape')
    if st[1] == 'hot' then
      redis.call('HSET', e, 'state', 'cooled', 'cooled_at', now, 'last', now, 'n', 0)
      local own = {}
      for _, f in ipairs(redis.call('HKEYS', e)) do
        if string.sub(f, 1, 2) == 's:' then table.insert(own, f) end
      end
      for j = 1, #own, 1000 do redis.call('HDEL', e, unpack(own, j, math.min(j + 999, #own))) end
      redis.call('DEL', P .. 'f:' .. sig, P .. 'c:' .. sig, P .. 'q:' .. sig)
      redis.call('ZADD', P .. 'index', now, sig)
      cooled = cooled + 1
    end
    if redis.call('HLEN', p) > 0 then watch(sig, st[2], 'cooled')
    else redis.call('HDEL', P .. 'watch', st[2] .. ':' .. sig) end
    touch(sig)
  end
end
return {tostring(cooled), tostring(unconfirmed)}
"#;

/// Refusals credited to a signature: ARGV[5] sig, ARGV[6] requests.
const AVOIDED: &str = r#"
local e = P .. 'e:' .. ARGV[5]
local v = redis.call('HMGET', e, 'fails', 'fcalls', 'fusd')
if not v[1] then return 0 end
local n, r = math.max(tonumber(v[1]), 1), tonumber(ARGV[6])
redis.call('HINCRBYFLOAT', e, 'acalls', string.format('%.6f', r * tonumber(v[2] or '0') / n))
redis.call('HINCRBYFLOAT', e, 'ausd', string.format('%.9f', r * tonumber(v[3] or '0') / n / 1e6))
return 1
"#;

/// The fields [`REPORT`] sends per signature, in order.
const REPORT_FIELDS: usize = 18;

/// The report: ARGV[5] the most signatures to list. Replies the count, then
/// [`REPORT_FIELDS`] per signature, then the stats as field/value pairs.
const REPORT: &str = r#"
local out = {}
-- Index times lag by up to a refresh (window / 8): signatures last seen out of the
-- window are left out here.
local sigs = {}
for _, sig in ipairs(redis.call('ZREVRANGEBYSCORE', P .. 'index', '+inf', now - window - math.floor(window / 8), 'LIMIT', 0, tonumber(ARGV[5]))) do
  if now - tonumber(redis.call('HGET', P .. 'e:' .. sig, 'last') or '0') <= window then table.insert(sigs, sig) end
end
table.insert(out, tostring(#sigs))
for _, sig in ipairs(sigs) do
  local v = redis.call('HMGET', P .. 'e:' .. sig, 'desc', 'state', 'first', 'last', 'fails',
    'tripped', 'preempted', 'confirmed', 'unconfirmed', 'acalls', 'ausd', 'probe_at', 'since', 'cooled_at', 'n')
  table.insert(out, sig)
  for i = 1, 14 do table.insert(out, v[i] or '') end
  table.insert(out, v[15] or '0')
  table.insert(out, tostring(redis.call('ZCOUNT', P .. 'q:' .. sig, now - window, '+inf')))
  table.insert(out, tostring(redis.call('HLEN', P .. 'p:' .. sig)))
end
for _, v in ipairs(redis.call('HGETALL', P .. 'stats')) do table.insert(out, v) end
return out
"#;

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

/// [`FAILED`]'s arguments after the common ones.
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
        let script = |body: &str| Script::new(&format!("{COMMON}{body}"));
        SharedFleet {
            redis,
            clock,
            failed: script(FAILED),
            failed_and_save: Script::new(&format!(
                "{COMMON}{}{}\nlocal function count()\n{FAILED}\nend\n{FAILED_AND_SAVE}",
                format::brief_lua(),
                format::window_lua(crate::policy::guard::RECENT_CAP)
            )),
            check: script(CHECK),
            succeeded: script(SUCCEEDED),
            avoided: script(AVOIDED),
            report: script(REPORT),
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
    /// ([`FAILED_AND_SAVE`]): the failure counted, and the guard state written as the
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

    /// [`FAILED`]'s reply, read (and a trip noted in this replica's watched shapes).
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
