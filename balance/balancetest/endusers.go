package balancetest

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// eachEndUserScope is the scope of a limit that applies to each end user apart.
var eachEndUserScope = balance.Scope{Kind: balance.ScopeEndUser}

func endUserScope(id string) balance.Scope { return balance.Scope{Kind: balance.ScopeEndUser, ID: id} }

// reserveEU reserves amount and a token bound for key and end user eu through s.
func (x *h) reserveEU(s *balance.Store, id, key, eu string, amount, tokens int64) (balance.Reservation, error) {
	return s.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: id, Amount: amount, KeyID: key, Tokens: tokens, EndUser: eu})
}

func (x *h) mustReserveEU(s *balance.Store, id, key, eu string, amount, tokens int64) balance.Reservation {
	x.t.Helper()
	r, err := x.reserveEU(s, id, key, eu, amount, tokens)
	if err != nil {
		x.t.Fatalf("reserve %s (end user %q) %d: %v", id, eu, amount, err)
	}
	x.counters()
	return r
}

// refusedBy reserves and wants a refusal by limit id, with nothing written.
func (x *h) refusedBy(limitID, id, key, eu string, amount, tokens int64) *balance.LimitError {
	x.t.Helper()
	before, u := x.state(), x.u()
	_, err := x.reserveEU(x.s, id, key, eu, amount, tokens)
	var le *balance.LimitError
	if !errors.As(err, &le) || le.Limit.ID != limitID {
		x.t.Fatalf("reserve %s (end user %q): %v, want a refusal by limit %s", id, eu, err, limitID)
	}
	eq(x.t, "refused: balance untouched", x.state().Balance, before.Balance)
	eq(x.t, "refused: counters untouched", fmt.Sprint(x.u()), fmt.Sprint(u))
	return le
}

// settleEU records hold id's usage (cost, tokens) attributed to key and end user eu at its
// reserve time, and settles it.
func (x *h) settleEU(id, key, eu string, cost, tokens int64, at time.Time) balance.SettleStatus {
	x.t.Helper()
	e := x.l.AddCharge(x.org, balance.Entry{Delta: -cost, HoldID: id, KeyID: key, EndUser: eu, ReservedAt: at, Tokens: tokens})
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
	if err != nil {
		x.t.Fatalf("settle %s: %v", id, err)
	}
	x.counters()
	return st[0]
}

// "Without an id the limit applies to each end user apart": one definition, one counter per end
// user and window. One end user at its cap is refused (a *LimitError naming the limit, scope
// end_user without id), another is not; a request with no end user is counted by no end-user
// limit.
func exerciseEndUsersEachApart(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("eu-rpd", eachEndUserScope, balance.Day, 2, balance.Requests),
		{ID: "eu-money", Scope: eachEndUserScope, Window: balance.Day, Cap: 5_000},
	}})
	day := balance.Day.StartMS(x.redisNow())
	x.mustReserveEU(x.s, "a1", "k1", "alice", 1_000, 0)
	x.mustReserveEU(x.s, "a2", "k1", "alice", 1_000, 0)
	le := x.refusedBy("eu-rpd", "a3", "k1", "alice", 1_000, 0)
	eq(t, "refusal scope", le.Limit.Scope, eachEndUserScope)
	eq(t, "refusal unit", le.Limit.Unit, balance.Requests)
	eq(t, "refusal used (alice's)", le.Used, 2)
	x.mustReserveEU(x.s, "b1", "k1", "bob@example.com", 4_000, 0)
	x.refusedBy("eu-money", "b2", "k1", "bob@example.com", 1_001, 0)
	for i := range 3 {
		x.mustReserveEU(x.s, fmt.Sprintf("n%d", i), "k1", "", 1_000, 0) // no end user: not counted
	}
	u := x.u()
	eq(t, "alice's requests", u[field("eu-rpd", day)+":alice"], 2)
	eq(t, "alice's money", u[field("eu-money", day)+":alice"], 2_000)
	eq(t, "bob's requests", u[field("eu-rpd", day)+":bob@example.com"], 1)
	eq(t, "bob's money", u[field("eu-money", day)+":bob@example.com"], 4_000)
	eq(t, "counters: two limits × two end users, none for no end user", len(u), 4)
}

