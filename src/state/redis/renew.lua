-- renew: pushes out the leases of the members this replica holds in one sorted set (a
-- tenant's reservations, a session's concurrency slots): members no longer there are
-- not added back (ZADD XX). With ARGV[2] '1', the set's own expiry too (a session's
-- slots: the set of a session gone quiet goes). A tenant's reservations set never
-- expires: its members carry their leases, and a dead replica's are found there by the
-- next admission's sweep, however long the tenant stays quiet; an expiry an older build
-- gave it is removed. It empties, and goes, as they settle.
--
-- KEYS
--   1  the sorted set: member -> lease end (ms, server clock)
-- ARGV
--   1  the lease (ms); the set, when it expires, expires two leases from now
--   2  '1' to expire the set, else '0'
--   3..  the members held
-- Replies
--   1

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local until_ms = string.format('%d', now + tonumber(ARGV[1]))
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[i]) end
if ARGV[2] ~= '1' then
  -- An expiry an older build gave it goes.
  redis.call('PERSIST', KEYS[1])
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('PEXPIRE', KEYS[1], string.format('%d', tonumber(ARGV[1]) * 2))
end
return 1
