-- read_window: a guard's shared state as it is (after prelude_brief.lua and
-- prelude_window.lua). Read only.
--
-- KEYS
--   1  the session's guard hash
--   2  its window (list), 3 the window's counts (hash; unused here)
-- ARGV
--   none
-- Replies
--   {}                         no state
--   {version, state, window}   window: `ms,fingerprint` joined by `;` ('' for a version
--                              1 state, which holds its own)

local cur = redis.call('HMGET', KEYS[1], 'v', 'state')
if not cur[2] then return {} end
return {cur[1] or '0', cur[2], beside(cur[2]) and window_text(KEYS[2]) or ''}