// "With an id, to that one": a limit of one end user applies beside the limit of each end user
// apart, and the tighter of the two holds, whichever it is.
func exerciseEndUserOverride(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "each", Scope: eachEndUserScope, Window: balance.Day, Cap: 10_000},
		{ID: "vip", Scope: endUserScope("vip"), Window: balance.Day, Cap: 3_000},
		{ID: "free", Scope: endUserScope("free"), Window: balance.Day, Cap: 50_000},
	}})
	day := balance.Day.StartMS(x.redisNow())
	x.mustReserveEU(x.s, "v1", "", "vip", 2_000, 0)
	le := x.refusedBy("vip", "v2", "", "vip", 2_000, 0) // the override is the tighter
	eq(t, "override scope", le.Limit.Scope, endUserScope("vip"))
	for i := range 5 {
		x.mustReserveEU(x.s, fmt.Sprintf("f%d", i), "", "free", 2_000, 0)
	}
	x.refusedBy("each", "f5", "", "free", 1, 0) // the limit of each is the tighter
	x.mustReserveEU(x.s, "o1", "", "other", 9_000, 0)
	u := x.u()
	eq(t, "vip's own counter", u[field("vip", day)], 2_000)
	eq(t, "vip's counter of each", u[field("each", day)+":vip"], 2_000)
	eq(t, "free's own counter", u[field("free", day)], 10_000)
	eq(t, "free's counter of each", u[field("each", day)+":free"], 10_000)
	eq(t, "other's counter of each", u[field("each", day)+":other"], 9_000)
}

// "The counter invariant, the seed's rebuild and the overshoot rule hold per unit", per end
// user: settle moves the hold out of its end user's counters and the entry's cost, 1 and tokens
// in; finish and release move them; after the hot state is dropped the seed rebuilds each end
// user's counters from the ledger's entries of the window plus the live holds.
func exerciseEndUserMovesAndSeed(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "money", Scope: eachEndUserScope, Window: balance.Day, Cap: 100_000},
		unitLimit("req", eachEndUserScope, balance.Day, 100, balance.Requests),
		unitLimit("tok", eachEndUserScope, balance.Day, 100_000, balance.Tokens),
		{ID: "alice", Scope: endUserScope("alice"), Window: balance.Week, Cap: 100_000},
	}})
	at := func(id, eu string) int64 { return x.u()[field(id, balance.Day.StartMS(x.redisNow()))+":"+eu] }
	ra := x.mustReserveEU(x.s, "a", "k1", "alice", 1_000, 300)
	x.mustReserveEU(x.s, "b", "k1", "bob", 2_000, 500)
	x.mustReserveEU(x.s, "c", "k1", "bob", 3_000, 700)
	x.mustReserveEU(x.s, "d", "k1", "carol", 4_000, 900)
	eq(t, "settle a", x.settleEU("a", "k1", "alice", 800, 250, ra.ReservedAt), balance.Applied)
	eq(t, "alice's money", at("money", "alice"), 800)
	eq(t, "alice's tokens", at("tok", "alice"), 250)
	eq(t, "alice's own limit", x.u()[field("alice", balance.Week.StartMS(x.redisNow()))], 800)
	if n, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "b", Cost: 1_500, Tokens: 410}}); n != 1 || err != nil {
		t.Fatalf("finish b: %d %v", n, err)
	}
	eq(t, "bob's money after b's finish", at("money", "bob"), 1_500+3_000)
	x.counters()
	x.l.AddCharge(x.org, balance.Entry{Delta: -99, HoldID: "old", EndUser: "alice", ReservedAt: ra.ReservedAt.Add(-48 * time.Hour), Tokens: 7})
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "alice's money rebuilt", at("money", "alice"), 800)
	eq(t, "alice's requests rebuilt", at("req", "alice"), 1)
	eq(t, "bob's money rebuilt", at("money", "bob"), 1_500+3_000)
	eq(t, "bob's tokens rebuilt", at("tok", "bob"), 410+700)
	eq(t, "carol's requests rebuilt (a live hold, no entry)", at("req", "carol"), 1)
	x.counters()
	if ok, err := x.s.Release(x.ctx, x.org, "c"); !ok || err != nil {
		t.Fatalf("release c: %v %v", ok, err)
	}
	eq(t, "bob's requests after the release", at("req", "bob"), 1)
	eq(t, "bob's tokens after the release", at("tok", "bob"), 410)
	x.counters()
}

