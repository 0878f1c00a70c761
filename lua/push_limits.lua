-- push-limits: the org's limits changed in the ledger (a new version): drop acct, lim and u
-- together unless lim is already at that version or newer, so the next request reseeds the
-- balance, the limits and the current windows' counters from one snapshot. Re-pushing (the
-- reconciler) is safe: an older or equal version changes nothing.
--
-- KEYS[1] acct, KEYS[2] lim, KEYS[3] u   (one {org} hash tag)
-- ARGV[1] the ledger's limits version (integer string)
-- Reply: 1 if this call dropped the hot state, else 0.
local v = redis.call('HGET', KEYS[2], 'v')
if v and tonumber(v) >= tonumber(ARGV[1]) then
  return 0
end
if redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3]) == 0 then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
