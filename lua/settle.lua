-- settle: apply a batch of one org's ledger entries, in sequence order, to the hot balance.
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] gone, KEYS[5] hfin, KEYS[6] acct again (lim's
--   old place; lim itself is read as lim_key(acct): lib/limits), KEYS[7] u
--   (one {org} hash tag)
-- ARGV[1] epoch "<gen>:<id>" read from the ledger with the entries
-- ARGV[2] tombstone TTL, ms
-- ARGV[3] limit clock offset, ms (tests only; '0')
-- ARGV[4..] octuples: seq, delta (signed integer string), hold id ('' for none), and the
--   entry's attribution: API key id, project ('' for none), reserve time ms ('': none), tokens
--   (input + output, integer string >= 0), end user ('' for none)
--   Grants (lib/expiry, docs/grants.md): the hold id slot of an entry with no hold may carry a
--   marker, which starts with a space (a hold id never holds one): ' g:<T>' a credit of a grant
--   that expires at T ms (its amount joins x:T); ' e:<T>:<last>' an expire entry of a grant of T
--   (last '1' on the last of T's: the rollover's r:T comes back, x:T and r:T go).
--   After the octuples, optionally, the block of the ledger's rests per expiry read with the
--   entries: 'X', as-of seq, n, then n pairs T ms, rest; applied only when every entry was
--   applied and the watermark ends at as-of.
--
-- Per entry (wm = watermark):
--   seq <= wm    ALREADY: it is in bal already; only its hold, if one is left, comes back
--   seq == wm+1  APPLIED: bal += hold (if present) + delta, hold dropped, wm = seq
--   seq >  wm+1  GAP: stop; entries wm+1 .. seq must be re-sent first
-- No acct, or another epoch: COLD, nothing applied. A newer epoch than acct's (higher
-- generation, or the same generation with another id) drops acct; an older one changes nothing.
-- Every hold id of a settled entry goes into gone. A finished hold (in hfin, holding the cost)
-- comes back like any other.
-- Counters (u): a hold that is dropped leaves the counters its record names (U -= what it holds
-- there); an APPLIED entry with a reserve time adds its cost (-delta), 1 request or its tokens to
-- the counters of every limit of lim (money, requests, tokens) in its scope (the org's, its
-- project's, its key's, its end user's) in the window of its reserve time. A
-- missing field is created only for a current window; a past window's is skipped, and so is a
-- missing lifetime counter of an end user in an org seeded lazily (acct's 'll'; lib/limits
-- lazy_field): it is loaded from the ledger as of the watermark, this entry included. A newer
-- epoch's drop takes u with acct; lim is the admin plane's (push-limits) and stays.
--
-- Reply: {'COLD'} | {'OK', wm, code, code, ...} with code 1 applied, 2 already, 3 gap (last).
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'wm', 'll')
if not cur[1] then
  return {'COLD'}
end
if cur[1] ~= ARGV[1] then
  local cg = tonumber(string.match(cur[1], '^(%d+):')) or -1
  local ag = tonumber(string.match(ARGV[1], '^(%d+):')) or -1
  if ag >= cg then
    redis.call('DEL', KEYS[1], KEYS[7])
  end
  return {'COLD'}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local lazy = cur[3] ~= false -- seeded lazily: an end user's lifetime counter is created only by a load (lib/limits lazy_field)
local wmstr = cur[2] or '0'
local wm = tonumber(wmstr)
local out = {'OK', ''}
local tomb = false

local clock = now + (tonumber(ARGV[3]) or 0)
expiry_roll(KEYS[1], clock, nil) -- grants: an expiry that has come rolls over first
local specs = {} -- lim field -> spec string (false: none), read once per call

local function spec_of(field)
  local sp = specs[field]
  if sp == nil then
    sp = redis.call('HGET', lim_key(KEYS[1]), field) or false
    specs[field] = sp
  end
  return sp or nil
end