// "A new or changed limit counts the live holds its scope and window cover", for end users: a
// limit of each end user apart created while holds are in flight counts each end user's holds
// in that end user's counter (none for the holds without an end user).
func exerciseNewEndUserLimitCountsHolds(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{})
	x.mustReserveEU(x.s, "a1", "k1", "alice", 1_000, 0)
	x.mustReserveEU(x.s, "a2", "k2", "alice", 1_000, 0)
	x.mustReserveEU(x.s, "b1", "k1", "bob", 1_000, 0)
	x.mustReserveEU(x.s, "n1", "k1", "", 1_000, 0)
	lim := x.l.Limits(x.org)
	lim.Limits = []balance.Limit{
		unitLimit("rph", eachEndUserScope, balance.Hour, 2, balance.Requests),
		{ID: "bob", Scope: endUserScope("bob"), Window: balance.Hour, Cap: 1_500},
	}
	v := x.l.SetLimits(x.org, lim)
	if pushed, err := x.pushLimits(v); err != nil || !pushed {
		t.Fatalf("push: %v %v", pushed, err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	hour := balance.Hour.StartMS(x.redisNow())
	u := x.u()
	eq(t, "alice's holds counted", u[field("rph", hour)+":alice"], 2)
	eq(t, "bob's hold counted", u[field("rph", hour)+":bob"], 1)
	eq(t, "bob's own limit counts his hold", u[field("bob", hour)], 1_000)
	eq(t, "counters (none for the hold without an end user)", len(u), 3)
	x.counters()
	x.refusedBy("rph", "a3", "k1", "alice", 1_000, 0)
	x.refusedBy("bob", "b2", "k1", "bob", 1_000, 0)
	x.mustReserveEU(x.s, "b3", "k1", "bob", 500, 0)
}

// "Current windows only in Redis": the reserves after a window ends sweep the per-end-user
// counters of ended windows away (HSCAN, 16 fields a call, from a cursor kept in acct), so end
// users that never come back leave nothing behind; counters of current windows, of one end user
// and of lifetime windows stay.
func exerciseEndUserCountersTrimmed(t *testing.T, env Env) {
	t.Parallel()
	const users = 300                                 // past Redis's small-hash encoding, where HSCAN returns everything at once
	at := time.Date(2031, 5, 6, 7, 8, 0, 0, time.UTC) // a minute's first instant
	x := limited(t, env, atMinute(t, env, at), 1_000_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("rpm", eachEndUserScope, balance.Minute, 5, balance.Requests),
		unitLimit("rpd", eachEndUserScope, balance.Day, 5, balance.Requests),
		unitLimit("rpl", endUserScope("u0"), balance.Lifetime, 1_000, balance.Requests),
	}})
	for i := range users {
		r, err := x.reserveEU(x.s, fmt.Sprintf("h%d", i), "", fmt.Sprintf("u%d", i), 1_000, 0)
		if err != nil {
			t.Fatalf("reserve %d: %v", i, err)
		}
		if !r.ReservedAt.Before(at.Add(time.Minute)) {
			t.Fatalf("reserve %d at %v: the burst left its minute", i, r.ReservedAt)
		}
	}
	x.counters()
	eq(t, "counters in the first minute", len(x.u()), 2*users+1)
	next := x.withClock(at.Add(time.Minute))
	minute := field("rpm", balance.Minute.StartMS(at)) + ":"
	past := func() (n int) {
		for f := range x.u() {
			if strings.HasPrefix(f, minute) {
				n++
			}
		}
		return n
	}
	// A full pass over the hash takes about (fields / 16) reserves; give it four passes.
	reserves := 0
	for ; past() > 0 && reserves < 4*(2*users+1)/16+8; reserves++ {
		if _, err := x.reserveEU(next, fmt.Sprintf("n%d", reserves), "", fmt.Sprintf("u%d", reserves), 1_000, 0); err != nil {
			t.Fatal(err)
		}
	}
	if n := past(); n > 0 {
		t.Fatalf("%d counters of the ended minute left after %d reserves", n, reserves)
	}
	u := x.u()
	eq(t, "left: the day's counters, the new minute's, the lifetime counter", len(u), users+reserves+1)
	eq(t, "a day counter kept", u[field("rpd", balance.Day.StartMS(at))+":u0"], 2)
	eq(t, "lifetime counter kept", u[field("rpl", 0)], 2)
	t.Logf("%d fields swept in %d reserves", users, reserves)
	// The holds of the past minute still end normally: their counters are gone, nothing is
	// re-created.
	for i := range users {
		if ok, err := x.s.Release(x.ctx, x.org, fmt.Sprintf("h%d", i)); !ok || err != nil {
			t.Fatalf("release %d: %v %v", i, ok, err)
		}
	}
	eq(t, "no past counter re-created", past(), 0)
	eq(t, "lifetime counter after the releases", x.u()[field("rpl", 0)], 1)
}

