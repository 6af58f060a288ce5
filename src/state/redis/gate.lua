-- gate: what a client request asks of the shared state before it runs, in one script
-- (after prelude_brief.lua, prelude_window.lua, prelude_budget.lua and
-- prelude_admit.lua): the tenant's and the session's rate limiters (GCRA, both or
-- neither), a session concurrency slot, the session guard's write-back and, when asked,
-- the first upstream attempt's reservation (admit.lua). In that order, as the layers
-- decided them one by one: a rate refusal writes nothing; a session at its concurrency
-- limit spends its rate but writes no guard state; a guard that refuses takes no slot
-- and no reservation; a reservation the budgets refuse leaves the rest done (the meter
-- asks again and refuses the call). Times on the server's clock.
--
-- The guard's write-back is either the whole state, compare-and-set on its version
-- (another replica's state written meanwhile is handed back before anything is
-- written, so the request is decided again on it), or, for a request the guard admitted
-- with nothing else changed, the request alone, joined to whatever state is there if
-- the guard would admit it on that state too (`guard_view::Joined`; else the state is
-- handed back the same way). A replica that wrote the shared state last sends both: the
-- whole state, written if the shared state is still at its version, else the request
-- joined. The state is version 2 (`store::format::to_beside`): its window of requests
-- is kept beside it (prelude_window.lua), its brief written beside it
-- (prelude_brief.lua). The admitting phases below are `ADMITTING_PREFIXES` as version
-- 2 begins them (pinned by a test in src/state/redis/mod.rs).
--
-- The guard's three keys expire ARGV[10] after the session's last request, or up to a
-- tenth of it (at most a second) later: their expiry is pushed out, and how far kept in
-- the hash's `x`, when it is less than the expiry away or a key was made just now, not
-- on every request. A script that sets their expiry itself resets `x` to 0.
--
-- KEYS
--   1  the tenant's rate (GCRA theoretical arrival time, µs)
--   2  the session's rate (the same)
--   3  the session's concurrency slots: zset, slot id -> lease end (ms)
--   4  the session's guard hash (v, state, brief, x)
--   5  its window: list of `ms,fingerprint`
--   6  the window's counts: hash, fingerprint -> count
--   7..14  with a reservation: admit.lua's KEYS 1..8
-- ARGV
--   1  the tenant's interval (µs a request; 0: no limit), 2 its burst (requests)
--   3  the session's interval (µs; 0: no limit), 4 its burst
--   5  the concurrency limit (0: none)
--   6  the slot's lease (ms), 7 the slot's id
--   8  the guard write: '' none, 'join', or the version the whole state must be at
--   9  the whole state (version 2 text; '' with none)
--  10  the guard keys' expiry (ms)
--  11  '1' when the guard refuses the request, else '0'
--  12  the whole state's window op ('' keep, 'a' append, 'r' replace), 13 its argument
--      (prelude_window.lua's window_write)
--  14  to join (alone, or if the whole state is not taken; else '' each): when (ms),
--  15  the request's fingerprint, 16 the identical-request limit, 17 the window's
--      start (ms)
--  18..32  with a reservation: admit.lua's ARGV 1..15
-- Replies
--   {'ok', version, version_before, ...}  passed; the guard state's new and previous
--                                         versions ('' each without a guard write),
--                                         followed by admit.lua's reply when a
--                                         reservation was asked for and the guard does
--                                         not refuse
--   {'moved', version, state, window}     another replica's guard state (window:
--                                         `ms,fingerprint` joined by `;`): nothing written
--   {'busy'}                              at the concurrency limit (the rates spent)
--   {'tenant' or 'session', wait_us}      rate-limited: nothing written

local function admits(state)
  for _, phase in ipairs({'{"v":2,"phase":"active",', '{"v":2,"phase":"recovering",'}) do
    if string.sub(state, 1, #phase) == phase then return true end
  end
  return false
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ms = math.floor(now / 1000)
local guarded = ARGV[8] ~= ''
local g, list, seen = KEYS[4], KEYS[5], KEYS[6]
local v, state, op, arg = 0, ARGV[9], ARGV[12], ARGV[13]
local stored, renewed, joined = nil, nil, nil
if guarded then
  local cur = redis.call('HMGET', g, 'v', 'state', 'x')
  v, stored, renewed = tonumber(cur[1] or '0'), cur[2], tonumber(cur[3] or '0')
  if ARGV[8] == 'join' or v ~= tonumber(ARGV[8]) then
    -- Joined, if the guard would admit the request on the state there.
    local at, request = ARGV[14], ARGV[15]
    local limit, since = tonumber(ARGV[16]) or 0, tonumber(ARGV[17]) or 0
    local joins = at ~= '' and stored and beside(stored) and limit > 0 and admits(stored)
    local stale, same = 0, 0
    if joins then
      stale, same = window_stale(list, since, request)
      joins = tonumber(redis.call('HGET', seen, request) or '0') - same < limit
    end
    if not joins then
      return {'moved', fmt(v), stored or '',
        (stored and beside(stored)) and window_text(list) or ''}
    end
    state, joined = stored, {at, request, since, stale}
  end
end
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
if tw > 0 then return {'tenant', fmt(tw)} end
local sn, sw = probe(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]))
if sw > 0 then return {'session', fmt(sw)} end
if tn then redis.call('SET', KEYS[1], fmt(tn), 'PX', fmt(math.ceil((tn - now) / 1000) + 1000)) end
if sn then redis.call('SET', KEYS[2], fmt(sn), 'PX', fmt(math.ceil((sn - now) / 1000) + 1000)) end
local limit = tonumber(ARGV[5])
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(ms))
  if redis.call('ZCARD', KEYS[3]) >= limit then return {'busy'} end
  if ARGV[11] ~= '1' then
    redis.call('ZADD', KEYS[3], fmt(ms + tonumber(ARGV[6])), ARGV[7])
    redis.call('PEXPIRE', KEYS[3], ARGV[6])
  end
end
local out = {'ok', '', ''}
if guarded then
  -- The state's keys live `ttl` past its last request, or up to `slack` longer: their
  -- expiry is pushed out (to `x`) once it is less than `ttl` away, and when a key was
  -- made just now; not on every request.
  local ttl = tonumber(ARGV[10])
  local slack = math.min(1000, math.floor(ttl / 10))
  local renew = renewed < ms + ttl
  local next_v = fmt(v + 1)
  -- A joined request leaves the state as it is: its version and brief move on.
  local fields = {'v', next_v, 'brief', brief(next_v, state)}
  if not joined then
    table.insert(fields, 'state'); table.insert(fields, state)
  end
  if renew then
    table.insert(fields, 'x'); table.insert(fields, fmt(ms + ttl + slack))
  end
  redis.call('HSET', g, unpack(fields))
  local made
  if joined then
    made = window_append(list, seen, joined[1], joined[2], joined[3], joined[4])
  else
    made = window_write(list, seen, stored, op, arg)
  end
  if made or renew then
    local expiry = fmt(ttl + slack)
    redis.call('PEXPIRE', g, expiry)
    window_expire(list, seen, expiry)
  end
  out[2], out[3] = next_v, fmt(v)
end
if ARGV[18] and ARGV[11] ~= '1' then
  local paid = admit({unpack(KEYS, 7, 14)}, {unpack(ARGV, 18, 32)}, ms)
  for i = 1, #paid do out[3 + i] = paid[i] end
end
return out
