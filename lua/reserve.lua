-- reserve: check the org's budget and put one hold on it, all or nothing, in one call.
--
-- KEYS[1] acct   hash  bal, wm, epoch           (all keys share the org's {org} hash tag)
-- KEYS[2] holds  hash  hold id -> amount
-- KEYS[3] hexp   zset  hold id -> expiry, ms on the Redis clock
-- KEYS[4] gone   zset  tombstones: ended hold id -> ms
-- KEYS[5..]      reserved for further limits (per-key caps, windows, freeze), see ARGV[8]
--
-- ARGV[1] epoch "<gen>:<id>" the caller's cached ledger epoch
-- ARGV[2] hold id
-- ARGV[3] amount, integer string, > 0 and <= 10^14 (checked in Go; re-checked here)
-- ARGV[4] hold TTL, ms
-- ARGV[5] cap on unpinned holds in flight
-- ARGV[6] tombstone TTL, ms
-- ARGV[7] pin floor, ms: a hold whose expiry is later than now + this is pinned
-- ARGV[8] number of extra limits; each takes 4 further ARGV slots (kind, key index, p1, p2),
--         checked before anything is written. No kind is defined yet: any is refused.
--
-- Replies: {'OK', new balance} | {'COLD'} | {'DUP', balance} | {'GONE'} | {'TOO_MANY', count}
--          | {'INSUFFICIENT', balance}
-- Money moves only with HINCRBY on the argument string: no computed number is formatted.
local amount = tonumber(ARGV[3])
if not amount or amount <= 0 or string.find(ARGV[3], '^%d+$') == nil then
  return redis.error_reply('ERR escrow reserve: amount must be a positive integer')
end

local nlimits = tonumber(ARGV[8]) or 0
for i = 1, nlimits do
  local kind = ARGV[8 + (i - 1) * 4 + 1]
  return redis.error_reply('ERR escrow reserve: unknown limit kind ' .. tostring(kind))
end

local acct = redis.call('HMGET', KEYS[1], 'bal', 'epoch')
if not acct[1] or acct[2] ~= ARGV[1] then
  return {'COLD'}
end

if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  return {'DUP', acct[1]}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if redis.call('ZSCORE', KEYS[4], ARGV[2]) then
  return {'GONE'}
end

local inflight = redis.call('ZCOUNT', KEYS[3], '-inf', now + tonumber(ARGV[7]))
if inflight >= tonumber(ARGV[5]) then
  return {'TOO_MANY', inflight}
end

if tonumber(acct[1]) < amount then
  return {'INSUFFICIENT', acct[1]}
end

local bal = redis.call('HINCRBY', KEYS[1], 'bal', '-' .. ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[2])
return {'OK', bal}
