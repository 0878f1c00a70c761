-- state: read an org's hot balance, its holds and its watermark together (the reconciler
-- compares bal + sum(holds) with the ledger's B(wm)). Read-only.
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] hfin   (one {org} hash tag)
-- ARGV[1] pin floor, ms: holds expiring later than now + this count as pinned
--
-- Reply: {bal, wm, epoch, {hold amounts...}, unfinished holds, finished holds, pinned,
--         {rolled-over expiry rests r:<T>...}} (grants: lib/expiry; they are part of the
--         invariant, bal + sum(holds) + sum(r) = B(wm))
-- The hold amounts are returned as stored and summed in Go, so the sum is exact.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local a = redis.call('HMGET', KEYS[1], 'bal', 'wm', 'epoch')
local rolled = {} -- grants: the r:<T> fields
local af = redis.call('HGETALL', KEYS[1])
for i = 1, #af, 2 do
  if string.sub(af[i], 1, 2) == 'r:' then rolled[#rolled + 1] = af[i + 1] end
end
local vals = redis.call('HVALS', KEYS[2])
local floor = '(' .. (now + tonumber(ARGV[1]))
local pinned = redis.call('ZCOUNT', KEYS[3], floor, '+inf') + redis.call('ZCOUNT', KEYS[4], floor, '+inf')
return {a[1], a[2], a[3], vals, redis.call('ZCARD', KEYS[3]), redis.call('ZCARD', KEYS[4]), pinned, rolled}
