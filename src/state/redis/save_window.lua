-- save_window: compare-and-set of a guard's shared state (after prelude_brief.lua and
-- prelude_window.lua), one round trip either way. The state (version 2,
-- `store::format::to_beside`) is written with its brief and the window beside it as the
-- write says. All three keys expire ARGV[3] after it; `x`, how far the gate last pushed
-- their expiry (gate.lua), is reset so the next request through the gate pushes it
-- again.
--
-- KEYS
--   1  the session's guard hash (v, state, brief, x)
--   2  its window (list), 3 the window's counts (hash)
-- ARGV
--   1  the version the stored state must be at (0: none yet)
--   2  the state (version 2 text)
--   3  its expiry (ms)
--   4  the window's op ('' keep, 'a' append, 'r' replace), 5 its argument
-- Replies
--   {'saved', version}                 written; the new version
--   {'moved', version, state, window}  another replica wrote first: its version, state
--                                      and window (`ms,fingerprint` joined by `;`, ''
--                                      for a version 1 state); nothing written

local cur = redis.call('HMGET', KEYS[1], 'v', 'state')
local v = tonumber(cur[1] or '0')
if v ~= tonumber(ARGV[1]) then
  return {'moved', tostring(v), cur[2] or '',
    (cur[2] and beside(cur[2])) and window_text(KEYS[2]) or ''}
end
redis.call('HSET', KEYS[1], 'v', v + 1, 'state', ARGV[2], 'brief', brief(v + 1, ARGV[2]), 'x', '0')
window_write(KEYS[2], KEYS[3], cur[2], ARGV[4], ARGV[5])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
window_expire(KEYS[2], KEYS[3], tonumber(ARGV[3]))
return {'saved', tostring(v + 1)}