// An end user is validated like a key id: a bad one is refused before anything is written.
func exerciseEndUserInvalid(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		unitLimit("eu", eachEndUserScope, balance.Day, 2, balance.Requests),
	}})
	for _, eu := range []string{"a:b", "a b", "a|b", "a,b", "a;b", "{a}", "é", string(make([]byte, 129))} {
		before := x.state()
		if _, err := x.reserveEU(x.s, "h", "k1", eu, 1_000, 0); !errors.Is(err, balance.ErrInvalidLimits) {
			t.Fatalf("end user %q: %v, want ErrInvalidLimits", eu, err)
		}
		eq(t, "nothing written", x.state(), before)
	}
	// Freezes are of the org, a project or a key: a ledger's end-user freeze is refused when the
	// limits are pushed, and when they are seeded.
	lim := x.l.Limits(x.org)
	lim.Frozen = []balance.Scope{endUserScope("alice")}
	if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); !errors.Is(err, balance.ErrInvalidLimits) {
		t.Fatalf("push of a freeze of an end user: %v, want ErrInvalidLimits", err)
	}
	if err := x.s.Warm(x.ctx, x.org); !errors.Is(err, balance.ErrInvalidLimits) {
		t.Fatalf("warm with a freeze of an end user: %v, want ErrInvalidLimits", err)
	}
}

