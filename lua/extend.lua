-- extend: push an existing hold's expiry to now + TTL; never lowers it (Redis 6.0 has no
-- ZADD GT, so the current score is checked here). A pinned hold stays pinned. Pin is this script
-- with the pin TTL and ARGV[3] = '1': the hold's expiry goes far out while its usage waits in a
-- local journal. Extend never touches a finished hold (its request is over: its expiry is the
-- settle deadline); pin does, without moving it back into the in-flight count.
--
-- KEYS[1] hexp   zset unfinished hold id -> expiry ms
-- KEYS[2] hfin   zset finished hold id -> expiry ms
-- ARGV[1] hold id
-- ARGV[2] TTL, ms
-- ARGV[3] '1': pin (finished holds too), else extend
-- Reply: 1 if the hold exists (finished or not), else 0.
local key = KEYS[1]
local cur = redis.call('ZSCORE', key, ARGV[1])
if not cur then
  key = KEYS[2]
  cur = redis.call('ZSCORE', key, ARGV[1])
  if not cur then
    return 0
  end
  if ARGV[3] ~= '1' then
    return 1
  end
end
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
if exp > tonumber(cur) then
  redis.call('ZADD', key, exp, ARGV[1])
end
return 1
