-- seed: rebuild a cold org's hot balance and window counters from a ledger snapshot, under the
-- limits the admin plane pushed (lim: read here, never written; push-limits is its one writer).
--
-- KEYS[1] acct, KEYS[2] holds, KEYS[3] acct again (lim's old place: lim is read, never written,
--   as lim_key(acct): lib/limits), KEYS[4] u   (one {org} hash tag)
-- ARGV[1] epoch "<gen>:<id>" of the snapshot
-- ARGV[2] base: the ledger balance after every entry up to W (integer string)
-- ARGV[3] W: the snapshot's ledger sequence
-- ARGV[4] limit clock offset, ms (tests only; '0')
-- ARGV[5] limits version of the snapshot (integer string)
-- ARGV[6] n: the number of lim field/value pairs that follow (see lib/limits for the fields)
-- ARGV[7 .. 6+2n] the snapshot's lim fields and values (the limits lim holds at that version)
-- then pairs: counter field '<limit id>:<window start ms>' ('...:<end user>' for a limit of each
--   end user apart: one pair per end user with spend), the ledger's sum over the entries with
--   seq <= W attributed to it of the limit's unit (cost, 1 request, tokens), for windows
--   starting at or after the seeder's T0's
-- then, optionally, the pair 'L', '1': seed lazily (acct gets 'll'): the end users' counters of
--   lifetime limits of each end user apart are not written (their groups, if sent, are ignored)
--   but loaded one end user at a time by reserve (COLD_EU; lib/limits lazy_field), so that a
--   seed costs nothing per end user ever served and the counters can be evicted
-- then, optionally (grants, lib/expiry): 'X', n, and n pairs T ms, the unspent rest at W of the
--   grants that expire at T (x:T); an expiry that has come rolls over at once
--
-- acct with this epoch and a lim as new as acct records, or acct with a higher generation, or a
-- lim of a higher generation than the snapshot's: no-op (reply 0). lim missing, of an older epoch
-- generation (a restored ledger's limits not pushed yet) or of the same epoch at an older version
-- than the snapshot (a push not arrived yet): nothing is written (reply -2; the admin plane must
-- push lim first). lim at a newer version than the snapshot: the snapshot is stale (the limits
-- changed after it was read): nothing is written (reply -1; the seeder reads a new snapshot).
-- Otherwise acct and u are written together (reply 1): bal = base - sum(holds), wm = W, epoch,
-- lv; for every limit, the counter of
-- its current window = the snapshot's group for it (0 if none) + what the live holds whose
-- record names it hold there (amount, 1 request, tokens); for a limit of each end user apart,
-- the counter of every end user with a group of the current window or a live hold in it. A
-- hold whose record carries its attribution (key, project, reserve time) is first made to name
-- every current counter of its scope whose window contains its reserve time, so that a limit
-- created or changed while holds are in flight counts them (its record is rewritten to say so).
-- Live holds are subtracted and added one HINCRBY at a time on their stored strings, so no
-- computed sum is ever formatted (a finished hold of cost 0 is skipped: '-0' is not an integer
-- to Redis). The seeder then re-sends every ledger entry past W through settle (catch-up).
local ag = tonumber(string.match(ARGV[1], '^(%d+):')) or -1
local lim = redis.call('HMGET', lim_key(KEYS[1]), 'v', 'epoch')
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'lv')
if cur[1] then
  if cur[1] == ARGV[1] and lim[1] and tonumber(lim[1]) >= (tonumber(cur[2]) or 0) then
    return 0
  end
  local cg = tonumber(string.match(cur[1], '^(%d+):')) or -1
  if cg > ag then
    return 0
  end
end
if not lim[1] then
  return -2
end
if lim[2] ~= ARGV[1] then
  local lg = tonumber(string.match(lim[2] or '', '^(%d+):')) or -1
  if lg > ag then
    return 0
  end
  return -2
end
if tonumber(lim[1]) > tonumber(ARGV[5]) then
  return -1
end
if tonumber(lim[1]) < tonumber(ARGV[5]) then
  return -2
end
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('HSET', KEYS[1], 'bal', ARGV[2], 'wm', ARGV[3], 'epoch', ARGV[1], 'lv', ARGV[5])

local n = tonumber(ARGV[6])
local spec = {} -- lim field -> value (lim's, at the snapshot's version), for the attribution of live holds
for i = 7, 6 + 2 * n, 2 do
  spec[ARGV[i]] = ARGV[i + 1]