// A limit of each end user apart may require an end user: then a request of the org that names
// none is refused (ErrEndUserRequired, nothing written) instead of being counted by no end-user
// limit; requests that name one are counted as before. Only such a limit may require it.
func exerciseEndUserRequired(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "each", Scope: eachEndUserScope, Window: balance.Day, Cap: 5, Unit: balance.Requests, RequireEndUser: true},
	}})
	before := x.state()
	if _, err := x.reserveEU(x.s, "n1", "k1", "", 1_000, 0); !errors.Is(err, balance.ErrEndUserRequired) || !strings.Contains(err.Error(), "each") {
		t.Fatalf("no end user: %v, want ErrEndUserRequired naming the limit", err)
	}
	eq(t, "nothing written", x.state(), before)
	eq(t, "no counter", len(x.u()), 0)
	x.mustReserveEU(x.s, "a1", "k1", "alice", 1_000, 0)
	eq(t, "alice counted", x.u()[field("each", balance.Day.StartMS(x.redisNow()))+":alice"], 1)
	for _, l := range []balance.Limit{
		{ID: "org", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Day, Cap: 5, RequireEndUser: true},
		{ID: "one", Scope: endUserScope("alice"), Window: balance.Day, Cap: 5, RequireEndUser: true},
	} {
		lim := x.l.Limits(x.org)
		lim.Limits = []balance.Limit{l}
		if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); !errors.Is(err, balance.ErrInvalidLimits) {
			t.Fatalf("push of limit %s requiring an end user: %v, want ErrInvalidLimits", l.ID, err)
		}
		if err := x.s.Invalidate(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		if err := x.s.Warm(x.ctx, x.org); !errors.Is(err, balance.ErrInvalidLimits) {
			t.Fatalf("limit %s requiring an end user: %v, want ErrInvalidLimits", l.ID, err)
		}
	}
}

// Issue 34: per-end-user state only for holds that passed. A hold that ends without a cost
// (released, reaped, or finished at 0) takes the per-end-user counters it leaves at 0 with it, so
// end users whose requests failed leave nothing in Redis; a refusal writes none. A hold that held
// 0 on a counter (a token hold of 0) still counts there when it finishes, even after the field
// went at zero with another hold's end: finish re-creates it with the real count.
func exerciseEndUserNothingLeftAtZero(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "money", Scope: eachEndUserScope, Window: balance.Lifetime, Cap: 10_000},
		unitLimit("req", eachEndUserScope, balance.Day, 100, balance.Requests),
		unitLimit("tok", eachEndUserScope, balance.Day, 1_000, balance.Tokens),
	}})
	ownFields := func() map[string]int64 {
		out := map[string]int64{}
		for f, v := range x.u() {
			if strings.Count(f, ":") >= 2 {
				out[f] = v
			}
		}
		return out
	}
	for i := range 20 {
		id, eu := fmt.Sprintf("f%d", i), fmt.Sprintf("failing-%d", i)
		x.mustReserveEU(x.s, id, "k1", eu, 1_000, 40)
		if i%2 == 0 {
			x.mustRelease(id) // the upstream failed
		} else if !x.finish(id, 0) { // answered, and cost nothing
			t.Fatalf("finish %s", id)
		}
		x.counters()
	}
	x.refusedBy("money", "r1", "k1", "refused", 10_001, 40)
	for f, v := range ownFields() {
		// a request answered at no cost still counts 1 request; nothing else is left
		if !strings.HasPrefix(f, "req:") || v != 1 || !strings.Contains(f, ":failing-") {
			t.Fatalf("per-end-user counter %s = %d left by a request that cost nothing", f, v)
		}
		if n, _ := strconv.Atoi(f[strings.LastIndex(f, "-")+1:]); n%2 == 0 {
			t.Fatalf("per-end-user counter %s left by a request that failed", f)
		}
	}

	// alice: a hold with a token hold of 0 and one of 50; the second ends, the tokens counter
	// goes at zero; the first then finishes with 30 tokens, which its counter must show.
	x.mustReserveEU(x.s, "a0", "k1", "alice", 1_000, 0)
	x.mustReserveEU(x.s, "a1", "k1", "alice", 1_000, 50)
	x.mustRelease("a1")
	tok := field("tok", balance.Day.StartMS(x.redisNow())) + ":alice"
	if _, ok := ownFields()[tok]; ok {
		t.Fatalf("alice's tokens counter kept at 0")
	}
	if n, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "a0", Cost: 700, Tokens: 30}}); n != 1 || err != nil {
		t.Fatalf("finish a0: %d %v", n, err)
	}
	eq(t, "alice's tokens after a0's finish", ownFields()[tok], 30)
	x.counters()
}

