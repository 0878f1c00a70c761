// Package balance is escrow's hot balance: every org's available balance, its holds and its
// watermark in Redis, moved only by the Lua scripts of package lua, one round trip per call.
//
// # Keys
//
// All keys of one org share the hash tag {org}, so each script call touches one Cluster slot
// (prefix "esc" is Config.Prefix; KeysOf names them):
//
//	esc:{org}:acct    hash   bal (available balance), wm (watermark: highest ledger seq in bal), epoch ("<gen>:<id>"), lv (limits version seeded)
//	esc:{org}:holds   hash   hold id → amount, or "amount|reserve ms|finished|counter fields" for a hold added to limit counters
//	esc:a:{org}:lim   hash   admin plane: v (version), epoch; o, p:<project>, k:<key> → that scope's limits; m:<key> → project; fo, fp:<p>, fk:<k> → frozen
//	esc:{org}:u       hash   "<limit id>:<window start ms>" → used
//	esc:{org}:hexp    zset   unfinished hold id → expiry, ms on the Redis clock; a pinned hold's is far out
//	esc:{org}:hfin    zset   finished hold id → expiry (the settle deadline, or far out when pinned)
//	esc:{org}:gone    zset   tombstones of settled or released hold ids, kept TombstoneTTL
//	esc:model:<m>:max string the model's learned max cost (its own slot, its own call)
//
// Keys under "esc:a:" are the admin plane's (DESIGN.md "Two planes"; ACLRules): lim, the models'
// versions (esc:a:model:<m>:ver) and key revocations (esc:a:key:<id>:revoked). Only PushLimits
// writes lim; the data-plane scripts read it (named from acct, not declared in KEYS) and a seed
// writes nothing without it at the snapshot's version.
//
// # The invariant
//
// Let B(k) be the org's ledger balance after its entries with seq ≤ k. While acct exists,
//
//	bal + Σ holds = B(wm)
//
// and every ledger entry is applied to bal at most once. Reserve moves money from bal to a
// hold; Settle applies entries strictly in seq order (seq ≤ wm: already in bal, only the hold
// comes back; seq = wm+1: hold back, delta applied, wm advanced; beyond: a gap, stop);
// Finish, right after a request's usage is durable, gives hold − cost back to bal and makes the
// hold the cost, moving it from hexp (the in-flight count MaxInFlight caps) to hfin; it acts
// only on an existing, unfinished hold, so a re-sent finish changes nothing, and it leaves
// bal + Σ holds as it was. Release and Reap give a hold back exactly once (only the call that
// deletes it), finished or not; Seed writes
// bal = snapshot − Σ holds and is followed by a catch-up that re-sends every entry past the
// snapshot; Invalidate drops acct only. acct carries the ledger epoch: reserve and settle carry
// the caller's, a mismatch answers cold, and no script replaces a higher generation with a
// lower one.
//
// # Limits
//
// A Limit caps what a scope (the org, a project of keys, one key) may spend per window
// (lifetime, hour, day, week from Monday, calendar month; UTC on the Redis clock, computed by the
// scripts). Reserve checks, in one call and in this order, the amount, COLD, DUPLICATE, GONE,
// FROZEN (*FrozenError), TOO_MANY, LIMIT (*LimitError: some counter in scope has U + amount >
// cap; nothing written) and INSUFFICIENT; a granted hold is added to the counter of each limit
// in scope, in the window of its reserve time (Reservation.ReservedAt), and its record names
// those counters. Settle takes a hold out of the counters it names and adds an entry's cost to
// the counters of its attribution (Entry.KeyID, Project, ReservedAt); release and reap take the
// hold out; finish adds cost − hold. acct, lim and u exist or vanish together: Seed writes all
// three (the counters of the current windows from the ledger's spend plus the live holds),
// Invalidate, PushLimits and a newer epoch's settle drop all three. While acct exists, every
// current window's counter is Σ cost of the entries attributed to it up to wm + Σ live holds
// added to it; past windows are not kept exact (reports on them come from the ledger).
//
// Every amount is int64 micro-units within ±MaxAmount (10^14), checked here before any script
// call; the scripts move money only with HINCRBY on the strings they are given, because Redis
// formats Lua numbers with %.14g.
package balance
