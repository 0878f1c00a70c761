
-- lib/expiry: credit grants that expire (docs/grants.md), kept with the hot balance in acct and
-- rolled over like a limit window, on the Redis clock.
--   'x:<T>'  the unspent rest of the org's grants that expire at T (ms), as the ledger had it at
--            the watermark (or a later read: see settle's block); never negative
--   'r:<T>'  the rest of T's grants taken out of bal when T came (the rollover), waiting for the
--            ledger's expire entries of T; the last of them gives it back (its delta takes the
--            exact rest out instead)
--   'xt'     the earliest T of an 'x:' field (absent: none), so a call checks one field
-- Invariant (docs/grants.md): bal + sum(holds) + sum(r:*) = B(wm). A rollover moves x:T from bal
-- to r:T, so every expired rest is out of bal before any hold can spend it.

-- expiry_next: rewrite xt as the earliest 'x:' field of acct (none: xt deleted).
local function expiry_next(akey)
  local all = redis.call('HGETALL', akey)
  local best = nil
  for i = 1, #all, 2 do
    local v_ts = string.match(all[i], '^x:(%-?%d+)$')
    if v_ts and (best == nil or tonumber(v_ts) < tonumber(best)) then best = v_ts end
  end
  if best then
    redis.call('HSET', akey, 'xt', best)
  else
    redis.call('HDEL', akey, 'xt')
  end
end

-- expiry_roll: apply every expiry due at clock (ms): for each 'x:<T>' with T <= clock, bal -= it
-- and r:T += it (HINCRBY on the stored strings). xt: acct's xt as read (nil: read it). Returns
-- true when something rolled over.
local function expiry_roll(akey, clock, xt)
  if xt == nil then xt = redis.call('HGET', akey, 'xt') end
  if not xt or tonumber(xt) > clock then return false end
  local all = redis.call('HGETALL', akey)
  for i = 1, #all, 2 do
    local v_ts = string.match(all[i], '^x:(%-?%d+)$')
    if v_ts and tonumber(v_ts) <= clock then
      local v = all[i + 1]
      local nv = neg(v)
      if nv then
        redis.call('HINCRBY', akey, 'bal', nv)
        redis.call('HINCRBY', akey, 'r:' .. v_ts, v)
      end
      redis.call('HDEL', akey, all[i])
    end
  end
  expiry_next(akey)
  return true
end

-- expiry_add: a credit of a grant that expires at v_ts adds its amount v (integer string) to x:v_ts.
local function expiry_add(akey, v_ts, v)
  redis.call('HINCRBY', akey, 'x:' .. v_ts, v)
  expiry_next(akey)
end

-- expiry_closed: the last expire entry of T is applied (its delta took the exact rest out of
-- bal): what the rollover took out comes back, and T is forgotten.
local function expiry_closed(akey, v_ts)
  local r = redis.call('HGET', akey, 'r:' .. v_ts)
  if r and r ~= '0' then
    redis.call('HINCRBY', akey, 'bal', r)
  end
  redis.call('HDEL', akey, 'r:' .. v_ts, 'x:' .. v_ts)
  expiry_next(akey)
end

-- expiry_block: the ledger's rests per expiry as of the watermark (pairs T, rest from ARGV[from]
-- on, n pairs): x:T = rest for an expiry still to come; for one rolled over, r:T = rest and bal
-- gets the difference (the part of the rest spent since by holds taken before T); an expiry the
-- block does not name (fully spent or closed) is dropped from x. Then a rollover at clock.
local function expiry_block(akey, from, n, clock)
  local seen = {}
  for j = 0, n - 1 do
    local v_ts, v = ARGV[from + 2 * j], ARGV[from + 2 * j + 1]
    seen['x:' .. v_ts] = true
    local r = redis.call('HGET', akey, 'r:' .. v_ts)
    if r then
      if r ~= '0' then redis.call('HINCRBY', akey, 'bal', r) end
      local nv = neg(v)
      if nv then redis.call('HINCRBY', akey, 'bal', nv) end
      redis.call('HSET', akey, 'r:' .. v_ts, v)
    else
      redis.call('HSET', akey, 'x:' .. v_ts, v)
    end
  end
  local all = redis.call('HGETALL', akey)
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'x:' and not seen[all[i]] then
      redis.call('HDEL', akey, all[i])
    end
  end
  expiry_next(akey)
  expiry_roll(akey, clock, nil)
end
