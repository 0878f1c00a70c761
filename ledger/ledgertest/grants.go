package ledgertest

import (
	"errors"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
)

// Credit grants (grant.Store, docs/grants.md): spending order, the reserve-time rule, expire
// entries written once with the exact rest, and what the hot balance reads about them.
var grantTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"GrantsSpendInOrder", testGrantsSpendInOrder},
	{"GrantsReserveTimeRule", testGrantsReserveTimeRule},
	{"GrantsExpireOnce", testGrantsExpireOnce},
	{"GrantsTermsAreIdempotent", testGrantsTerms},
}

func grants(t *testing.T, l ledger.Ledger) grant.Store {
	t.Helper()
	g, ok := l.(grant.Store)
	if !ok {
		t.Fatal("the ledger has no grants role")
	}
	return g
}

// charged records one usage event of cost reserved at at and accounts it.
func charged(t *testing.T, l ledger.Ledger, org string, cost int64, at time.Time) {
	t.Helper()
	ev := event(org, cost, 0)
	ev.ReservedAt, ev.CreatedAt = at, at
	noErr(t, l.RecordUsage(ctx(t), []ledger.UsageEvent{ev}))
	must(l.AccountPending(ctx(t), 100))
}

func grantsByRef(t *testing.T, l ledger.Ledger, org string) map[string]grant.Grant {
	t.Helper()
	out := map[string]grant.Grant{}
	for _, g := range must(grants(t, l).Grants(ctx(t), org)) {
		out[g.Reference] = g
	}
	return out
}

func testGrantsSpendInOrder(t *testing.T, l ledger.Ledger) {
	c, g := ctx(t), grants(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	now := time.Now()
	mustGrant(g.CreditGrant(c, "o", 1000, "paid", grant.Paid))
	mustGrant(g.CreditGrant(c, "o", 300, "promo-late", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: now.Add(48 * time.Hour)}))
	mustGrant(g.CreditGrant(c, "o", 200, "promo-soon", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: now.Add(24 * time.Hour)}))
	charged(t, l, "o", 250, now)
	byRef := grantsByRef(t, l, "o")
	if byRef["promo-soon"].Rest != 0 || byRef["promo-late"].Rest != 250 || byRef["paid"].Rest != 1000 {
		t.Fatalf("after 250: %+v (want the soonest promotional spent first)", byRef)
	}
	_, _, err := l.Adjust(c, "o", -400, "refund")
	noErr(t, err)
	byRef = grantsByRef(t, l, "o")
	if byRef["promo-late"].Rest != 0 || byRef["paid"].Rest != 850 {
		t.Fatalf("after a debit of 400: %+v", byRef)
	}
	gs := must(g.Grants(c, "o"))
	if len(gs) != 3 || gs[0].Reference != "promo-soon" || gs[2].Reference != "paid" {
		t.Fatalf("listing order: %+v", gs)
	}
	// The hot balance reads the rests with the entries and the snapshot.
	snap := must(l.Snapshot(c, "o"))
	if x := snap.Expiries; x == nil || len(*x) != 2 || (*x)[now.Add(24*time.Hour).UnixMilli()] != 0 || (*x)[now.Add(48*time.Hour).UnixMilli()] != 0 {
		t.Fatalf("snapshot expiries %v", snap.Expiries)
	}
	es := entries(t, l, "o")
	if es[1].GrantExpiry.IsZero() || es[0].GrantExpiry.IsZero() == false {
		t.Fatalf("credit marks: %+v", es[:3])
	}
	if x := es[len(es)-1].Expiries; x == nil || len(*x) != 2 {
		t.Fatalf("the last entry of a read carries the rests: %+v", es[len(es)-1])
	}
}

func testGrantsReserveTimeRule(t *testing.T, l ledger.Ledger) {
	c, g := ctx(t), grants(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	now := time.Now()
	at := now.Add(time.Hour).Truncate(time.Millisecond)
	mustGrant(g.CreditGrant(c, "o", 500, "paid", grant.Paid))
	mustGrant(g.CreditGrant(c, "o", 100, "promo", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}))
	charged(t, l, "o", 30, at.Add(time.Millisecond))  // reserved after the expiry: paid credit only
	charged(t, l, "o", 40, at.Add(-time.Millisecond)) // reserved before, charged after: the promo
	byRef := grantsByRef(t, l, "o")
	if byRef["promo"].Rest != 60 || byRef["paid"].Rest != 470 {
		t.Fatalf("rests %+v", byRef)
	}
}

