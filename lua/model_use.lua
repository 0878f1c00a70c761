-- model-use: the marks of the processes that have requests of a model in flight, so that a
-- delete of the model can refuse while one is (Store.UseModel, Store.ModelInFlight). A zset,
-- process id -> end of its mark (ms, Redis clock); every call drops the marks past their end
-- and answers how many are left. A mark is never deleted before its end; the key expires with
-- its last mark.
--
-- KEYS[1] model use key  zset process id -> mark end ms
-- ARGV[1] process id ('': only count)
-- ARGV[2] mark lifetime, ms, integer string > 0 (with a process id)
-- Reply: the number of live marks.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[1] ~= '' then
  -- Every process marks with the same lifetime: the key's own expiry, set by the newest mark,
  -- is never before another mark's end.
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return redis.call('ZCARD', KEYS[1])
