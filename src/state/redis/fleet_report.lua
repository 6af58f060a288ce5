-- fleet_report: the admin report of the tenant's fleet view (after prelude_fleet.lua),
-- read only: the signatures active in the window, most recent first.
--
-- KEYS
--   1  P .. 'index' (prelude_fleet.lua)
-- ARGV
--   1..4  prelude_fleet.lua's
--   5  the most signatures to list
-- Replies
--   {count, <18 fields> x count, <stats field, value>...}
--     per signature (REPORT_FIELDS in src/state/fleet/redis.rs): sig, description,
--     state, first, last, fails, tripped, preempted, confirmed, unconfirmed, acalls,
--     ausd, probe_at, since, cooled_at ('' when absent), n ('0'), qualified sessions
--     in the window, predictions pending; then the stats hash as field/value pairs

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
