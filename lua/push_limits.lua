-- push-limits: the org's limits changed in the ledger (a new version): drop acct, lim and u
-- together unless lim is already at that version or newer, so the next request reseeds the
-- balance, the limits and the current windows' counters from one snapshot. Re-pushing (the
-- reconciler) is safe: an older or equal version changes nothing.
--
-- It also raises the org's limits floor to the version (for the ledger's epoch): a seed whose
-- snapshot is older than the floor is refused (seed.lua), so a seeder that read the ledger
-- before the change and writes after this push cannot put the old limits (a freeze missing)
-- back into Redis.
--
-- KEYS[1] acct, KEYS[2] lim, KEYS[3] u, KEYS[4] limv (the floor: '<epoch>|<version>')
--   (one {org} hash tag)
-- ARGV[1] the ledger's limits version (integer string)
-- ARGV[2] the ledger's epoch "<gen>:<id>"
-- Reply: 1 if this call dropped the hot state, else 0.
local fl = redis.call('GET', KEYS[4])
local fe, fv = nil, nil
if fl then
  fe, fv = string.match(fl, '^(.*)|(%d+)$')
end
if fe ~= ARGV[2] or tonumber(fv) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[4], ARGV[2] .. '|' .. ARGV[1])
end

local v = redis.call('HGET', KEYS[2], 'v')
if v and tonumber(v) >= tonumber(ARGV[1]) then
  return 0
end
if redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3]) == 0 then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
