-- expired: list holds whose expiry is past the grace (candidates for the reaper), unfinished and
-- finished alike: a finished hold whose settle never comes (a restored ledger, a lost journal, a
-- finished phantom) is released through the same ledger check.
--
-- KEYS[1] hexp   zset unfinished hold id -> expiry ms
-- KEYS[2] hfin   zset finished hold id -> expiry ms
-- ARGV[1] grace, ms
-- ARGV[2] most ids to return
--
-- Reply: {number of holds in hexp and hfin, {id, ...}}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = '(' .. (now - tonumber(ARGV[1]))
local n = tonumber(ARGV[2])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', limit, 'LIMIT', 0, n)
if #ids < n then
  local fin = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', limit, 'LIMIT', 0, n - #ids)
  for _, id in ipairs(fin) do
    ids[#ids + 1] = id
  end
end
return {redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]), ids}
