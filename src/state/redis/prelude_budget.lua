-- Prelude of the budget scripts (admit, settle, gate): helpers only, no KEYS or ARGV
-- of its own, nothing called at load.
--
-- A reservation record, version 1, is
-- `day_key|session_key|calls|tokens|micro_usd|1|model|session` (keys, model and session
-- with `%` and `|` percent-encoded: `record_name` in src/state/shared.rs); version 0,
-- written before records carried a version, is the first five fields alone. Version 1
-- only appends, so a replica of version 0 still reads the amounts right during a
-- rolling upgrade. A record of any other version is left as it is (still reserved) and
-- counted, never guessed at: `record(rec)` gives nil for it.
--
-- A day's or a session's books are a hash of six counters (`BOOKS`: calls, tokens, usd
-- and, reserved, rcalls, rtokens, rusd; usd in micro-dollars); `fresh(v)`: none was
-- there when read (the hash is new and has no expiry yet). Amounts reach HINCRBY as the
-- decimal strings the replica sent, or with a `-` put in front (`add`): a zero is
-- skipped, never sent as Lua's `-0`, which Redis refuses.
--
-- Redis's Lua is slow at some things the scripts do on every request, so they avoid
-- them (measured: docs/performance.md): a number passed to redis.call is formatted with
-- %.17g, so numbers go as `fmt(n)` (%d, a third of the time) or as the argument strings
-- the replica sent; HINCRBY a counter is cheaper than reading, adding and writing a hash
-- back in Lua; records the replica can make are made there.
--
-- Defines: fmt(n) (an integer's decimal string), split(s) (on `|`), decode(s) (the
-- percent-encoding undone), record(rec) (a record's fields, nil for an unknown
-- version), add(key, field, amount, negate), unreserve(r) (a record's amounts taken off
-- the reserved counters of its day and session), BOOKS, fresh(v), now_ms() (the
-- server's clock, ms).

local function fmt(n)
  return string.format('%d', n)
end
local function split(s)
  local out, start = {}, 1
  while true do
    local i = string.find(s, '|', start, true)
    if not i then table.insert(out, string.sub(s, start)); return out end
    table.insert(out, string.sub(s, start, i - 1)); start = i + 1
  end
end
local function decode(s)
  if not s or not string.find(s, '%', 1, true) then return s or '' end
  return (string.gsub(s, '%%(%x%x)', function(h) return string.char(tonumber(h, 16)) end))
end
local function record(rec)
  local day, session, calls, tokens, usd, rest =
    string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)(.*)$')
  if not day then return nil end
  if rest == '' then return {day, session, calls, tokens, usd} end
  local model, name = string.match(rest, '^|1|([^|]*)|([^|]*)$')
  if not model then return nil end
  return {decode(day), decode(session), calls, tokens, usd, '1', model, name}
end
local function add(key, field, amount, negate)
  if amount == nil or amount == '' or amount == '0' then return end
  if negate then redis.call('HINCRBY', key, field, '-' .. amount)
  else redis.call('HINCRBY', key, field, amount) end
end
local function unreserve(r)
  for _, k in ipairs({r[1], r[2]}) do
    if k ~= '' then
      add(k, 'rcalls', r[3], true); add(k, 'rtokens', r[4], true); add(k, 'rusd', r[5], true)
    end
  end
end
local BOOKS = {'calls', 'tokens', 'usd', 'rcalls', 'rtokens', 'rusd'}
local function fresh(v)
  for i = 1, 6 do if v[i] then return false end end
  return true
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
