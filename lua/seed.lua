-- seed: rebuild a cold org's hot balance from a ledger snapshot.
--
-- KEYS[1] acct, KEYS[2] holds   (one {org} hash tag)
-- ARGV[1] epoch "<gen>:<id>" of the snapshot
-- ARGV[2] base: the ledger balance after every entry up to W (integer string)
-- ARGV[3] W: the snapshot's ledger sequence
--
-- acct with this epoch, or with a higher generation: no-op (reply 0). Otherwise acct becomes
-- bal = base - sum(holds), wm = W, epoch (reply 1). Live holds are subtracted one HINCRBY at a
-- time on their stored strings, so no computed sum is ever formatted (a finished hold of cost 0
-- is skipped: '-0' is not an integer to Redis). The seeder then re-sends
-- every ledger entry past W through settle (catch-up).
local cur = redis.call('HGET', KEYS[1], 'epoch')
if cur then
  if cur == ARGV[1] then
    return 0
  end
  local cg = tonumber(string.match(cur, '^(%d+):')) or -1
  local ag = tonumber(string.match(ARGV[1], '^(%d+):')) or -1
  if cg > ag then
    return 0
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'bal', ARGV[2], 'wm', ARGV[3], 'epoch', ARGV[1])
local vals = redis.call('HVALS', KEYS[2])
for _, v in ipairs(vals) do
  if v ~= '0' then
    redis.call('HINCRBY', KEYS[1], 'bal', '-' .. v)
  end
end
return 1
