-- release_claim: gives back an idempotency key's claim, only while it is this
-- request's pending marker (a kept response stays).
--
-- KEYS
--   1  the idempotency key
-- ARGV
--   1  the pending marker (`pending`)
-- Replies
--   1  deleted
--   0  left (not pending: a response is kept, or the key is gone)

if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
