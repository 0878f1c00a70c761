-- extend: push an existing hold's expiry to now + TTL; never lowers it (Redis 6.0 has no
-- ZADD GT, so the current score is checked here). A pinned hold stays pinned. Pin is this script
-- with the pin TTL: the hold's expiry goes far out while its usage waits in a local journal.
--
-- KEYS[1] hexp   zset hold id -> expiry ms
-- ARGV[1] hold id
-- ARGV[2] TTL, ms
-- Reply: 1 if the hold exists, else 0.
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not cur then
  return 0
end
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
if exp > tonumber(cur) then
  redis.call('ZADD', KEYS[1], exp, ARGV[1])
end
return 1
