-- Prelude of the fleet scripts (fleet_failed, fleet_failed_and_save, fleet_check,
-- fleet_succeeded, fleet_avoided, fleet_report): the common arguments and helpers.
-- Every fleet script takes KEYS[1] = P .. 'index' (for the routing of Redis Cluster
-- only: the scripts build their keys from P, all under the tenant's hash tag; the keys
-- are listed in src/state/fleet/redis.rs) and these first four ARGV; times are the
-- replica's clock, never Redis's.
--
-- ARGV
--   1  P, the tenant's key prefix (`{prefix}:{tenant}:fleet:`)
--   2  now (ms)
--   3  the window (ms)
--   4  the keys' expiry (ms)
--
-- Defines: P, now, window, ttl; forget(sig) (a signature's keys deleted, its record
-- added to the stats), touch(sig) (its keys' expiry pushed out), predict(sig, session,
-- cap) (a session predicted to fail, at most `cap` pending), watch(sig, shape, state)
-- (watched by the replicas until a window from now).

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
