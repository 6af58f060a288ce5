-- fleet_failed_and_save: a failure counted (fleet_failed.lua's count(), the same
-- arguments) and the session guard's write-back in the same round trip, for replicas
-- (after prelude_fleet.lua, prelude_brief.lua, prelude_window.lua and
-- prelude_fleet_failed.lua): the compare-and-set of save_window.lua on the session's
-- guard state (under the same hash tag as the fleet's keys), of ARGV[20] (the failure
-- recorded) or, when the count trips the session and ARGV[23..25] are given, of the
-- state with the trip imposed: ARGV[23] .. sessions .. ARGV[24] .. qualified ..
-- ARGV[25], the counts the reply gives. The count stands either way.
--
-- KEYS
--   1  P .. 'index' (prelude_fleet.lua)
--   2  the session's guard hash, 3 its window (list), 4 the window's counts (hash)
-- ARGV
--   1..17  fleet_failed.lua's
--  18  the version the guard state must be at, 19 its expiry (ms)
--  20  the state with the failure recorded (version 2 text)
--  21  the window's op, 22 its argument (a failure adds no request: '' keep, or 'r')
--  23, 24, 25  optional: the state with the trip imposed, in three parts, the counts
--      going between them
-- Replies
--   {'saved', version, '', '', <fleet_failed's reply>...}
--   {'moved', version, state, window, <fleet_failed's reply>...}  another replica
--      wrote first: its guard state (as save_window.lua's); nothing written of the guard

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
