-- unpin: give an existing hold its normal expiry back (now + hold TTL) after its journaled usage
-- was replayed into the ledger, or its journal was lost.
--
-- KEYS[1] hexp   zset hold id -> expiry ms
-- ARGV[1] hold id
-- ARGV[2] hold TTL, ms
-- Reply: 1 if the hold exists, else 0.
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], exp, ARGV[1])
return 1
