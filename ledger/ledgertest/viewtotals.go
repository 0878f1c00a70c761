package ledgertest

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// viewTotalsTests are the sums the customer views read (issue 34): kept as charges are written,
// they must always equal the sums over the entries.
var viewTotalsTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"ViewTotalsMatchEntries", testViewTotals},
	{"ViewLimitWindowsMatchUsage", testViewLimitWindows},
}

// windowReader is a ledger that reads the limits' windows it keeps (pgledger, memledger).
type windowReader interface {
	LimitWindows(ctx context.Context, org string) ([]balance.WindowUsed, error)
}

// testViewLimitWindows: the windows the ledger keeps (LimitWindows, what the customer views read)
// equal LimitUsage's sums over the charges for each limit's current window, for an org, a key
// and a lifetime limit, after charges accounted in several passes.
func testViewLimitWindows(t *testing.T, l ledger.Ledger) {
	wr, ok := l.(windowReader)
	if !ok {
		t.Skip("this ledger keeps no windows it can read")
	}
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "vw"))
	k, _ := must2(l.CreateKey(c, "vw"))
	now := time.Now().UTC()
	mustLimit(t, l, "vw", orgScope, balance.Month, 1_000_000)
	mustLimit(t, l, "vw", scope(balance.ScopeKey, k.ID), balance.Day, 1_000_000)
	mustLimit(t, l, "vw", orgScope, balance.Lifetime, 1_000_000)
	for i := range 30 {
		ev := event("vw", int64(3+i), 7000+i)
		ev.KeyID, ev.ReservedAt = []string{k.ID, ""}[i%2], now // one window of each limit
		noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
		if i%7 == 0 {
			must(l.AccountPending(c, 1000))
		}
	}
	for must(l.AccountPending(c, 1000)) > 0 {
	}
	want := map[string]int64{}
	for _, u := range must(l.LimitUsage(c, "vw", now, -1)) {
		want[fmt.Sprintf("%s@%d/%s", u.LimitID, u.Start, u.EndUser)] += u.Used
	}
	got := map[string]int64{}
	for _, u := range must(wr.LimitWindows(c, "vw")) {
		got[fmt.Sprintf("%s@%d/%s", u.LimitID, u.Start, u.EndUser)] += u.Used
	}
	if len(want) != 3 || !maps.Equal(got, want) {
		t.Fatalf("LimitWindows = %v, LimitUsage = %v", got, want)
	}
}

// testViewTotals: after charges of two keys (and none) over several UTC days, credits, negative
// and positive adjustments (a correction, a refund), a voided event, and account passes running
// concurrently with each other and with the credits, Spend's org, key and key-since sums equal
// the sums over the org's entries and events: credits and adjustments never count as charged,
// Balance + Charged is every credit and adjustment, a voided event is nowhere.
func testViewTotals(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "vt"))
	noErr(t, l.CreateOrg(c, "vt-other"))
	k1, _ := must2(l.CreateKey(c, "vt"))
	k2, _ := must2(l.CreateKey(c, "vt"))
	other, _ := must2(l.CreateKey(c, "vt-other"))

	type charge struct {
		key  string
		at   time.Time
		cost int64
	}
	var charges []charge
	var events []ledger.UsageEvent
	for i := range 120 {
		key := []string{k1.ID, k2.ID, ""}[i%3]
		at := t0.Add(-time.Duration(i%40) * 24 * time.Hour).Add(time.Duration(i) * time.Minute)
		cost := int64(1 + i*7%23)
		ev := event("vt", cost, 1000+i)
		ev.KeyID, ev.ReservedAt = key, at
		events = append(events, ev)
		charges = append(charges, charge{key, at, cost})
	}
	// Another org's charges of its own key: never in vt's sums.
	oev := event("vt-other", 999, 5000)
	oev.KeyID = other.ID
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{oev}))
	voided := event("vt", 100_000, 6000)
	voided.KeyID = k1.ID
	noErr(t, l.VoidUsage(c, voided))

	var wg sync.WaitGroup
	errs := make(chan error, 16)
	wg.Add(1)
	go func() { // the recorder: batches of 10 while the passes run
		defer wg.Done()
		for i := 0; i < len(events); i += 10 {
			if err := l.RecordUsage(c, events[i:i+10]); err != nil {
				errs <- err
				return
			}
		}
	}()
	wg.Add(1)
	go func() { // the admin plane: credits, a correction and a refund meanwhile
		defer wg.Done()
		for i := range 5 {
			if _, _, err := l.Credit(c, "vt", 10_000, fmt.Sprintf("vt-pay-%d", i)); err != nil {
				errs <- err
				return
			}
		}
		if _, _, err := l.Adjust(c, "vt", -700, "vt-correction"); err != nil {
			errs <- err
		}
		if _, _, err := l.Adjust(c, "vt", 300, "vt-refund"); err != nil {
			errs <- err
		}
	}()
	for range 3 { // concurrent account passes, small batches
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if _, err := l.AccountPending(c, 7); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for must(l.AccountPending(c, 1000)) > 0 {
	}

	// The sums over the entries, and over the events by key and day.
	var charged, credited int64
	byKey := map[string]int64{}
	q := ledger.EntryQuery{ListQuery: ledger.ListQuery{Limit: 100}}
	for {
		p := must(l.ListEntries(c, "vt", q))
		for _, e := range p.Data {
			if e.Kind == ledger.KindCharge {
				charged -= e.Delta
				if e.Request != nil {
					byKey[e.Request.KeyID] -= e.Delta
				}
			} else {
				credited += e.Delta
			}
		}
		if p.Next == "" {
			break
		}
		q.Cursor = p.Next
	}
	var wantCharged int64
	for _, ch := range charges {
		wantCharged += ch.cost
	}
	if charged != wantCharged || credited != 50_000-700+300 {
		t.Fatalf("entries: charged %d credited %d, want %d and %d", charged, credited, wantCharged, 50_000-400)
	}
	since := []time.Time{t0, t0.Add(-7 * 24 * time.Hour), t0.Add(-30 * 24 * time.Hour), t0.Add(-100 * 24 * time.Hour), t0.Add(24 * time.Hour)}
	for _, k := range []string{k1.ID, k2.ID} {
		s := must(l.Spend(c, "vt", k, since))
		if s.Charged != charged || s.Balance+s.Charged != credited || s.Key.Charged != byKey[k] {
			t.Fatalf("key %s: Spend = %+v; entries: charged %d, credited %d, key %d", k, s, charged, credited, byKey[k])
		}
		for i, from := range since {
			y, m, d := from.Date()
			day := time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
			var want int64
			for _, ch := range charges {
				if ch.key == k && !ch.at.Before(day) {
					want += ch.cost
				}
			}
			if s.Key.Since[i] != want {
				t.Errorf("key %s since %v: %d, want %d", k, day, s.Key.Since[i], want)
			}
		}
	}
	if s := must(l.Spend(c, "vt-other", other.ID, since)); s.Charged != 999 || s.Key.Charged != 999 || s.Key.Since[0] != 999 {
		t.Fatalf("other org: %+v", s)
	}
}