end

local groups = {}
local xb = nil -- grants: where the expiry block starts
local lazy = false
for i = 7 + 2 * n, #ARGV - 1, 2 do
  if ARGV[i] == 'X' then
    xb = i
    break
  end
  if ARGV[i] == 'L' then
    lazy = true
  else
    groups[ARGV[i]] = ARGV[i + 1]
  end
end
if lazy then
  redis.call('HSET', KEYS[1], 'll', '1')
end

-- The current window's counter of every limit (of each end user apart: of every end user the
-- snapshot has spend of in it).
local clock = limit_clock(ARGV[4])
for i = 7, 6 + 2 * n, 2 do
  local f = ARGV[i]
  if f == 'o' or string.sub(f, 1, 2) == 'p:' or string.sub(f, 1, 2) == 'k:' or string.sub(f, 1, 2) == 'e:' then
    each_limit(ARGV[i + 1], function(v_id, w)
      local ws = window_bounds(w, clock)
      if ws then
        local field = v_id .. ':' .. ms_string(ws)
        redis.call('HSET', KEYS[4], field, groups[field] or '0')
      end
    end)
  elseif f == 'e' then
    each_limit(ARGV[i + 1], function(v_id, w)
      local ws = window_bounds(w, clock)
      if ws and not (lazy and w == 'lifetime') then
        local head = v_id .. ':' .. ms_string(ws) .. ':'
        for field, used in pairs(groups) do
          if string.sub(field, 1, #head) == head and used ~= '0' then -- no end user's counter at 0
            redis.call('HSET', KEYS[4], field, used)
          end
        end
      end
    end)
  end
end

-- attributed: the current-window counters of every limit in a hold's scope (the org's, its
-- project's, its key's, its end user's) whose window contains its reserve time rt (ms), as a
-- field list, and their units. A per-end-user counter a hold names is created (at 0) if the
-- snapshot had no spend in it.
local function attributed(v_key, v_project, v_eu, rt)
  local fs, us = {}, {}
  local function one(v_id, w, _, u, own)
    local ws = window_bounds(w, rt)
    if ws and ws == window_bounds(w, clock) then
      local field = counter_field(v_id, ws, own, v_eu)
      if own and not (lazy and w == 'lifetime') then
        redis.call('HSETNX', KEYS[4], field, '0')
      end
      fs[#fs + 1] = field
      us[#us + 1] = u
    end
  end
  each_limit(spec['o'], one)
  if v_project ~= '' then each_limit(spec['p:' .. v_project], one) end
  if v_key ~= '' then each_limit(spec['k:' .. v_key], one) end
  each_end_user_limit(v_eu, spec['e'], spec['e:' .. v_eu], one)
  local units = table.concat(us)
  if string.find(units, '[^m]') == nil then
    units = '' -- all money: the record's form without units (hold_record writes none)
  end
  return table.concat(fs, ','), units
end

local holds = redis.call('HGETALL', KEYS[2])
for j = 1, #holds, 2 do
  local v, rt, fin, fs, hk, hp, us, tk, heu = hold_parse(holds[j + 1])
  if hk ~= nil and tonumber(rt) then
    -- A hold with its attribution counts against every limit in its scope now, also one
    -- created after it was reserved; its record names them from now on, so that its settle,
    -- finish or release moves them.
    local afs, aus = attributed(hk, hp, heu, tonumber(rt))
    if afs ~= fs or aus ~= us then
      redis.call('HSET', KEYS[2], holds[j], hold_record(v, rt, fin, afs, hk, hp, aus, tk, heu))
      fs, us = afs, aus
    end
  end
  if v ~= '0' then
    redis.call('HINCRBY', KEYS[1], 'bal', '-' .. v)
  end
  -- u holds only the current windows' counters (written above), so only they move.
  move_hold(KEYS[4], fs, us, v ~= '0' and v or nil, '1', tk ~= '0' and tk or nil)
end

-- grants: the rests of the expiries to come, then a rollover of those that have come
if xb then
  local xn = tonumber(ARGV[xb + 1])
  for j = 0, xn - 1 do
    local v = ARGV[xb + 3 + 2 * j]
    if v ~= '0' then redis.call('HSET', KEYS[1], 'x:' .. ARGV[xb + 2 + 2 * j], v) end
  end
  expiry_next(KEYS[1])
  expiry_roll(KEYS[1], clock, nil)
end
return 1
