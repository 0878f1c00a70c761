-- raise-model-max: raise a model's learned max cost, never lowering it, capped at the model's
-- ceiling (its cost bound), and never below the ledger's max cost (the floor): a key lost with
-- Redis is rebuilt at the ledger's value, not at one cheap cost. The key is the model's own
-- (esc:model:<m>:max), one key per call. Numbers are only compared; what is written is one of
-- the argument strings (or the value already stored).
--
-- KEYS[1] model max key  string integer
-- ARGV[1] cost, integer string > 0
-- ARGV[2] ceiling, integer string > 0
-- ARGV[3] floor, integer string >= 0 (the ledger's max cost; 0: none)
-- Reply: the max now stored (string).
local v = ARGV[1]
if tonumber(v) > tonumber(ARGV[2]) then
  v = ARGV[2]
end
if tonumber(ARGV[3]) > tonumber(v) then
  v = ARGV[3]
end
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(v) then
  return cur
end
redis.call('SET', KEYS[1], v)
return v