// "Lifetime per-end-user counters in the ledger, only a bounded, recent set in Redis" (issue
// 34). With a ledger that reads one end user's lifetime spend, the seed writes no end user's
// lifetime counter: the end user's next request loads it (a placeholder holding the live holds
// that name it, plus the ledger's spend up to the placeholder's watermark), exactly; a refused
// new end user leaves nothing behind, an end user refused at its cap keeps its loaded counter.
func exerciseEndUserLifetimeLazy(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "life", Scope: eachEndUserScope, Window: balance.Lifetime, Cap: 10_000},
		unitLimit("life-rq", eachEndUserScope, balance.Lifetime, 5, balance.Requests),
		unitLimit("day-rq", eachEndUserScope, balance.Day, 100, balance.Requests),
	}})
	now := x.redisNow()
	day := balance.Day.StartMS(now)
	// alice and carol spend; then the hot state goes and is seeded again.
	for i := range 3 {
		id := fmt.Sprintf("a%d", i)
		x.mustReserveEU(x.s, id, "k1", "alice", 2_000, 0)
		x.settleEU(id, "k1", "alice", 1_500, 0, now)
	}
	x.mustReserveEU(x.s, "c0", "k1", "carol", 9_000, 0)
	x.settleEU("c0", "k1", "carol", 9_000, 0, now)
	x.mustReserveEU(x.s, "a-live", "k1", "alice", 1_000, 0) // in flight across the reseed
	x.reseed()
	u := x.u()
	eq(t, "lazy seed: alice's day counter written", u[field("day-rq", day)+":alice"], 4)
	if _, ok := u[field("life", 0)+":alice"]; ok {
		t.Fatalf("the lazy seed wrote alice's lifetime counter: %v", u)
	}
	x.counters()

	// alice's next request loads her lifetime spend: 3 × 1,500 charged + 1,000 in flight.
	loads := x.l.EndUserLoads.Load()
	x.mustReserveEU(x.s, "a3", "k1", "alice", 2_000, 0)
	if x.l.EndUserLoads.Load() == loads {
		t.Fatal("alice's lifetime counters were not loaded from the ledger")
	}
	u = x.u()
	eq(t, "alice's lifetime money: ledger + live holds", u[field("life", 0)+":alice"], 3*1_500+1_000+2_000)
	eq(t, "alice's lifetime requests", u[field("life-rq", 0)+":alice"], 5)
	// carol, never seen since the seed, is refused by what the ledger holds; her counters stay
	// loaded (her spend, not the refusal's: a capped end user's retries cost no ledger read).
	bal := x.state().Balance
	_, err := x.reserveEU(x.s, "c1", "k1", "carol", 1_001, 0)
	var le *balance.LimitError
	if !errors.As(err, &le) || le.Limit.ID != "life" {
		t.Fatalf("carol over her cap: %v, want a refusal by life", err)
	}
	eq(t, "carol's used comes from the ledger", le.Used, 9_000)
	eq(t, "refused: balance untouched", x.state().Balance, bal)
	eq(t, "carol's loaded counter: her spend", x.u()[field("life", 0)+":carol"], 9_000)
	x.counters()
	// dave, who never spent, is refused: nothing is left for him
	if _, err := x.reserveEU(x.s, "d1", "k1", "dave", 10_001, 0); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("dave over the cap: %v", err)
	}
	for f := range x.u() {
		if strings.HasSuffix(f, ":dave") {
			t.Fatalf("a refused request of a new end user left %s", f)
		}
	}
	x.mustReserveEU(x.s, "c2", "k1", "carol", 1_000, 0)
	eq(t, "carol at her cap", x.u()[field("life", 0)+":carol"], 10_000)
	// the counters move as ever once loaded
	x.settleEU("a-live", "k1", "alice", 700, 0, now)
	x.settleEU("a3", "k1", "alice", 2_000, 0, now)
	eq(t, "alice after the settles", x.u()[field("life", 0)+":alice"], 3*1_500+700+2_000)
	x.refusedBy("life-rq", "a4", "k1", "alice", 1, 0) // a sixth request: over the requests cap
}

