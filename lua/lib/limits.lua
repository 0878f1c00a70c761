-- lib/limits: shared by the scripts that keep limit counters (reserve, settle, release, reap,
-- finish, seed); package lua puts it in front of each of them, so one rule lives in one place.
--
-- Hold records (esc:{org}:holds, id -> record):
--   '<amount>|<reserve ms>|<fin>|<f1,f2,..>|<key>|<project>|<units>|<tokens>|<end user>'
--       a hold added to counters f1.. of esc:{org}:u (none: empty), fin '1' once finished, its
--       attribution: the API key ('' for none) and the key's project at reserve time ('' for
--       none), so that a limit created while it is in flight counts it (seed.lua); units: one
--       character per counter of f1.., the unit of its limit ('m' money: the counter holds
--       <amount>; 'r' requests: 1; 't' tokens: <tokens>), and tokens the hold's token bound
--       (the real count once finished), then the request's end user. The end user is written
--       only when there is one; units and tokens only then or when some counter is not money
--       or the hold has tokens: without them every counter is money and tokens are 0;
--   '<amount>|<reserve ms>|<fin>|<f1,f2,..>'  the same without attribution (written before it
--       was kept; such a hold counts only against the counters it names);
--   '<amount>'  a hold added to no counter, without attribution (idem).
-- Counter fields: '<limit id>:<window start ms>', and '<limit id>:<window start ms>:<end user>'
-- for a limit that applies to each end user apart. lim fields: 'v' version; 'o', 'p:<project>',
-- 'k:<key>', 'e:<end user>' the limits of that scope, and 'e' those of each end user apart, as
-- 'id,window,cap[,unit[,flags]];...' (unit r or t; none: money; flag q: a request must name an
-- end user); 'm:<key>' the key's project; 'fo',
-- 'fp:<project>', 'fk:<key>' = '1' when frozen.
-- Per-end-user counters of ended windows are swept away by the reserves after the window ends
-- (sweep_ended: a few fields of u a call, from a cursor kept in acct's 'tc', when acct's 'te'
-- says a window has ended), so that only current windows stay, however many end users come and
-- go.
--
-- Calendar maths: Redis Lua has no os.date, so window starts are computed here from a ms
-- timestamp, in UTC (days <-> civil dates after H. Hinnant's algorithms, valid for any year, the
-- Gregorian 4/100/400 rule included). Weeks start on Monday (1970-01-01 was a Thursday).

local DAY_MS = 86400000

-- lim_key: the name of the org's limits, an admin-plane key ('<prefix>:a:{<org>}:lim'), from
-- the name of its acct ('<prefix>:{<org>}:acct'; a prefix has no '{'). lim is not among the
-- scripts' KEYS: Redis checks a script's declared keys as read-write, and the data plane's user
-- may only read lim (DESIGN.md "Two planes"); it is in acct's slot (the same hash tag), and the
-- reads of it inside the script are checked as reads. The KEYS position that named it keeps
-- acct, so that the keys after it keep theirs. balance's KeysOf writes the same layout (a test
-- checks they agree).
local function lim_key(v_acct)
  local i = string.find(v_acct, ':{', 1, true)
  local v_head, v_tag = string.sub(v_acct, 1, i - 1), string.sub(v_acct, i, -5) -- strings of a key name
  return v_head .. ':a' .. v_tag .. 'lim'
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- window_bounds: the start of the window w that contains t (ms) and the next window's start
-- (0, 0 for lifetime: one window, never reset); nil for an unknown window.
local function window_bounds(w, t)
  if w == 'lifetime' then return 0, 0 end
  if w == 'minute' then
    local s = t - t % 60000
    return s, s + 60000
  end
  if w == 'hour' then
    local s = t - t % 3600000
    return s, s + 3600000
  end
  local days = math.floor(t / DAY_MS)
  if w == 'day' then return days * DAY_MS, (days + 1) * DAY_MS end
  if w == 'week' then
    local s = days - (days + 3) % 7
    return s * DAY_MS, (s + 7) * DAY_MS
  end
  if w == 'month' then
    local y, m = civil_from_days(days)
    local ny, nm = y, m + 1
    if nm == 13 then ny, nm = y + 1, 1 end
    return days_from_civil(y, m, 1) * DAY_MS, days_from_civil(ny, nm, 1) * DAY_MS
  end
  return nil
end

