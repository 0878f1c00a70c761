-- release: end a hold without a charge (the request failed, or its reserve was not seen).
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] gone, KEYS[5] hfin, KEYS[6] u
--   (one {org} hash tag)
-- ARGV[1] hold id
-- ARGV[2] tombstone TTL, ms
--
-- A finished hold gives back what it holds then (the request's cost). Only the call that
-- deletes the hold gives its amount back, so a release racing a reaper or a
-- settle returns the money once. With no acct the hold is only deleted (the next seed does not
-- subtract it). The id goes into gone either way, so a late re-sent reserve meets GONE.
-- Counters: U -= what the hold holds there (its amount, 1 request, its tokens) on the counters
-- the record names, only while acct exists (without acct there is no u to keep: it went with
-- acct). A per-end-user counter that goes back to 0 is deleted (lib/limits hold_out): a request
-- that failed leaves no field for its end user; a missing counter reads as 0.
-- Reply: 1 if this call deleted the hold, else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local released = 0
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then
  local a, _, _, fs, _, _, us, tk = hold_parse(rec)
  redis.call('HDEL', KEYS[2], ARGV[1])
  if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HINCRBY', KEYS[1], 'bal', a)
    hold_out(KEYS[6], a, fs, us, tk)
  end
  released = 1
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[4], ARGV[2])
return released
