package ledgertest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// Lifetime limits of each end user apart, loaded per end user (DESIGN.md "Limits", planned in
// issue 34): the seed leaves their per-end-user spend out, and the hot balance reads one end
// user's, as of its watermark, with EndUserUsed.
var endUserUsedTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"EndUserUsedRandom", testEndUserUsedRandom},
	{"EndUserUsedArgs", testEndUserUsedArgs},
	{"SnapshotLeavesOutLifetimeEachEndUser", testSnapshotLeavesOutLifetimeEachEndUser},
}

// endUserUsedLedger is what the hot balance asserts a ledger to (an unexported interface of its
// own, with this signature).
type endUserUsedLedger interface {
	EndUserUsed(ctx context.Context, org, endUser string, limits []balance.Limit, upto int64) ([]balance.WindowUsed, error)
}

func endUserUsedOf(t *testing.T, l ledger.Ledger) endUserUsedLedger {
	t.Helper()
	u, ok := l.(endUserUsedLedger)
	if !ok {
		t.Fatalf("%T has no EndUserUsed", l)
	}
	return u
}

// bruteEndUserUsed is Σ of endUser's charges with seq ≤ upto of es in each limit's unit.
func bruteEndUserUsed(es []balance.Entry, endUser string, limits []balance.Limit, upto int64) []balance.WindowUsed {
	out := make([]balance.WindowUsed, len(limits))
	for i, l := range limits {
		out[i] = balance.WindowUsed{LimitID: l.ID, EndUser: endUser}
		for _, e := range es {
			if e.Seq <= upto && e.HoldID != "" && e.Delta <= 0 && e.EndUser == endUser {
				out[i].Used += l.Unit.Count(-e.Delta, e.Tokens)
			}
		}
	}
	return out
}

// testEndUserUsedRandom: random charges of several end users (before and after the limits
// exist, accounted by the account pass or by a snapshot, some left pending, some settled, some
// with no end user or one no limit can name), with limits made and deleted along the way; at
// random points up to (and past) the org's sequence, EndUserUsed gives, for every end user and
// every lifetime limit of each end user apart (deleted ones too), exactly Σ of the end user's
// charges with seq ≤ upto in the limit's unit, as read back with EntriesAfter.
func testEndUserUsedRandom(t *testing.T, l ledger.Ledger) {
	c, u := ctx(t), endUserUsedOf(t, l)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 34))
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", balance.MaxAmount/2, "pay-euu"))
	users := []string{"eu0", "eu1", "eu2", "eu3", "eu4"}
	var lims []balance.Limit // every lifetime limit of each end user apart made so far
	newLimit := func(unit balance.Unit) {
		lims = append(lims, mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Lifetime, unit, balance.MaxAmount))
	}
	check := func(round int) {
		t.Helper()
		es := entries(t, l, "o")
		seq := int64(len(es))
		uptos := []int64{0, seq, seq + 3}
		for range 4 {
			uptos = append(uptos, rng.Int64N(seq+1))
		}
		for _, upto := range uptos {
			for _, eu := range append(users, "nobody") {
				got, err := u.EndUserUsed(c, "o", eu, lims, upto)
				noErr(t, err)
				if want := bruteEndUserUsed(es, eu, lims, upto); !slices.Equal(got, want) {
					t.Fatalf("round %d (seed %d): EndUserUsed(%s, upto %d of %d) = %+v,\nwant %+v", round, seed, eu, upto, seq, got, want)
				}
			}
		}
	}
	for round := range 24 {
		switch round {
		case 3: // charges so far predate every limit: no window row until a pass charges the end user
			newLimit(balance.Money)
			newLimit(balance.Requests)
			newLimit(balance.Tokens)
			mustUnitLimit(t, l, orgScope, balance.Day, balance.Money, balance.MaxAmount) // other limits move windows too
		case 10: // a limit made later
			newLimit(balance.Money)
		case 16: // a deleted limit's row stops moving: it must not be trusted
			must(l.DeleteLimit(c, "o", lims[0].ID))
		}
		var evs []ledger.UsageEvent
		for range 1 + rng.IntN(12) {
			ev := event("o", rng.Int64N(1_000), 0)
			ev.Usage.Prompt, ev.Usage.Completion = rng.Int64N(500), rng.Int64N(500)
			switch r := rng.IntN(10); {
			case r < 7:
				ev.EndUser = users[rng.IntN(len(users))]
			case r == 7:
				ev.EndUser = "a:b" // no limit can name it: nobody's
			}
			if rng.IntN(4) > 0 {
				ev.ReservedAt = t0.Add(time.Duration(rng.IntN(1_000)) * time.Hour)
			}
			evs = append(evs, ev)
		}
		noErr(t, l.RecordUsage(c, evs))
		switch rng.IntN(4) {
		case 0, 1: // the account pass, maybe in pieces
			must(l.AccountPending(c, 1+rng.IntN(len(evs))))
		case 2: // a snapshot accounts them
			must(l.Snapshot(c, "o"))
		case 3: // left pending: not charged, counted by no one
		}
		if rng.IntN(3) == 0 {
			if a := account(t, l, "o"); a.LedgerSeq > 0 {
				noErr(t, l.MarkSettled(c, "o", 1+rng.Int64N(a.LedgerSeq)))
			}
		}
		check(round)
	}
	for must(l.AccountPending(c, 1_000)) > 0 {
	}
	check(24)
}

