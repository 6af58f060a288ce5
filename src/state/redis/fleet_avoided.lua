-- fleet_avoided: refusals credited to a signature (after prelude_fleet.lua): the calls
-- and micro-dollars its failures cost on average, times the requests refused, added to
-- its avoided calls and USD.
--
-- KEYS
--   1  P .. 'index' (prelude_fleet.lua)
-- ARGV
--   1..4  prelude_fleet.lua's (the window and expiry unused: '0')
--   5  the signature (hex)
--   6  the requests refused
-- Replies
--   1  credited
--   0  the signature is not tracked

local e = P .. 'e:' .. ARGV[5]
local v = redis.call('HMGET', e, 'fails', 'fcalls', 'fusd')
if not v[1] then return 0 end
local n, r = math.max(tonumber(v[1]), 1), tonumber(ARGV[6])
redis.call('HINCRBYFLOAT', e, 'acalls', string.format('%.6f', r * tonumber(v[2] or '0') / n))
redis.call('HINCRBYFLOAT', e, 'ausd', string.format('%.9f', r * tonumber(v[3] or '0') / n / 1e6))
return 1
