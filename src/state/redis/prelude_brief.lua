-- Prelude of the scripts that write or read a guard snapshot in Redis (settle, gate,
-- save_window, read_window, fleet_failed_and_save): its *brief*, a field beside it
-- (`brief`) that says what the settle needs to know of the snapshot without reading
-- it: `version|entries|quiet`, the version of the snapshot it describes, the number of
-- requests in its window (empty: not counted; builds before the window was kept beside
-- the state counted it) and whether it is quiet (`1`: active, no failures in a row). A
-- brief of another version than the snapshot's (a build that writes none, or wrote the
-- snapshot since) says nothing. No KEYS or ARGV of its own.
--
-- QUIET is how a quiet snapshot begins, version 2: `store::format::QUIET_PREFIX` as
-- `beside_prefix` makes it (pinned by a test in src/state/redis/mod.rs).
--
-- Defines: brief(version, state) (the brief of a version 2 state), read_brief(brief,
-- version) (the entries, nil: not known; and whether the snapshot is quiet, false: not
-- known).

local QUIET = '{"v":2,"phase":"active","until_ms":0,"code":null,"rule":null,"evidence":null,"consecutive_failures":0,"recent":['
local function brief(v, state)
  local quiet = string.sub(state, 1, #QUIET) == QUIET
  return v .. '||' .. (quiet and '1' or '0')
end
local function read_brief(b, v)
  local bv, n, q = string.match(b or '', '^(%d+)|(%d*)|([01])$')
  if not bv or tonumber(bv) ~= v then return nil, false end
  return tonumber(n), q == '1'
end