// The bound: past Config.EndUserFields fields, reserves evict other end users' lifetime
// counters; an evicted counter whose end user still has holds in flight is skipped by their
// settle, release and finish, and the end user's next request loads it exactly.
func exerciseEndUserLifetimeEvicted(t *testing.T, env Env) {
	t.Parallel()
	const bound, users = 12, 40
	x := limited(t, env, balance.Config{EndUserFields: bound}, 10_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "life", Scope: eachEndUserScope, Window: balance.Lifetime, Cap: 1_000_000},
		unitLimit("life-tk", eachEndUserScope, balance.Lifetime, 1_000_000, balance.Tokens),
	}})
	now := x.redisNow()
	x.reseed() // seeded lazily
	lifeField := func(eu string) string { return field("life", 0) + ":" + eu }
	// u0's holds stay in flight while the others push its counters out.
	x.mustReserveEU(x.s, "u0-a", "k1", "u0", 3_000, 70)
	x.mustReserveEU(x.s, "u0-b", "k1", "u0", 1_000, 20)
	// the others' holds stay in flight too, so their counters stay above 0 until evicted
	most := 0
	for i := 1; i < users; i++ {
		eu := fmt.Sprintf("u%d", i)
		x.mustReserveEU(x.s, "h-"+eu, "k1", eu, 1_000+int64(i), 10)
		most = max(most, len(x.u()))
	}
	if most > bound+2 {
		t.Fatalf("u grew to %d fields, bound %d (+2 for the fields of the reserve that evicts)", most, bound)
	}
	if _, ok := x.u()[lifeField("u0")]; ok {
		t.Fatalf("u0's counter was never evicted (%d fields)", len(x.u()))
	}
	for i := 1; i < users; i++ {
		eu := fmt.Sprintf("u%d", i)
		x.settleEU("h-"+eu, "k1", eu, 500+int64(i), 5, now)
	}
	// u0's holds end while its counters are gone: nothing is re-created.
	x.settleEU("u0-a", "k1", "u0", 2_500, 60, now)
	if !x.finish("u0-b", 800) {
		t.Fatal("finish u0-b")
	}
	if _, ok := x.u()[lifeField("u0")]; ok {
		t.Fatal("a settle or finish re-created an evicted lifetime counter")
	}
	// u0 comes back: 2,500 charged + 800 finished in flight + 100 now.
	x.mustReserveEU(x.s, "u0-c", "k1", "u0", 100, 1)
	u := x.u()
	eq(t, "u0's money after the load", u[lifeField("u0")], 2_500+800+100)
	eq(t, "u0's tokens after the load (u0-b finished with 0 tokens)", u[field("life-tk", 0)+":u0"], 60+0+1)
	// and every end user that comes back gets its exact spend
	for i := 1; i < users; i += 7 {
		eu := fmt.Sprintf("u%d", i)
		x.mustReserveEU(x.s, "again-"+eu, "k1", eu, 1, 0)
		eq(t, "reloaded "+eu, x.u()[lifeField(eu)], 500+int64(i)+1)
	}
}

// A ledger that cannot read one end user's spend (only balance.LimitLedger) keeps the eager
// seed: every end user's lifetime counter is written by the seed, and none is ever evicted.
func exerciseEndUserLifetimeEager(t *testing.T, env Env) {
	t.Parallel()
	l := NewFakeLedger(1)
	x := fixture(t, env, balance.Config{Ledger: eagerLedger{l}, EndUserFields: 2}, 0, false)
	x.l = l
	l.Add(x.org, 1_000_000, "")
	l.SetLimits(x.org, balance.Limits{Limits: []balance.Limit{
		{ID: "life", Scope: eachEndUserScope, Window: balance.Lifetime, Cap: 10_000},
	}})
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatalf("warm: %v", err)
	}
	now := x.redisNow()
	for i := range 5 {
		eu := fmt.Sprintf("e%d", i)
		x.mustReserveEU(x.s, "h-"+eu, "k1", eu, 1_000, 0)
		x.settleEU("h-"+eu, "k1", eu, 100*int64(i+1), 0, now)
	}
	x.reseed()
	u := x.u()
	for i := range 5 {
		eq(t, fmt.Sprintf("e%d's counter seeded", i), u[field("life", 0)+fmt.Sprintf(":e%d", i)], 100*int64(i+1))
	}
	eq(t, "no load", l.EndUserLoads.Load(), 0)
}