-- ms_string formats a whole millisecond timestamp exactly ('%d', not Lua's %.14g); it refuses
-- anything that is not a whole number of magnitude below 10^14 (year 5138).
local function ms_string(n)
  if n ~= math.floor(n) or n >= 1e14 or n <= -1e14 then
    return error('escrow: timestamp out of range')
  end
  return string.format('%d', n)
end

-- limit_clock: the Redis clock in ms plus the test-only offset (a string of ms; '' or nil: 0).
local function limit_clock(offset)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + (tonumber(offset) or 0)
end

-- hold_parse: amount, reserve ms ('' if unknown), finished flag, counter fields ('' if none),
-- then the attribution: key and project (both nil when the record has none), then the counters'
-- units ('' : all money), the token hold ('0' when the record has none) and the end user ('':
-- none).
local function hold_parse(rec)
  local a, t, f, fs, k, p, us, tk, eu = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  if a then return a, t, f, fs, k, p, us, tk, eu end
  a, t, f, fs, k, p, us, tk = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  if a then return a, t, f, fs, k, p, us, tk, '' end
  a, t, f, fs, k, p = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  if a then return a, t, f, fs, k, p, '', '0', '' end
  a, t, f, fs = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if not a then return rec, '', '0', '', nil, nil, '', '0', '' end
  return a, t, f, fs, nil, nil, '', '0', ''
end

-- hold_record: the record of a hold (see above); k nil: without attribution (the plain
-- amount when it also names no counter). Units and tokens are written only when some counter
-- is not money, the hold has tokens (us: '' or all 'm', tk '0' or nil: left out) or an end
-- user follows (eu: nil or '' for none).
local function hold_record(a, t, fin, fs, k, p, us, tk, eu)
  if k ~= nil then
    if eu ~= nil and eu ~= '' then
      return table.concat({a, t, fin, fs, k, p or '', us or '', tk or '0', eu}, '|')
    end
    if (us == nil or string.find(us, '[^m]') == nil) and (tk == nil or tk == '0') then
      return table.concat({a, t, fin, fs, k, p or ''}, '|')
    end
    return table.concat({a, t, fin, fs, k, p or '', us or '', tk or '0'}, '|')
  end
  if fs == '' then return a end
  return table.concat({a, t, fin, fs}, '|')
end

-- neg: the negation of an integer string, without arithmetic; nil for '0' ('-0' is not an
-- integer to Redis, and adding 0 is nothing to do).
local function neg(v)
  if v == '0' or v == '-0' then return nil end
  if string.sub(v, 1, 1) == '-' then return string.sub(v, 2) end
  return '-' .. v
end

-- own_field: whether counter field f is a per-end-user one, '<limit id>:<window start>:<end user>'.
local function own_field(f)
  return string.find(f, '^[^:]+:%d+:') ~= nil
end

-- lazy_field: whether counter field f is an end user's counter of a lifetime limit of each end
-- user apart ('<limit id>:0:<end user>': a lifetime window starts at 0). In an org whose acct has
-- 'll' (seeded lazily, DESIGN "Lifetime per-end-user counters"), such a field is loaded one end
-- user at a time from the ledger by reserve (see reserve.lua, COLD_EU), may be evicted past the
-- org's bound, and is never created by anything else: a missing one is unknown, not 0, so every
-- move of it is skipped until the next load, which adds the live holds it names.
local function lazy_field(f)
  return string.find(f, '^[^:]+:0:') ~= nil
end

-- move_hold: HINCRBY every field of fs that exists by its unit's increment (us: one unit
-- character per field, 'm' when missing): vm for money, vr for requests, vt for tokens (integer
-- strings; nil: that unit does not move). A hold's missing field is a past window's (seed writes
-- current windows, reserve creates them) or a per-end-user field back at zero (see hold_out):
-- past windows are not kept exact, so it is skipped, never re-created — except a per-end-user
-- field of a unit in fresh (a table unit letter -> true, or nil): the hold held 0 there (an
-- exempt hold's money, a token hold of 0), so the field may have gone at zero while the hold
-- lived, and finish re-creates it with the hold's real cost (in a past window: a field the
-- sweep takes later) — unless fresh.lazy and the field is a lazy one (lazy_field), which only a
-- load creates. out: a per-end-user field that this move leaves at 0 is deleted,
-- since a zero counter and a missing one read the same and end users come and go by the
-- million: a request that cost nothing leaves no field behind.
local function move_hold(ukey, fs, us, vm, vr, vt, fresh, out)
  if fs == '' then return end
  local i = 0
  for f in string.gmatch(fs, '[^,]+') do
    i = i + 1
    local u = string.sub(us, i, i)
    local v = vm
    if u == 'r' then v = vr elseif u == 't' then v = vt end
    if u == '' then u = 'm' end
    local own = (fresh or out) and own_field(f)
    if v ~= nil then
      if redis.call('HEXISTS', ukey, f) == 1 then
        local after = redis.call('HINCRBY', ukey, f, v)
        if out and own and after == 0 then
          redis.call('HDEL', ukey, f)
        end
      elseif own and fresh and fresh[u] and not (fresh.lazy and lazy_field(f)) then
        redis.call('HINCRBY', ukey, f, v)
      end
    elseif out and own and redis.call('HGET', ukey, f) == '0' then
      redis.call('HDEL', ukey, f) -- a hold of 0 there ends: the field may be back at zero
    end
  end
