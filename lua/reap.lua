-- reap: release holds that are still expired past the grace (their owners are dead). The caller
-- has already asked the ledger that none of them has unsettled usage.
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] gone, KEYS[5] hfin, KEYS[6] u
--   (one {org} hash tag)
-- Finished holds (in hfin) are reaped by the same rules as unfinished ones.
-- ARGV[1] tombstone TTL, ms
-- ARGV[2] grace, ms: a hold is released only if its expiry < now - grace, checked here again,
--         so a hold extended or pinned since the caller listed it is left alone
-- ARGV[3..] hold ids
--
-- Each hold comes back at most once (same rule as release), and leaves the counters its record
-- names (U -= hold) while acct exists. Reply: number released.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = now - tonumber(ARGV[2])
local warm = redis.call('EXISTS', KEYS[1]) == 1

local released = 0
local tomb = false
for i = 3, #ARGV do
  local id = ARGV[i]
  local exp = redis.call('ZSCORE', KEYS[3], id) or redis.call('ZSCORE', KEYS[5], id)
  if exp and tonumber(exp) < limit then
    local rec = redis.call('HGET', KEYS[2], id)
    if rec then
      local a, _, _, fs, _, _, us, tk = hold_parse(rec)
      redis.call('HDEL', KEYS[2], id)
      if warm then
        redis.call('HINCRBY', KEYS[1], 'bal', a)
        hold_out(KEYS[6], a, fs, us, tk)
      end
      released = released + 1
    end
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[5], id)
    redis.call('ZADD', KEYS[4], now, id)
    tomb = true
  end
end
if tomb then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[1]))
  redis.call('PEXPIRE', KEYS[4], ARGV[1])
end
return released
