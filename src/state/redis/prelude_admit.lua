-- Prelude of the admit and gate scripts (after prelude_budget.lua): `admit(K, A, now)`,
-- the admission, a function of its keys and arguments so the gate can run it on a
-- slice of its own (KEYS[7..14], ARGV[18..32]). K and A are admit.lua's KEYS and ARGV,
-- documented there, as is the reply; `now` (ms, the server's clock) when the caller
-- read the clock already, else nil (read here).
--
-- First it charges the reservations whose lease has expired (a replica died holding
-- them) at their reserved amount, as the embedded store does after a crash, and notes
-- what it charged so a late settle corrects it to the actual usage; then it checks the
-- day's and the session's caps against settled plus reserved, and reserves on both.
--
-- Defines: over(v, A, at, scope) (the refusal of caps A[at+1..at+3] over books v, or
-- nil), admit(K, A, now).

local function over(v, A, at, scope)
  for i = 1, 3 do
    local cap = tonumber(A[at + i])
    if cap >= 0 then
      local used = (tonumber(v[i]) or 0) + (tonumber(v[i + 3]) or 0)
      if used + tonumber(A[3 + i]) > cap then
        return {'over', scope, fmt(i), fmt(cap), fmt(used)}
      end
    end
  end
  return nil
end
local function admit(K, A, now)
  if redis.call('GET', K[1]) ~= A[1] then return {'lost'} end
  now = now or now_ms()
  local unknown, expired = 0, false
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K[2], '-inf', fmt(now), 'LIMIT', '0', '256')) do
    local rec = redis.call('HGET', K[3], id)
    local r = rec and record(rec)
    if rec and not r then
      -- A newer replica's record: left reserved, looked at again a lease later.
      unknown = unknown + 1
      redis.call('ZADD', K[2], fmt(now + tonumber(A[3])), id)
    else
      if r then
        unreserve(r)
        for i, k in ipairs({r[1], r[2]}) do
          if k ~= '' then
            add(k, 'calls', r[3], false); add(k, 'tokens', r[4], false); add(k, 'usd', r[5], false)
            -- Perhaps made just now (a reservation of nothing writes no hash).
            redis.call('EXPIRE', k, i == 1 and '259200' or A[14])
          end
        end
        redis.call('HSET', K[6], id, r[3] .. '|' .. r[4] .. '|' .. r[5])
        redis.call('ZADD', K[7], fmt(now), id)
        redis.call('XADD', K[8], 'MAXLEN', '~', '1000000', '*',
          'reservation', id, 'session', decode(r[8]), 'model', decode(r[7]), 'calls', r[3],
          'input_tokens', r[4], 'output_tokens', '0', 'usd_micro', r[5], 'ts_ms', fmt(now),
          'kind', 'lease_expired')
        redis.call('HDEL', K[3], id)
        expired = true
      end
      redis.call('ZREM', K[2], id)
    end
  end
  if expired then
    -- What a late settle would correct is kept for a week; after that it is final
    -- (looked at when another lease runs out, the only time there is more to keep).
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', K[7], '-inf', fmt(now - 604800000), 'LIMIT', '0', '64')) do
      redis.call('HDEL', K[6], id)
      redis.call('ZREM', K[7], id)
    end
  end
  local day = redis.call('HMGET', K[4], unpack(BOOKS))
  local refused = over(day, A, 6, 'day')
  if refused then return refused end
  local has_session = A[13] == '1'
  local session = nil
  if has_session then
    session = redis.call('HMGET', K[5], unpack(BOOKS))
    refused = over(session, A, 9, 'session')
    if refused then return refused end
  end
  -- A day's hash lives three days, a session's its retention after its last settle:
  -- set when the hash is made, renewed by the settles.
  add(K[4], 'rcalls', A[4]); add(K[4], 'rtokens', A[5]); add(K[4], 'rusd', A[6])
  if fresh(day) then redis.call('EXPIRE', K[4], '259200') end
  if has_session then
    add(K[5], 'rcalls', A[4]); add(K[5], 'rtokens', A[5]); add(K[5], 'rusd', A[6])
    if fresh(session) then redis.call('EXPIRE', K[5], A[14]) end
  end
  redis.call('HSET', K[3], A[2], A[15])
  redis.call('ZADD', K[2], fmt(now + tonumber(A[3])), A[2])
  return {'ok', fmt(unknown)}
end
