-- expired: list holds whose expiry is past the grace (candidates for the reaper).
--
-- KEYS[1] hexp   zset hold id -> expiry ms
-- ARGV[1] grace, ms
-- ARGV[2] most ids to return
--
-- Reply: {number of holds in hexp, {id, ...}}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[1])),
  'LIMIT', 0, tonumber(ARGV[2]))
return {redis.call('ZCARD', KEYS[1]), ids}