func testGrantsExpireOnce(t *testing.T, l ledger.Ledger) {
	c, g := ctx(t), grants(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	now := time.Now()
	at := now.Add(time.Hour).Truncate(time.Millisecond)
	mustGrant(g.CreditGrant(c, "o", 500, "paid", grant.Paid))
	mustGrant(g.CreditGrant(c, "o", 100, "a", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}))
	mustGrant(g.CreditGrant(c, "o", 70, "b", grant.Options{Priority: grant.PriorityPaid, ExpiresAt: at}))
	charged(t, l, "o", 120, now) // 100 of a, 20 of b
	if due := must(g.DueGrants(c, at.Add(-time.Second), 10)); len(due) != 0 {
		t.Fatalf("due before the time: %v", due)
	}
	if due := must(g.DueGrants(c, at, 10)); len(due) != 1 || !due["o"].Equal(at) {
		t.Fatalf("due at the time: %v", due)
	}
	if n := must(g.ExpireGrants(c, "o", at.Add(-time.Second))); n != 0 {
		t.Fatalf("expired before the time: %d", n)
	}
	// A charge reserved before the expiry, recorded and not yet accounted, spends the grant
	// first: the expiry accounts it.
	ev := event("o", 10, 0)
	ev.ReservedAt, ev.CreatedAt = at.Add(-time.Minute), at.Add(-time.Minute)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	for range 3 {
		must(g.ExpireGrants(c, "o", at))
	}
	if due := must(g.DueGrants(c, at, 10)); len(due) != 0 {
		t.Fatalf("due after the expiry: %v", due)
	}
	var xs []balance.Entry
	for _, e := range entries(t, l, "o") {
		if !e.Expired.IsZero() {
			xs = append(xs, e)
		}
	}
	if len(xs) != 2 || xs[0].Delta != 0 || xs[1].Delta != -40 || xs[0].LastOfExpiry || !xs[1].LastOfExpiry || !xs[1].Expired.Equal(at) {
		t.Fatalf("expire entries %+v, want 0 and -40, the last marked", xs)
	}
	if a := account(t, l, "o"); a.Balance != 500+100+70-120-10-40 || a.Pending != 0 {
		t.Fatalf("account %+v", a)
	}
	byRef := grantsByRef(t, l, "o")
	if !byRef["b"].Expired || byRef["b"].ExpiredAmount != 40 || byRef["b"].Rest != 0 || byRef["paid"].Rest != 500 {
		t.Fatalf("grants %+v", byRef)
	}
	if snap := must(l.Snapshot(c, "o")); snap.Expiries == nil || len(*snap.Expiries) != 0 {
		t.Fatalf("snapshot after the expiry: %v", snap.Expiries)
	}
}

func testGrantsTerms(t *testing.T, l ledger.Ledger) {
	c, g := ctx(t), grants(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	at := time.Now().Add(time.Hour).Truncate(time.Millisecond)
	o := grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}
	e1, created, err := g.CreditGrant(c, "o", 100, "r", o)
	noErr(t, err)
	e2, again, err := g.CreditGrant(c, "o", 100, "r", o)
	noErr(t, err)
	if !created || again || e1.Seq != e2.Seq {
		t.Fatalf("idempotent credit: %v %v %+v %+v", created, again, e1, e2)
	}
	if _, _, err := g.CreditGrant(c, "o", 100, "r", grant.Paid); !errors.Is(err, ledger.ErrReferenceConflict) {
		t.Fatalf("other terms, same reference: %v", err)
	}
	if _, _, err := g.CreditGrant(c, "o", 100, "past", grant.Options{ExpiresAt: time.Now().Add(-time.Second)}); !errors.Is(err, grant.ErrInvalid) {
		t.Fatalf("an expiry in the past: %v", err)
	}
	if _, _, err := g.CreditGrant(c, "o", 100, "prio", grant.Options{Priority: -1}); !errors.Is(err, grant.ErrInvalid) {
		t.Fatalf("a negative priority: %v", err)
	}
}

// mustGrant is a CreditGrant's entry, or the test's failure.
func mustGrant(e ledger.LedgerEntry, _ bool, err error) ledger.LedgerEntry {
	if err != nil {
		panic(failure{err})
	}
	return e
}
