-- finish: a request's usage is durable (ledger or journal); give the unused part of its hold back
-- at once and take the hold out of the in-flight count, instead of waiting for the settle.
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] hexp, KEYS[4] hfin, KEYS[5] u, KEYS[6] gone   (one {org} hash tag)
--   hexp  zset  unfinished hold id -> expiry ms (the in-flight count of reserve's cap)
--   hfin  zset  finished hold id -> expiry ms (still reapable through the ledger check)
-- ARGV[1] settle deadline, ms: a finished hold's expiry becomes max(current, now + this)
-- ARGV[2..] triples: hold id, cost (integer string >= 0, the request's real cost), tokens (its
--   real input + output tokens, integer string >= 0)
--
-- Per triple, only on an existing, unfinished hold (a re-sent finish changes nothing):
--   bal += hold - cost and U += cost - hold on the money counters the record names, U += tokens
--   - token hold on its tokens counters (only while acct exists; a requests counter keeps its 1),
--   hold := cost, token hold := tokens (the record keeps its reserve time and counters, marked
--   finished),
--   hexp -> hfin.
-- A per-end-user counter the hold held 0 on (an exempt hold's money, a token hold of 0) that is
-- missing is re-created with the real cost or count: it went at zero when the other holds on it
-- ended (release.lua), and this hold still counts there — except, in an org seeded lazily
-- (acct's 'll'), an end user's lifetime counter: only reserve's load creates one (lib/limits
-- lazy_field), and it adds this hold then.
-- bal + sum(holds) is unchanged, so the invariant holds; settle later gives the hold (now the
-- cost) back and applies the entry's delta as for any hold. A zero cost leaves a zero hold, so
-- that settle still tombstones its id. Money moves only with HINCRBY on the stored and argument
-- strings ('-0' is not an integer to Redis, hence the zero checks).
-- Reply: two items per triple: 1 if this call finished the hold (else 0), then the org's available
-- balance right after it as the stored string (read with HGET, never computed here) when it is
-- known to reflect the request's cost: acct exists and the hold was finished (by this call or an
-- earlier one) or is already settled (gone from holds, its id tombstoned: the worker may settle a
-- durable event before its finish runs); else nil (no acct; a hold missing for another reason,
-- e.g. lost with Redis data, whose charge may still be to come).
for i = 3, #ARGV, 3 do
  if string.find(ARGV[i], '^%d+$') == nil or string.find(ARGV[i + 1] or '', '^%d+$') == nil then
    return redis.error_reply('ERR escrow finish: cost and tokens must be non-negative integers')
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = now + tonumber(ARGV[1])
local st = redis.call('HMGET', KEYS[1], 'bal', 'll') -- acct exists iff it has bal (the seed writes it)
local warm = st[1] ~= false
local lazy = st[2] ~= false -- seeded lazily (lib/limits lazy_field)

local out = {}
for i = 2, #ARGV - 2, 3 do
  local id = ARGV[i]
  local rec = redis.call('HGET', KEYS[2], id)
  if rec and not redis.call('ZSCORE', KEYS[4], id) then
    local a, rt, _, fs, hk, hp, us, tk, heu = hold_parse(rec)
    if warm then
      if a ~= '0' then
        redis.call('HINCRBY', KEYS[1], 'bal', a)
      end
      if ARGV[i + 1] ~= '0' then
        redis.call('HINCRBY', KEYS[1], 'bal', '-' .. ARGV[i + 1])
      end
      move_hold(KEYS[5], fs, us, neg(a), nil, neg(tk))
      local c, n = ARGV[i + 1], ARGV[i + 2]
      -- a counter the hold held 0 on may have gone at zero meanwhile (lib/limits move_hold)
      move_hold(KEYS[5], fs, us, c ~= '0' and c or nil, nil, n ~= '0' and n or nil, {m = a == '0', t = tk == '0', lazy = lazy})
      if c == '0' or n == '0' then
        move_hold(KEYS[5], fs, us, nil, nil, nil, nil, true) -- a request that cost nothing: no field left at 0
      end
    end
    redis.call('HSET', KEYS[2], id, hold_record(ARGV[i + 1], rt, '1', fs, hk, hp, us, ARGV[i + 2], heu))
    local exp = redis.call('ZSCORE', KEYS[3], id)
    redis.call('ZREM', KEYS[3], id)
    if exp and tonumber(exp) > due then
      redis.call('ZADD', KEYS[4], exp, id) -- a pinned hold stays pinned
    else
      redis.call('ZADD', KEYS[4], due, id)
    end
    out[#out + 1] = 1
    out[#out + 1] = warm and redis.call('HGET', KEYS[1], 'bal') or false
  else
    out[#out + 1] = 0
    local known = warm and (rec or redis.call('ZSCORE', KEYS[6], id))
    out[#out + 1] = known and redis.call('HGET', KEYS[1], 'bal') or false
  end
end
return out