// testEndUserUsedArgs: an unknown org is ErrUnknownOrg (as Snapshot); an end user no limit can
// name, and a limit that is not a lifetime limit of each end user apart, are ErrInvalidLimit; no
// limit asks nothing.
func testEndUserUsedArgs(t *testing.T, l ledger.Ledger) {
	c, u := ctx(t), endUserUsedOf(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	life := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Lifetime, balance.Money, 100)
	_, err := u.EndUserUsed(c, "nobody", "alice", []balance.Limit{life}, 10)
	wantErr(t, err, ledger.ErrUnknownOrg, "EndUserUsed of an unknown org")
	_, err = u.EndUserUsed(c, "a:b", "alice", []balance.Limit{life}, 10)
	wantErr(t, err, balance.ErrInvalidOrg, "EndUserUsed of an invalid org")
	for _, eu := range []string{"", "a:b"} {
		_, err = u.EndUserUsed(c, "o", eu, []balance.Limit{life}, 10)
		wantErr(t, err, ledger.ErrInvalidLimit, fmt.Sprintf("EndUserUsed of end user %q", eu))
	}
	for _, other := range []balance.Limit{
		mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Day, balance.Money, 100),
		mustUnitLimit(t, l, scope(balance.ScopeEndUser, "alice"), balance.Lifetime, balance.Money, 100),
		mustUnitLimit(t, l, orgScope, balance.Lifetime, balance.Money, 100),
	} {
		_, err = u.EndUserUsed(c, "o", "alice", []balance.Limit{life, other}, 10)
		wantErr(t, err, ledger.ErrInvalidLimit, fmt.Sprintf("EndUserUsed of limit %+v", other))
	}
	if got, err := u.EndUserUsed(c, "o", "alice", nil, 10); err != nil || len(got) != 0 {
		t.Fatalf("EndUserUsed of no limit = %+v, %v", got, err)
	}
	got := must(u.EndUserUsed(c, "o", "alice", []balance.Limit{life}, 10))
	if want := []balance.WindowUsed{{LimitID: life.ID, EndUser: "alice"}}; !slices.Equal(got, want) {
		t.Fatalf("EndUserUsed with no charge = %+v, want %+v", got, want)
	}
}

