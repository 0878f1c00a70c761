-- unpin: give an existing hold its normal expiry back after its journaled usage was replayed
-- into the ledger, or its journal was lost: now + hold TTL for an unfinished hold, now + the
-- settle deadline for a finished one (which stays out of the in-flight count).
--
-- KEYS[1] hexp   zset unfinished hold id -> expiry ms
-- KEYS[2] hfin   zset finished hold id -> expiry ms
-- ARGV[1] hold id
-- ARGV[2] hold TTL, ms
-- ARGV[3] settle deadline, ms
-- Reply: 1 if the hold exists, else 0.
local key, ttl = KEYS[1], ARGV[2]
if not redis.call('ZSCORE', key, ARGV[1]) then
  key, ttl = KEYS[2], ARGV[3]
  if not redis.call('ZSCORE', key, ARGV[1]) then
    return 0
  end
end
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ttl)
redis.call('ZADD', key, exp, ARGV[1])
return 1
