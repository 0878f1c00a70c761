-- reserve: check the org's budget and every limit in scope, and put one hold on it, all or
-- nothing, in one call.
--
-- KEYS[1] acct   hash  bal, wm, epoch, lv (limits version seeded), tc and te (the sweep of ended
--                      per-end-user counters: lib/limits)   (one {org} hash tag)
-- KEYS[2] holds  hash  hold id -> record (see lib/limits)
-- KEYS[3] hexp   zset  hold id -> expiry, ms on the Redis clock
-- KEYS[4] gone   zset  tombstones: ended hold id -> ms
-- KEYS[5] acct again (lim's old place: lim_key(acct), read only, limits, freezes, key -> project,
--                      version v; see lib/limits)
-- KEYS[6] u      hash  '<limit id>:<window start ms>[:<end user>]' -> used
--
-- ARGV[1] epoch "<gen>:<id>" the caller's cached ledger epoch
-- ARGV[2] hold id
-- ARGV[3] amount, integer string, > 0 and <= 10^14 (checked in Go; re-checked here)
-- ARGV[4] hold TTL, ms
-- ARGV[5] cap on unpinned holds in flight
-- ARGV[6] tombstone TTL, ms
-- ARGV[7] pin floor, ms: a hold whose expiry is later than now + this is pinned
-- ARGV[8] API key id ('' for none): its limits, its project's (lim's m:<key>) and the org's apply
-- ARGV[9] limit clock offset, ms (tests only; '0')
-- ARGV[10] token hold: the request's token bound (integer string >= 0; absent: '0'), what a
--   tokens limit holds; a requests limit holds 1, a money limit the amount
-- ARGV[11] end user ('' or absent for none): the limits of each end user apart (lim's e) count
--   it in its own counters, and those of this end user (e:<end user>) apply
-- ARGV[12] '1' for an exempt org (absent: '0'): the amount is '0' (no money is held: the hold's
--   record is a zero hold that finish and settle treat like any other, so bal + Σ holds = B(wm)
--   holds as ever) and the balance is never checked (no INSUFFICIENT); freezes, the in-flight cap
--   and every limit still apply (a money limit counts the cost at finish, like an overshoot)
-- ARGV[13] the most fields u may keep ('0' or absent: no bound); ARGV[14..] triples: a lazy
--   counter '<limit id>:0:<end user>' (lib/limits lazy_field), the watermark W of its
--   placeholder (acct's 'p:<counter>') and the ledger's sum over the entries with seq <= W
--   attributed to it, in its limit's unit (the loads a COLD_EU asked for).
--
-- Lazy counters (acct's 'll', written by a lazy seed): an end user's counter of a lifetime limit
-- of each end user apart is not kept for every end user ever served; a missing one is unknown.
-- Reserve makes each missing one of the request's end user a placeholder — what the live holds
-- naming it hold there (a settle, release or finish skipped it while it was missing), and from
-- then on every move like any counter, so the settles after the watermark W add their entries;
-- acct's 'p:<counter>' = W — and answers {'COLD_EU', limit id, unit, W, ...}. The caller reads
-- each counter's ledger sum up to its W (settled for good: no race with the settles) and calls
-- again with them: the counter is that sum + the placeholder, the counter invariant's two
-- terms, so it is exact, and the mark goes. A counter still marked answers COLD_EU with its W.
-- On a refusal a loaded counter left at 0 goes. Past ARGV[13] fields in u, the reserves that
-- make placeholders evict a few complete lazy counters of other end users (HSCAN from acct's
-- cursor 'lc'; never a placeholder, whose load is on its way): the next request of their end
-- user loads them again. So u may pass the bound by the loads in flight.
--
-- Checks, in this order: amount, COLD (no acct, another epoch, lim missing or older than the
-- version acct was seeded with), DUP, GONE, FROZEN, TOO_MANY, NO_END_USER, COLD_EU, LIMIT,
-- INSUFFICIENT.
-- Replies: {'OK', new balance, reserve ms, project, rq cap, rq left, rq resets ms, tk cap,
--            tk left, tk resets ms} (the requests and the tokens limit in scope with the least
--            left after this hold, '' when none: the x-ratelimit-* headers) | {'COLD'}
--          | {'DUP', balance, original reserve ms, project now}
--          | {'GONE'} | {'FROZEN', scope, scope id} | {'TOO_MANY', count}
--          | {'NO_END_USER', limit id} (no end user, and a limit of each end user apart requires one)
--          | {'COLD_EU', limit id, unit, W, ...} (lazy counters to load, see above)
--          | {'LIMIT', id, scope, scope id, window, cap, used, resets ms ('0': never), room, held,
--             unit, token room ('' when no tokens limit is in scope), the reserve time ms on the
--             limit clock} (scope id '' for a limit of each end user apart: it is the request's
--             end user's counter that is full)
--          | {'INSUFFICIENT', balance, held}
-- A refusal tells what could be had ("Holds that fit"): room is the largest amount every money
-- limit in scope and the balance would take now (may be ≤ 0), token room the largest token hold
-- every tokens limit in scope would take, held the amounts of the org's unfinished holds (for
-- LIMIT of money: of those added to the refusing counter; 0 for requests and tokens), which come
-- back when they finish, summed only until they cover what the hold is missing (held ≥ missing,
-- or their whole sum).
-- Both are integer replies that decide nothing here: no money moves on a refusal.
-- Money moves only with HINCRBY on the argument string: no computed amount is formatted.
local exempt = ARGV[12] == '1'
local amount = tonumber(ARGV[3])
if exempt then
  if ARGV[3] ~= '0' then
    return redis.error_reply('ERR escrow reserve: an exempt hold has amount 0')
  end
elseif not amount or amount <= 0 or string.find(ARGV[3], '^%d+$') == nil then
  return redis.error_reply('ERR escrow reserve: amount must be a positive integer')
end
local tok = ARGV[10] or '0'
if tok == '' then tok = '0' end
if string.find(tok, '^%d+$') == nil then
  return redis.error_reply('ERR escrow reserve: token hold must be a non-negative integer')
end
local per_unit = {m = ARGV[3], r = '1', t = tok} -- what the hold adds to a counter of each unit

local acct = redis.call('HMGET', KEYS[1], 'bal', 'epoch', 'lv', 'tc', 'te', 'xt', 'wm', 'll')
if not acct[1] or acct[2] ~= ARGV[1] then
  return {'COLD'}
end
local v_eu = ARGV[11] or ''
local LIM = lim_key(KEYS[1])
local lim = redis.call('HMGET', LIM, 'v', 'fo', 'o', 'm:' .. ARGV[8], 'fk:' .. ARGV[8], 'k:' .. ARGV[8], 'e', 'e:' .. v_eu)
if not lim[1] or tonumber(lim[1]) < (tonumber(acct[3]) or 0) then
  return {'COLD'}
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- Grants (lib/expiry, docs/grants.md): an expiry that has come rolls over before any check, so
-- no hold spends credit that has expired. (acct's xt, read above with bal.)
if acct[6] and expiry_roll(KEYS[1], now + (tonumber(ARGV[9]) or 0), acct[6]) then
  acct[1] = redis.call('HGET', KEYS[1], 'bal')
end
-- (end of grants)

local rec = redis.call('HGET', KEYS[2], ARGV[2])
if rec then
  local _, rt = hold_parse(rec)
  if rt == '' then
    rt = ms_string(now + (tonumber(ARGV[9]) or 0)) -- a plain record (written before attribution was kept) has no time
  end
  return {'DUP', acct[1], rt, lim[4] or ''}
end

if redis.call('ZSCORE', KEYS[4], ARGV[2]) then
  return {'GONE'}
end

local v_project = lim[4]
local pspec = nil
if lim[2] then
  return {'FROZEN', 'org', ''}
end
if v_project then
  local p = redis.call('HMGET', LIM, 'fp:' .. v_project, 'p:' .. v_project)
  if p[1] then
    return {'FROZEN', 'project', v_project}
  end
  pspec = p[2]
end
if lim[5] then
  return {'FROZEN', 'key', ARGV[8]}
end

local inflight = redis.call('ZCOUNT', KEYS[3], '-inf', now + tonumber(ARGV[7]))
if inflight >= tonumber(ARGV[5]) then
  return {'TOO_MANY', inflight}
end

if v_eu == '' and lim[7] then
  local req = nil
  each_limit(lim[7], function(v_id, _, _, _, _, fl)
    if fl == 'q' and not req then req = v_id end
  end)
  if req then
    return {'NO_END_USER', req}
  end
end

-- Limits in scope: the org's, the key's project's, the key's, the end user's (each end user
-- apart: its own counter); each in the window of the reserve time.
local rtime = now + (tonumber(ARGV[9]) or 0)
local fields, specs = {}, {}
local function add(scope, sid)
  return function(v_id, w, cap, u, own)
    local ws, we = window_bounds(w, rtime)
    if ws and per_unit[u] then
      fields[#fields + 1] = counter_field(v_id, ws, own, v_eu)
      specs[#specs + 1] = {v_id, scope, own and '' or sid, w, cap, we, ws, u, own}
    end
  end
end
each_limit(lim[3], add('org', ''))
if v_project then each_limit(pspec, add('project', v_project)) end
each_limit(lim[6], add('key', ARGV[8]))
each_end_user_limit(v_eu, lim[7], lim[8], add('end_user', v_eu))

-- held_on: the sum of the unfinished holds' amounts (those added to counter v_field only, when
-- given), counted until it covers short, what the refused hold is missing: the caller only asks
-- whether the holds in flight would cover it, so a refusal storm on an org with many holds reads
-- few records each (exact below short; any amount is at most 10^14, exact in a double). The
-- unfinished holds are read from hexp, never the whole holds hash.
local function held_on(v_field, short)
  local h, from = 0, 0
  while true do
    -- hexp holds the unfinished holds (finish moves a hold out of it), 64 at a time
    local ids = redis.call('ZRANGE', KEYS[3], from, from + 63)
    if #ids == 0 then return h end
    local recs = redis.call('HMGET', KEYS[2], unpack(ids))
    for i = 1, #ids do
      if recs[i] then
        local a, _, fin, v_fs = hold_parse(recs[i])
        if fin ~= '1' and (v_field == nil or string.find(',' .. v_fs .. ',', ',' .. v_field .. ',', 1, true)) then
          h = h + (tonumber(a) or 0)
          if h >= short then return h end
        end
      end
    end
    from = from + 64
  end
end

-- lazy_holds: appends to loaded[f] (a lazy counter being loaded) what each live hold naming f
-- holds there (its amount, 1 request, its token hold: strings from the records).
local function lazy_holds(loaded)
  local hs = redis.call('HGETALL', KEYS[2])
  for j = 2, #hs, 2 do
    local a, _, _, fs, _, _, us, tk = hold_parse(hs[j])
    local k = 0
    for f in string.gmatch(fs, '[^,]+') do
      k = k + 1
      local l = loaded[f]
      if l then
        local u = string.sub(us, k, k)
        local v = a
        if u == 'r' then v = '1' elseif u == 't' then v = tk end
        if v ~= '0' and v ~= '' then l[#l + 1] = v end
      end
    end
  end
end

-- evict_lazy: past max fields in u, deletes the complete lazy counters (lib/limits lazy_field)
-- among the next 16 fields of u from acct's cursor 'lc', but the ones this hold counts on (mine).
local function evict_lazy(max, mine)
  local n = redis.call('HLEN', KEYS[6])
  if max <= 0 or n <= max then return end
  local r = redis.call('HSCAN', KEYS[6], redis.call('HGET', KEYS[1], 'lc') or '0', 'COUNT', 16)
  for i = 1, #r[2], 2 do
    local v_f = r[2][i]
    if n <= max then break end
    -- not a placeholder: its load is on its way, and evicting it would only start it again
    if lazy_field(v_f) and not mine[v_f] and redis.call('HEXISTS', KEYS[1], 'p:' .. v_f) == 0 then
      redis.call('HDEL', KEYS[6], v_f)
      n = n - 1
    end
  end
  redis.call('HSET', KEYS[1], 'lc', r[1])
end

local used = {}
local loaded = nil -- lazy counters whose ledger part this call adds: field -> the ledger's sum
-- unload: on a refusal, a loaded counter left at 0 goes (no spend, no hold: nothing to keep).
local function unload(reply)
  for f in pairs(loaded or {}) do
    if redis.call('HGET', KEYS[6], f) == '0' then redis.call('HDEL', KEYS[6], f) end
  end
  return reply
end
if #fields > 0 then
  used = redis.call('HMGET', KEYS[6], unpack(fields))
  if acct[8] then
    -- Lazy counters (see the head): a missing one becomes a placeholder at once, holding what
    -- the live holds naming it hold there and, from now on, every move (settles add the entries
    -- past the watermark W it was made at, acct's 'p:<field>' = W); the caller loads the
    -- ledger's part, the entries up to W, which no settle can change any more, and sends it
    -- back with W: the counter is then complete.
    local lz, mk = {}, {}
    for i = 1, #fields do
      if specs[i][9] and specs[i][4] == 'lifetime' then
        local v_f = fields[i]
        lz[#lz + 1] = i
        mk[#mk + 1] = 'p:' .. v_f
      end
    end
    if #lz > 0 then
      local marks = redis.call('HMGET', KEYS[1], unpack(mk))
      local pre = {}
      for j = 14, #ARGV - 2, 3 do pre[ARGV[j]] = {ARGV[j + 1], ARGV[j + 2]} end
      local miss, fresh = nil, nil
      local wm = acct[7] or '0'
      for k, i in ipairs(lz) do
        local f, m = fields[i], marks[k]
        local p = pre[f]
        if not used[i] then
          fresh = fresh or {}
          fresh[f] = {'0'}
          miss = miss or {'COLD_EU'}
          table.insert(miss, specs[i][1]); table.insert(miss, specs[i][8]); table.insert(miss, wm)
        elseif m and p and p[1] == m and string.find(p[2], '^%d+$') then
          loaded = loaded or {}
          loaded[f] = p[2]
          used[i] = string.format('%d', tonumber(used[i]) + tonumber(p[2])) -- for the checks and a refusal's reply
        elseif m then
          miss = miss or {'COLD_EU'}
          table.insert(miss, specs[i][1]); table.insert(miss, specs[i][8]); table.insert(miss, m)
        end
      end
      if fresh then
        lazy_holds(fresh)
        local mine = {}
        for i = 1, #fields do mine[fields[i]] = true end
        for v_f, l in pairs(fresh) do
          redis.call('HSET', KEYS[6], v_f, '0')
          for j = 2, #l do redis.call('HINCRBY', KEYS[6], v_f, l[j]) end
          redis.call('HSET', KEYS[1], 'p:' .. v_f, wm)
        end
        evict_lazy(tonumber(ARGV[13]) or 0, mine)
      end
      if miss then
        return miss
      end
      for v_f, b in pairs(loaded or {}) do
        if b ~= '0' then redis.call('HINCRBY', KEYS[6], v_f, b) end
        redis.call('HDEL', KEYS[1], 'p:' .. v_f)
      end
    end
  end
  for i = 1, #fields do
    local s = specs[i]
    local need = tonumber(per_unit[s[8]])
    if (tonumber(used[i]) or 0) + need > tonumber(s[5]) then
      local room, troom = tonumber(acct[1]), nil
      for j = 1, #fields do
        local left = tonumber(specs[j][5]) - (tonumber(used[j]) or 0)
        if specs[j][8] == 'm' then
          room = math.min(room, left)
        elseif specs[j][8] == 't' then
          troom = math.min(troom or left, left)
        end
      end
      local held = 0
      if s[8] == 'm' then
        held = held_on(fields[i], (tonumber(used[i]) or 0) + need - tonumber(s[5]))
      end
      return unload({'LIMIT', s[1], s[2], s[3], s[4], s[5], used[i] or '0', ms_string(s[6]), room, held, s[8], troom or '', ms_string(rtime)})
    end
  end
end

if not exempt and tonumber(acct[1]) < amount then
  return unload({'INSUFFICIENT', acct[1], held_on(nil, amount - tonumber(acct[1]))})
end

local bal = acct[1] -- an exempt hold debits nothing
if not exempt then
  bal = redis.call('HINCRBY', KEYS[1], 'bal', '-' .. ARGV[3])
end
local rts = ms_string(rtime)
-- The requests and the tokens limit with the least left, for the x-ratelimit-* headers.
local least = {r = {'', '', ''}, t = {'', '', ''}}
local units = {} -- the record's unit letter per counter field
if #fields > 0 then
  for i = 1, #fields do
    local s = specs[i]
    units[i] = s[8]
    local after = redis.call('HINCRBY', KEYS[6], fields[i], per_unit[s[8]])
    local l = least[s[8]]
    if l then
      local left = tonumber(s[5]) - after
      if l[2] == '' or left < tonumber(l[2]) then
        least[s[8]] = {s[5], string.format('%d', left), ms_string(s[6])}
      end
    end
    if not used[i] and s[4] ~= 'lifetime' then
      -- The first hold of a window: the window before it is past, and past windows are not
      -- kept in Redis (reports on them come from the ledger), so its counter goes.
      local prev = window_bounds(s[4], s[7] - 1)
      redis.call('HDEL', KEYS[6], counter_field(s[1], prev, s[9], v_eu))
    end
  end
end
if lim[7] then
  sweep_ended(KEYS[6], KEYS[1], lim[7], rtime, acct[4], acct[5])
end
redis.call('HSET', KEYS[2], ARGV[2], hold_record(ARGV[3], rts, '0', table.concat(fields, ','), ARGV[8], v_project or '', table.concat(units), tok, v_eu))
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[2])
return {'OK', bal, rts, v_project or '', least.r[1], least.r[2], least.r[3], least.t[1], least.t[2], least.t[3]}
