-- Prelude of fleet_failed and fleet_failed_and_save (after prelude_fleet.lua):
-- `count()`, a failure counted into the fleet view, as a function so the write-back of
-- fleet_failed_and_save can follow it in the same script. Its arguments (ARGV[5..17])
-- and its reply are fleet_failed.lua's.

local function count()
  local sig, shape, desc, session = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
  local calls, usd = tonumber(ARGV[9]), tonumber(ARGV[10])
  local min_failures, min_sessions, cool_down = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
  local index, singles, singles_t = P .. 'index', P .. 'singles', P .. 'singles:t'
  -- Times as integers' strings: Lua would print a number as a float, slowly.
  local now_s, stale = ARGV[2], string.format('%d', now - window - 1)
  -- A signature's place in the index, like its keys' expiry, is refreshed once per
  -- `refresh` (its 'kept' time), not at each failure: an index time is up to that old.
  local refresh = math.floor(window / 8)
  local e = P .. 'e:' .. sig
  local qz, pz = P .. 'q:' .. sig, P .. 'p:' .. sig
  -- The session's count and last failure, in the entry: `s:{session}` = 'count|last'.
  local own = 's:' .. session
  -- 'state' is set whenever the entry exists.
  local st = redis.call('HMGET', e, 'state', 'last', 'probe_at', 'fails', 'fcalls', 'fusd', 'tripped',
    'confirmed', 'kept', 'n', own)
  if st[1] and now - tonumber(st[2] or '0') > window then
    forget(sig)
    st = {}
  end
  -- Helpers are made where they are used: a closure made at each call costs it too.
  if not st[1] then
    local function sweep_index()
      for _, old in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', stale, 'LIMIT', 0, 16)) do
        local last = tonumber(redis.call('HGET', P .. 'e:' .. old, 'last') or '0')
        if now - last > window then forget(old) else redis.call('ZADD', index, last, old) end
      end
    end
    local function keep_single(s, at, c, u)
      for _, old in ipairs(redis.call('ZRANGEBYSCORE', singles_t, '-inf', stale, 'LIMIT', 0, 64)) do
        redis.call('HDEL', singles, old); redis.call('ZREM', singles_t, old)
      end
      redis.call('HSET', singles, sig, s .. '|' .. at .. '|' .. c .. '|' .. u)
      redis.call('ZADD', singles_t, at, sig)
      local over = redis.call('ZCARD', singles_t) - tonumber(ARGV[14])
      if over > 0 then
        local popped = redis.call('ZPOPMIN', singles_t, over)
        for i = 1, #popped, 2 do redis.call('HDEL', singles, popped[i]) end
      end
      redis.call('PEXPIRE', singles, ttl); redis.call('PEXPIRE', singles_t, ttl)
    end
    -- Stale signatures are swept (their records kept in the stats) as new ones come.
    sweep_index()
    local kept = redis.call('HGET', singles, sig)
    local first = kept and {string.match(kept, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')}
    if not first or not first[2] or now - tonumber(first[2]) > window then
      keep_single(session, now_s, ARGV[9], ARGV[10])
      return {'single'}
    end
    redis.call('HDEL', singles, sig); redis.call('ZREM', singles_t, sig)
    if redis.call('ZCARD', index) >= tonumber(ARGV[15]) then
      local victim, best = nil, nil
      for _, old in ipairs(redis.call('ZRANGE', index, 0, 15)) do
        if redis.call('HGET', P .. 'e:' .. old, 'state') ~= 'hot' then
          local n = tonumber(redis.call('HGET', P .. 'e:' .. old, 'n') or '0')
          local rank = redis.call('ZCARD', P .. 'q:' .. old) * 1e6 + n
          if not best or rank < best then best, victim = rank, old end
        end
      end
      if not victim then
        keep_single(first[1], first[2], first[3], first[4])
        redis.call('HINCRBY', P .. 'stats', 'untracked', 1)
        return {'untracked'}
      end
      forget(victim)
    end
    redis.call('HSET', e, 'shape', shape, 'desc', desc, 'first', first[2], 'last', first[2],
      'state', 'warm', 's:' .. first[1], '1|' .. first[2])
    st = {'warm', first[2], nil, 1, first[3], first[4], nil, nil, nil, 1}
    if first[1] == session then st[11] = '1|' .. first[2] end
  end
  local state = st[1]
  -- The keys this call may have made are given their expiry; all of them once per refresh.
  local written = {}
  local kept = st[9] and now - tonumber(st[9]) < refresh
  if not kept then
    redis.call('ZADD', index, now_s, sig)
    written = {e, qz, pz, index}
  end
  -- The sessions that failed (the entry's `s:` fields), `n` of them: those whose last
  -- failure left the window are dropped once per refresh, and the least recent when there
  -- are `cap`; a session's count starts again once its last failure left the window.
  local cap, n = tonumber(ARGV[16]), tonumber(st[10] or '0')
  -- The session is among the `n` while its field is there: fresh, or stale and not swept.
  local count, counted = 1, false
  if st[11] then
    local c, at = string.match(st[11], '^(%d+)|(%d+)$')
    if c and now - tonumber(at) <= window then count = tonumber(c) + 1 end
    counted = count > 1 or kept
  end
  if not kept or (not counted and n >= cap) then
    local function sweep(limit)
      local all = redis.call('HGETALL', e)
      local live, drop, sessions = {}, {}, 0
      for i = 1, #all, 2 do
        if string.sub(all[i], 1, 2) == 's:' then
          sessions = sessions + 1
          local at = tonumber(string.match(all[i + 1], '|(%d+)$') or '0')
          if now - at > window then table.insert(drop, all[i]) else table.insert(live, {at, all[i]}) end
        end
      end
      if #live > limit then
        table.sort(live, function(a, b) return a[1] < b[1] end)
        for i = 1, #live - limit do table.insert(drop, live[i][2]) end
      end
      for i = 1, #drop, 1000 do
        local fields, ids = {}, {}
        for j = i, math.min(i + 999, #drop) do
          table.insert(fields, drop[j]); table.insert(ids, string.sub(drop[j], 3))
        end
        redis.call('HDEL', e, unpack(fields)); redis.call('ZREM', qz, unpack(ids))
      end
      return sessions - #drop
    end
    if not kept then n = sweep(cap) end
    if not counted and n >= cap then n = sweep(cap - math.max(1, math.floor(cap / 8))) end
  end
  if not counted then n = n + 1 end
  if count >= min_failures and redis.call('ZADD', qz, now_s, session) == 1 and kept then
    table.insert(written, qz)
  end
  -- Only a signature that has been hot has predictions, or a place among the watched.
  local confirmed = 0
  if state ~= 'warm' then confirmed = redis.call('HDEL', pz, session) end
  local hot = state == 'hot'
  local probe_at = tonumber(st[3] or '0') or 0
  -- Sessions qualify only by failing: none did unless this one did.
  local qualified = 0
  if hot or count >= min_failures then
    qualified = redis.call('ZCOUNT', qz, string.format('%d', now - window), '+inf')
  end
  local fmt = string.format
  local fields = {'last', now_s, 'n', fmt('%d', n), 'fails', fmt('%d', tonumber(st[4] or '0') + 1),
    'fcalls', fmt('%d', tonumber(st[5] or '0') + calls), 'fusd', fmt('%d', tonumber(st[6] or '0') + usd),
    own, count .. '|' .. now_s}
  if not kept then table.insert(fields, 'kept'); table.insert(fields, now_s) end
  if confirmed == 1 then
    table.insert(fields, 'confirmed'); table.insert(fields, fmt('%d', tonumber(st[8] or '0') + 1))
  end
  if not hot and qualified >= min_sessions then
    hot, probe_at = true, now + cool_down
    for _, v in ipairs({'state', 'hot', 'since', now_s, 'probe_at', fmt('%d', probe_at)}) do
      table.insert(fields, v)
    end
  end
  local trip, sessions = 0, 0
  if hot then
    trip = 1
    table.insert(fields, 'tripped'); table.insert(fields, fmt('%d', tonumber(st[7] or '0') + 1))
    predict(sig, session, tonumber(ARGV[17]))
    watch(sig, shape, 'hot')
    table.insert(written, pz)
    table.insert(written, P .. 'watch')
    sessions = n
  elseif state ~= 'warm' and redis.call('HLEN', pz) == 0 then
    redis.call('HDEL', P .. 'watch', shape .. ':' .. sig)
  end
  redis.call('HSET', e, unpack(fields))
  for _, k in ipairs(written) do redis.call('PEXPIRE', k, ttl) end
  return {'counted', tostring(trip), tostring(sessions), tostring(qualified),
    tostring(confirmed), fmt('%d', probe_at), desc}
end