// eagerLedger hides FakeLedger's EndUserUsed: a balance.LimitLedger and nothing more.
type eagerLedger struct{ *FakeLedger }

func (e eagerLedger) EndUserUsed() {} // shadows the promoted method with another signature

// A burst on lazy lifetime counters: 600 concurrent reserves of 30 end users, each with spend in
// the ledger from before the seed, while a settler charges the granted holds one by one (the
// watermark keeps moving under the loads) and the org's counters are bounded at 16 fields (loads
// keep evicting each other). No end user is granted past its cap: Σ of its ledger spend and its
// granted holds stays ≤ the cap, and the counter invariant holds at the end.
func exerciseEndUserLifetimeBurst(t *testing.T, env Env) {
	t.Parallel()
	const users, requests, capPer, prior, amount = 30, 600, 10_000, 4_000, 700
	env.Client = roomyClient(t, env.Client) // env is this function's copy: room for the burst
	x := limited(t, env, balance.Config{EndUserFields: 16, MaxInFlight: requests}, 100_000_000, balance.Limits{Limits: []balance.Limit{
		{ID: "life", Scope: eachEndUserScope, Window: balance.Lifetime, Cap: capPer},
	}})
	now := x.redisNow()
	for i := range users {
		eu := fmt.Sprintf("b%d", i)
		x.mustReserveEU(x.s, "prior-"+eu, "k1", eu, prior, 0)
		x.settleEU("prior-"+eu, "k1", eu, prior, 0, now)
	}
	x.reseed() // lazy: no end user's counter in Redis
	type grant struct{ id, eu string }
	granted := make(chan grant, requests)
	settled := make(chan error, 1)
	var byUser sync.Map // end user → *atomic.Int64 of its granted amounts
	go func() {
		// one settler, in sequence order: each granted hold is charged its amount
		for g := range granted {
			e := x.l.AddCharge(x.org, balance.Entry{Delta: -amount, HoldID: g.id, KeyID: "k1", EndUser: g.eu, ReservedAt: now})
			if _, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e}); err != nil {
				settled <- err
				return
			}
		}
		settled <- nil
	}()
	ok, no := x.burst(requests, func(id string) (balance.Reservation, error) {
		n, _ := strconv.Atoi(strings.TrimPrefix(id, "burst-"))
		eu := fmt.Sprintf("b%d", n%users)
		r, err := x.reserveEU(x.s, id, "k1", eu, amount, 0)
		if err == nil {
			v, _ := byUser.LoadOrStore(eu, new(atomic.Int64))
			v.(*atomic.Int64).Add(amount)
			granted <- grant{id, eu}
		}
		return r, err
	}, func(err error) bool { return errors.Is(err, balance.ErrLimit) })
	close(granted)
	if err := <-settled; err != nil {
		t.Fatalf("settle: %v", err)
	}
	perUser := (capPer - prior) / amount // the holds of amount that fit under the cap
	eq(t, "granted: exactly what fits under each end user's cap", ok, int64(users*perUser))
	eq(t, "refused", no, int64(requests-users*perUser))
	byUser.Range(func(k, v any) bool {
		if g := v.(*atomic.Int64).Load(); prior+g > capPer {
			t.Errorf("end user %s granted %d over a ledger spend of %d: past the cap %d", k, g, prior, capPer)
		}
		return true
	})
	if loads := x.l.EndUserLoads.Load(); loads < users {
		t.Errorf("%d loads for %d end users", loads, users)
	}
	x.counters()
}
