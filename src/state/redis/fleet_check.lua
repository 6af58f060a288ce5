-- fleet_check: the preemptive check of a request whose shape is watched (after
-- prelude_fleet.lua): the first of the signatures given that is hot is a probe, once
-- its cool-down is over (the next probe a cool-down later), else a refusal (counted as
-- preempted, the session predicted to fail).
--
-- KEYS
--   1  P .. 'index' (prelude_fleet.lua)
-- ARGV
--   1..4  prelude_fleet.lua's
--   5  the session (hex), 6 cool_down (ms), 7 the predictions' cap per signature
--   8..  the shape's watched hot signatures (hex)
-- Replies
--   {'clear'}        none of them is hot
--   {'probe', sig}   let through as the signature's probe
--   {'refuse', sig, description, sessions, qualified, probe_at}  refused: the
--                    signature's sessions (n), those qualified in the window, and when
--                    it is probed next (ms)

local session, cool_down = ARGV[5], tonumber(ARGV[6])
for i = 8, #ARGV do
  local sig = ARGV[i]
  local e = P .. 'e:' .. sig
  local st = redis.call('HMGET', e, 'state', 'probe_at', 'last', 'desc', 'n')
  if st[1] == 'hot' and now - tonumber(st[3]) <= window then
    local probe_at = tonumber(st[2])
    if now >= probe_at then
      redis.call('HSET', e, 'probe_at', now + cool_down)
      return {'probe', sig}
    end
    redis.call('HINCRBY', e, 'preempted', 1)
    predict(sig, session, tonumber(ARGV[7]))
    touch(sig)
    return {'refuse', sig, st[4], st[5] or '0',
      tostring(redis.call('ZCOUNT', P .. 'q:' .. sig, now - window, '+inf')), tostring(probe_at)}
  end
end
return {'clear'}
