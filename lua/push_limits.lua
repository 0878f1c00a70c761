-- push-limits: the admin plane's one write of an org's limits (DESIGN.md "Two planes"). lim is
-- an admin-plane key: no data-plane script writes or deletes it; seed reads it and refuses to
-- seed without it.
--
-- KEYS[1] acct, KEYS[2] lim, KEYS[3] u   (one {org} hash tag; lim under the admin prefix)
-- ARGV[1] the ledger's limits version (integer string)
-- ARGV[2] the ledger's epoch "<gen>:<id>"
-- ARGV[3] n: the number of lim field/value pairs that follow (see lib/limits for the fields)
-- ARGV[4 .. 3+2n] lim fields and values: the org's limits, freezes and key -> project map at
--   that version
--
-- lim of this epoch at this version or newer, or of a higher epoch generation: nothing changes
-- (reply 0; re-pushing, as the reconciler does, is safe). Otherwise lim is replaced by the given
-- fields with 'v' = the version and 'epoch' = the epoch, and acct and u are dropped in the same
-- call, so that the next request reseeds the balance and the current windows' counters from a
-- snapshot of this version (seed refuses one of another version) (reply 1). lim's own version
-- is the limits floor: a seeder that read the ledger before the change and writes after this
-- push is refused by seed.
local cur = redis.call('HMGET', KEYS[2], 'v', 'epoch')
if cur[1] then
  if cur[2] == ARGV[2] then
    if tonumber(cur[1]) >= tonumber(ARGV[1]) then
      return 0
    end
  elseif cur[2] then
    local cg = tonumber(string.match(cur[2], '^(%d+):')) or -1
    local ag = tonumber(string.match(ARGV[2], '^(%d+):')) or -1
    if cg > ag then
      return 0
    end
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[2], 'v', ARGV[1], 'epoch', ARGV[2])
for i = 4, 3 + 2 * tonumber(ARGV[3]), 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) -- one pair a call: no unpack stack limit
end
return 1