// testSnapshotLeavesOutLifetimeEachEndUser: the seed (SnapshotSince, not LimitUsage) has no
// window of a lifetime limit of each end user apart (EndUserUsed loads each end user's), while
// the windows of each end user apart of other limits still come per end user, and a lifetime
// limit of one end user and the org's lifetime limit still come.
func testSnapshotLeavesOutLifetimeEachEndUser(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay-life"))
	lifeEach := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Lifetime, balance.Money, 500)
	lifeEachReq := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Lifetime, balance.Requests, 500)
	dayEach := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Day, balance.Money, 500)
	lifeAlice := mustUnitLimit(t, l, scope(balance.ScopeEndUser, "alice"), balance.Lifetime, balance.Money, 500)
	lifeOrg := mustUnitLimit(t, l, orgScope, balance.Lifetime, balance.Money, 5_000)
	since := time.Date(2026, 5, 5, 10, 30, 20, 0, time.UTC)
	day := since.Truncate(24 * time.Hour)
	chargeOf(t, l, "k", "alice", 5, since)
	chargeOf(t, l, "k", "bob", 7, since)
	chargeOf(t, l, "k", "carol", 11, day.AddDate(0, 0, -3)) // before the day: lifetime only
	want := []balance.WindowUsed{
		{LimitID: dayEach.ID, Start: day.UnixMilli(), EndUser: "alice", Used: 5},
		{LimitID: dayEach.ID, Start: day.UnixMilli(), EndUser: "bob", Used: 7},
		{LimitID: lifeAlice.ID, Used: 5},
		{LimitID: lifeOrg.ID, Used: 5 + 7 + 11},
	}
	if got := must(l.SnapshotSince(c, "o", since)).Limits.Used; !slices.Equal(got, want) {
		t.Fatalf("SnapshotSince's Used = %+v,\nwant %+v (no window of %s or %s)", got, want, lifeEach.ID, lifeEachReq.ID)
	}
	// The operator's report (LimitUsage) keeps them: every end user's lifetime spend.
	report := append([]balance.WindowUsed{
		{LimitID: lifeEach.ID, EndUser: "alice", Used: 5}, {LimitID: lifeEach.ID, EndUser: "bob", Used: 7},
		{LimitID: lifeEach.ID, EndUser: "carol", Used: 11},
		{LimitID: lifeEachReq.ID, EndUser: "alice", Used: 1}, {LimitID: lifeEachReq.ID, EndUser: "bob", Used: 1},
		{LimitID: lifeEachReq.ID, EndUser: "carol", Used: 1},
	}, want...)
	if got := must(l.LimitUsage(c, "o", since, -1)); !slices.Equal(got, report) {
		t.Fatalf("LimitUsage = %+v,\nwant %+v", got, report)
	}
	// The limits are in the snapshot all the same (the hot balance loads their fields).
	if ls := must(l.SnapshotSince(c, "o", since)).Limits.Limits.Limits; !slices.Contains(ls, lifeEach) || !slices.Contains(ls, lifeEachReq) {
		t.Fatalf("SnapshotSince's limits %+v lack %s or %s", ls, lifeEach.ID, lifeEachReq.ID)
	}
	// With only such limits the seed sums nothing.
	must(l.DeleteLimit(c, "o", dayEach.ID))
	must(l.DeleteLimit(c, "o", lifeAlice.ID))
	must(l.DeleteLimit(c, "o", lifeOrg.ID))
	if got := must(l.SnapshotSince(c, "o", since)).Limits.Used; len(got) != 0 {
		t.Fatalf("SnapshotSince's Used with only lifetime limits of each end user apart = %+v, want none", got)
	}
	// EndUserUsed gives each end user's.
	got := must(endUserUsedOf(t, l).EndUserUsed(c, "o", "carol", []balance.Limit{lifeEach, lifeEachReq}, must(l.Snapshot(c, "o")).Seq))
	if want := []balance.WindowUsed{{LimitID: lifeEach.ID, EndUser: "carol", Used: 11}, {LimitID: lifeEachReq.ID, EndUser: "carol", Used: 1}}; !slices.Equal(got, want) {
		t.Fatalf("EndUserUsed(carol) = %+v, want %+v", got, want)
	}
}