-- attribute: add the entry's cost v, 1 request and its tokens tk (integer strings; nil: 0) to
-- the counters of the entry's limits.
local function attribute(v_key, v_project, v_eu, rt, v, tk)
  local t0 = tonumber(rt)
  if not t0 then return end
  local by = {m = v, r = '1', t = tk}
  local function one(v_id, w, _, u, own)
    local ws = window_bounds(w, t0)
    local v = by[u]
    if not ws or v == nil then return end
    local f = counter_field(v_id, ws, own, v_eu)
    if redis.call('HEXISTS', KEYS[7], f) == 1 or (ws == window_bounds(w, clock) and not (lazy and own and w == 'lifetime')) then
      redis.call('HINCRBY', KEYS[7], f, v)
    end
  end
  each_limit(spec_of('o'), one)
  if v_project ~= '' then each_limit(spec_of('p:' .. v_project), one) end
  if v_key ~= '' then each_limit(spec_of('k:' .. v_key), one) end
  if v_eu ~= '' then each_end_user_limit(v_eu, spec_of('e'), spec_of('e:' .. v_eu), one) end
end

local i = 4 -- the octuple being applied

-- grants: an entry's marker (see above) after its delta is applied
local function grant_mark(m)
  local ts = string.match(m, '^ g:(%-?%d+)$')
  if ts then
    local d = ARGV[i + 1]
    if string.sub(d, 1, 1) ~= '-' and d ~= '0' then expiry_add(KEYS[1], ts, d) end
    return
  end
  local es, last = string.match(m, '^ e:(%-?%d+):([01])$')
  if es and last == '1' then expiry_closed(KEYS[1], es) end
end

local function drop(id)
  local rec = redis.call('HGET', KEYS[2], id)
  if rec then
    local a, _, _, fs, _, _, us, tk = hold_parse(rec)
    redis.call('HDEL', KEYS[2], id)
    if a ~= '0' then
      redis.call('HINCRBY', KEYS[1], 'bal', a)
    end
    hold_out(KEYS[7], a, fs, us, tk)
  end
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[5], id)
  redis.call('ZADD', KEYS[4], now, id)
  tomb = true
end

local mark = nil
local block = false -- the loop reached the grants block
while i + 7 <= #ARGV or ARGV[i] == 'X' do
  if ARGV[i] == 'X' then
    block = true
    break
  end
  local seq = tonumber(ARGV[i])
  local id = ARGV[i + 2]
  mark = nil
  if string.sub(id, 1, 1) == ' ' then
    mark, id = id, ''
  end
  if seq <= wm then
    if id ~= '' then drop(id) end
    out[#out + 1] = 2
  elseif seq == wm + 1 then
    -- The entry's cost goes into its counters before its hold leaves them, so that a counter
    -- the hold alone was keeping above 0 is not deleted at 0 on the way (lib/limits hold_out) —
    -- which, for an end user's lifetime counter of a lazily seeded org, would mean a reload.
    local tk = ARGV[i + 6]
    if tk == '0' or tk == '' then tk = nil end
    attribute(ARGV[i + 3], ARGV[i + 4], ARGV[i + 7], ARGV[i + 5], neg(ARGV[i + 1]), tk)
    if id ~= '' then drop(id) end
    if ARGV[i + 1] ~= '0' then
      redis.call('HINCRBY', KEYS[1], 'bal', ARGV[i + 1])
    end
    if mark then grant_mark(mark) end
    redis.call('HSET', KEYS[1], 'wm', ARGV[i])
    wmstr = ARGV[i]
    wm = seq
    out[#out + 1] = 1
  else
    out[#out + 1] = 3
    break
  end
  i = i + 8
end

expiry_roll(KEYS[1], clock, nil) -- grants: a credit's expiry may have come already
-- grants: the ledger's rests as of the read, when the watermark ends where the read did
if block and ARGV[i + 1] == wmstr then
  expiry_block(KEYS[1], i + 3, tonumber(ARGV[i + 2]), clock)
end

if tomb then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[2]))
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
end
out[2] = wmstr
return out