end

-- hold_out: a hold leaves the counters it names: U -= what it holds there (its amount, 1
-- request, its tokens); a per-end-user counter it brings back to 0 goes (move_hold's out).
local function hold_out(ukey, a, fs, us, tk)
  move_hold(ukey, fs, us, neg(a), '-1', neg(tk), nil, true)
end

-- each_limit: calls fn(id, window, cap, unit, nil, flags) for every limit of a spec string
-- ('id,window,cap[,unit[,flags]];...'); unit 'm' (money), 'r' (requests) or 't' (tokens); flags
-- '' or 'q' (a request must name an end user).
local function each_limit(spec, fn)
  if not spec then return end
  for item in string.gmatch(spec, '[^;]+') do
    local id, w, cap, u, fl = string.match(item, '^([^,]+),([^,]+),([^,]+),?([^,]*),?([^,]*)$')
    if id then
      fn(id, w, cap, u == '' and 'm' or u, nil, fl)
    end
  end
end

-- ------------------------------------------------------------------------------------------

-- each_end_user_limit: each_limit over the limits that apply to end user eu ('' : none): those
-- of each end user apart (lim's 'e', spec e; fn's fifth argument true: the counter is eu's own)
-- and those of eu alone ('e:<eu>', spec one).
local function each_end_user_limit(eu, e, one, fn)
  if eu == '' then return end
  each_limit(e, function(v_id, w, cap, u) fn(v_id, w, cap, u, true) end)
  each_limit(one, function(v_id, w, cap, u) fn(v_id, w, cap, u, false) end)
end

-- counter_field: the counter of limit v_id's window starting at ws (ms); for a limit of each end
-- user apart (own), end user eu's.
local function counter_field(v_id, ws, own, v_eu)
  if own then return v_id .. ':' .. ms_string(ws) .. ':' .. v_eu end
  return v_id .. ':' .. ms_string(ws)
end

-- sweep_ended: delete the per-end-user counters of ended windows (clock: the limit clock, ms) —
-- past windows are not kept in Redis. e is lim's spec of the limits of each end user apart; tc
-- and te are acct's 'tc' and 'te' as reserve read them: the sweep's HSCAN cursor, and the time
-- from which a sweep is due (the earliest end of a current window of those limits, when the
-- last pass ended). Until te nothing is done (no call); from te on, each reserve reads the next
-- fields of u (HSCAN, COUNT 16) and deletes the ended ones among them, until the cursor comes
-- back to 0: then te moves to the earliest end of the current windows. A pass over M fields
-- takes M/16 reserves; no index of the fields is kept (it would cost more memory than the
-- counters).
local function sweep_ended(ukey, akey, e, clock, tc, te)
  local windows, due = {}, nil
  each_limit(e, function(v_id, w)
    windows[v_id] = w
    local _, we = window_bounds(w, clock)
    if we and we > 0 and (not due or we < due) then due = we end
  end)
  if not due then return end -- lifetime only: nothing ever ends
  tc = tc or '0'
  if tc == '0' and te and clock < tonumber(te) then return end
  if not te then -- the first reserve since the seed: counters of this window only so far
    redis.call('HSET', akey, 'te', string.format('%d', due))
    return
  end
  local r = redis.call('HSCAN', ukey, tc, 'COUNT', 16)
  local fs = r[2]
  for i = 1, #fs, 2 do
    local id, ws = string.match(fs[i], '^([^:]+):(%d+):')
    local w = id and windows[id]
    if w and w ~= 'lifetime' then
      local _, we = window_bounds(w, tonumber(ws))
      if we and we <= clock then
        redis.call('HDEL', ukey, fs[i])
      end
    end
  end
  if r[1] == '0' then
    redis.call('HSET', akey, 'tc', '0', 'te', string.format('%d', due))
  else
    redis.call('HSET', akey, 'tc', r[1])
  end
end
