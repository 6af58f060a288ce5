-- settle: settles a reservation once (after prelude_budget.lua and prelude_brief.lua).
-- Still held: unreserves it and charges the actual usage. Its lease expired first
-- (charged its reserved amount then, admit.lua): charges the difference, so the total
-- is the actual usage, never more. Neither: it was settled already (a replay), nothing
-- changes. Appends the charge (or the correction) to the spend stream. A release
-- (ARGV[2] '0': the call was never made) is a settle to nothing: a held reservation is
-- given back without an entry, one whose lease expired has that charge corrected away.
-- With a session the reply also carries what the session holds now and whether its
-- guard state is quiet (its brief, prelude_brief.lua), so the request that settles
-- needs no other round trip to learn what the session has left, nor, when it
-- succeeded, to tell the guard.
--
-- KEYS
--   1  the tenant's reservations (zset, as admit.lua's KEYS[2])
--   2  the reservation records (hash)
--   3  the day's books (hash of BOOKS)
--   4  the session's books (a placeholder key without a session)
--   5  lease-expired charges (hash, id -> `calls|tokens|micro_usd`)
--   6  their times (zset)
--   7  the tenant's spend stream
--   8  the session's guard hash (its `v` and `brief` are read)
-- ARGV
--   1  the reservation's id
--   2  calls: '1', or '0' for a release
--   3  tokens (all kinds), 4 micro-dollars
--   5  '1' with a session, else '0'
--   6  the session's expiry (s), pushed out on its books
--   7  the session's name ('' without one), 8 the model (for the stream entry)
--   9  input tokens, 10 output tokens
--  11  when (ms, the replica's wall clock; the stream entry's ts_ms)
--  12  cache write tokens, 13 cache read tokens
-- Replies
--   {'0'}                     settled already: nothing changed
--   {'1'} / {'2'}             settled now / a lease-expired charge corrected (no session)
--   {'1' or '2', calls, tokens, usd, rcalls, rtokens, rusd, guard_version, quiet}
--                             with a session: its books now (settled, then reserved;
--                             usd in micro-dollars), its guard state's version ('0'
--                             none) and '1' if that state is quiet, else '0'

local id = ARGV[1]
local rec = redis.call('HGET', KEYS[2], id)
local expired = not rec and redis.call('HGET', KEYS[5], id)
if not rec and not expired then return {'0'} end
redis.call('ZREM', KEYS[1], id)
local fields = {'calls', 'tokens', 'usd'}
local amounts = {ARGV[2], ARGV[3], ARGV[4]}
local reply, kind, input = '1', 'settle', ARGV[9]
if rec then
  local r = record(rec)
  if r then unreserve(r) end
  redis.call('HDEL', KEYS[2], id)
else
  local charged = split(expired)
  for i = 1, 3 do
    amounts[i] = fmt(tonumber(amounts[i]) - tonumber(charged[i] or '0'))
  end
  input = fmt(tonumber(ARGV[9]) - tonumber(charged[2] or '0'))
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[6], id)
  reply, kind = '2', 'correction'
end
local session = ARGV[5] == '1'
for i = 1, 3 do
  local amount, negate = amounts[i], false
  if string.sub(amount, 1, 1) == '-' then amount, negate = string.sub(amount, 2), true end
  add(KEYS[3], fields[i], amount, negate)
  if session then add(KEYS[4], fields[i], amount, negate) end
end
redis.call('EXPIRE', KEYS[3], '259200')
if session then redis.call('EXPIRE', KEYS[4], ARGV[6]) end
-- A release (no call made) of a reservation still held spends nothing: no entry.
if not (rec and ARGV[2] == '0') then
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', '1000000', '*',
    'reservation', id, 'session', ARGV[7], 'model', ARGV[8], 'calls', amounts[1],
    'input_tokens', input, 'output_tokens', ARGV[10], 'usd_micro', amounts[3],
    'ts_ms', ARGV[11], 'kind', kind, 'cache_write_tokens', ARGV[12], 'cache_read_tokens', ARGV[13])
end
if not session then return {reply} end
local u = redis.call('HMGET', KEYS[4], unpack(BOOKS))
local out = {reply}
for i = 1, 6 do out[i + 1] = u[i] or '0' end
local guard = redis.call('HMGET', KEYS[8], 'v', 'brief')
out[8] = guard[1] or '0'
local _, quiet = read_brief(guard[2], tonumber(out[8]))
out[9] = quiet and '1' or '0'
return out
