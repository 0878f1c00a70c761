-- settle: apply a batch of one org's ledger entries, in sequence order, to the hot balance.
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] gone, KEYS[5] hfin   (one {org} hash tag)
-- ARGV[1] epoch "<gen>:<id>" read from the ledger with the entries
-- ARGV[2] tombstone TTL, ms
-- ARGV[3..] triples: seq, delta (signed integer string), hold id ('' for none)
--
-- Per entry (wm = watermark):
--   seq <= wm    ALREADY: it is in bal already; only its hold, if one is left, comes back
--   seq == wm+1  APPLIED: bal += hold (if present) + delta, hold dropped, wm = seq
--   seq >  wm+1  GAP: stop; entries wm+1 .. seq must be re-sent first
-- No acct, or another epoch: COLD, nothing applied. A newer epoch than acct's (higher
-- generation, or the same generation with another id) drops acct; an older one changes nothing.
-- Every hold id of a settled entry goes into gone. A finished hold (in hfin, holding the cost)
-- comes back like any other.
--
-- Reply: {'COLD'} | {'OK', wm, code, code, ...} with code 1 applied, 2 already, 3 gap (last).
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'wm')
if not cur[1] then
  return {'COLD'}
end
if cur[1] ~= ARGV[1] then
  local cg = tonumber(string.match(cur[1], '^(%d+):')) or -1
  local ag = tonumber(string.match(ARGV[1], '^(%d+):')) or -1
  if ag >= cg then
    redis.call('DEL', KEYS[1])
  end
  return {'COLD'}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local wmstr = cur[2] or '0'
local wm = tonumber(wmstr)
local out = {'OK', ''}
local tomb = false

local function drop(id)
  local a = redis.call('HGET', KEYS[2], id)
  if a then
    redis.call('HDEL', KEYS[2], id)
    redis.call('HINCRBY', KEYS[1], 'bal', a)
  end
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[5], id)
  redis.call('ZADD', KEYS[4], now, id)
  tomb = true
end

local i = 3
while i + 2 <= #ARGV do
  local seq = tonumber(ARGV[i])
  local id = ARGV[i + 2]
  if seq <= wm then
    if id ~= '' then drop(id) end
    out[#out + 1] = 2
  elseif seq == wm + 1 then
    if id ~= '' then drop(id) end
    if ARGV[i + 1] ~= '0' then
      redis.call('HINCRBY', KEYS[1], 'bal', ARGV[i + 1])
    end
    redis.call('HSET', KEYS[1], 'wm', ARGV[i])
    wmstr = ARGV[i]
    wm = seq
    out[#out + 1] = 1
  else
    out[#out + 1] = 3
    break
  end
  i = i + 3
end

if tomb then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
out[2] = wmstr
return out
