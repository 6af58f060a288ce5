-- Prelude of the scripts that write or read a guard's window where Redis keeps it
-- beside the state (`store::format::to_beside`): a list of `ms,fingerprint`, oldest
-- first, and a hash of each fingerprint's count in it, kept equal by every change. No
-- KEYS or ARGV of its own: `list` and `seen` are the caller's keys of the two.
--
-- Constants, pinned by a test in src/state/redis/mod.rs: 256, the most entries a window
-- keeps (the guard's RECENT_CAP); the counts' field `_` and its value of 80 `h`s
-- (`store::format::HASHED_FIELD`, HASHED_VALUE_LEN), longer than any
-- hash-max-listpack-value, so Redis keeps the counts as a hash table for good (readers
-- of the counts skip it).
--
-- Defines:
--   beside(state): whether a stored state keeps its window beside it (version 2; or
--     there is none), not inside (version 1, written by an older build).
--   window_stale(list, since, request): how many of the oldest entries are from before
--     `since` (ms), and how many of those are `request` (read only).
--   window_append(list, seen, at, request, since, stale): the request appended at `at`
--     (ms), entries from before `since` dropped (`stale`: what window_stale said, if
--     asked already); true when it made the list anew (no expiry yet).
--   window_write(list, seen, stored, op, arg): a whole write's window op over the state
--     `stored` before it (`op` '' keep, 'a' append `ms,fingerprint,since`, 'r' replace
--     with `arg`'s entries, `[ms,fingerprint],...`); a window still inside `stored` is
--     first moved beside it; true when it made the list or the hash anew.
--   window_expire(list, seen, ttl): both expire in `ttl` (ms).
--   window_text(list): the entries joined by `;`.

local function beside(state)
  return not state or string.sub(state, 1, 7) == '{"v":2,'
end
local function window_drop(list, seen)
  local e = redis.call('LPOP', list)
  local fp = e and string.match(e, ',(%d+)$')
  if fp and redis.call('HINCRBY', seen, fp, '-1') <= 0 then redis.call('HDEL', seen, fp) end
end
local function window_stale(list, since, request)
  local n, same = 0, 0
  while true do
    local e = redis.call('LINDEX', list, n)
    if not e then break end
    local t, fp = string.match(e, '^(%-?%d+),(%d+)$')
    if not t or tonumber(t) >= since then break end
    n = n + 1
    if fp == request then same = same + 1 end
  end
  return n, same
end
local function window_hashed(seen)
  redis.call('HSET', seen, '_', 'hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhh')
end
local function window_append(list, seen, at, request, since, stale)
  local n = stale or window_stale(list, since, request)
  for _ = 1, n do window_drop(list, seen) end
  local len = redis.call('RPUSH', list, at .. ',' .. request)
  if len > 256 then window_drop(list, seen) end
  if len == 1 then window_hashed(seen) end
  redis.call('HINCRBY', seen, request, '1')
  return len == 1
end
local function window_fill(list, seen, entries)
  redis.call('DEL', list, seen)
  window_hashed(seen)
  for at, fp in string.gmatch(entries, '(%-?%d+),(%d+)') do
    redis.call('RPUSH', list, at .. ',' .. fp)
    redis.call('HINCRBY', seen, fp, '1')
  end
end
local function window_write(list, seen, stored, op, arg)
  if op == 'r' then window_fill(list, seen, arg); return true end
  local made = false
  if not beside(stored) then
    local entries = ''
    local open = string.find(stored, '"recent":[', 1, true)
    local close = open and string.find(stored, '],"spend":[', open, true)
    if close then entries = string.sub(stored, open + 10, close - 1) end
    window_fill(list, seen, entries)
    made = true
  end
  if op == 'a' then
    local at, request, since = string.match(arg, '^(%-?%d+),(%d+),(%-?%d+)$')
    made = window_append(list, seen, at, request, tonumber(since)) or made
  end
  return made
end
local function window_expire(list, seen, ttl)
  redis.call('PEXPIRE', list, ttl)
  redis.call('PEXPIRE', seen, ttl)
end
local function window_text(list)
  return table.concat(redis.call('LRANGE', list, 0, -1), ';')
end
