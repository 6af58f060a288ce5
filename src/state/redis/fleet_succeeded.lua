-- fleet_succeeded: a request of a watched shape succeeded (after prelude_fleet.lua):
-- the session's pending prediction on each signature is unconfirmed, and a hot
-- signature cools down (its sessions' counts cleared); a signature stays watched while
-- predictions are pending.
--
-- KEYS
--   1  P .. 'index' (prelude_fleet.lua)
-- ARGV
--   1..4  prelude_fleet.lua's
--   5  the session (hex)
--   6..  the shape's watched signatures (hex)
-- Replies
--   {cooled, unconfirmed}   how many signatures cooled; '1' if a prediction was
--                           unconfirmed, else '0'

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
