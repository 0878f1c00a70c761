-- raise-model-max: raise a model's learned max cost, never lowering it, capped at the model's
-- ceiling (its cost bound). The key is the model's own (esc:model:<m>:max), one key per call.
--
-- KEYS[1] model max key  string integer
-- ARGV[1] cost, integer string > 0
-- ARGV[2] ceiling, integer string > 0
-- Reply: the max now stored (string).
local v = ARGV[1]
if tonumber(v) > tonumber(ARGV[2]) then
  v = ARGV[2]
end
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(v) then
  return cur
end
redis.call('SET', KEYS[1], v)
return v
