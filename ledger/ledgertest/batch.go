package ledgertest

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// The worker's batched calls (issue 12): one account pass, one read of several orgs' unsettled
// entries, one write of their settled marks.
var batchTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"AccountPassResult", testAccountPass},
	{"AccountPassHandsOverEntries", testAccountPassSettle},
	{"UnsettledEntriesOf", testUnsettledOf},
	{"MarkSettledMany", testMarkSettledMany},
	{"LargeBatches", testLargeBatches},
}

// testLargeBatches: batches of many events (a store may send them another way than small ones,
// as the Postgres store sends them with COPY) are idempotent like small ones — a batch with
// events already stored and a voided one records the others only — and many events accounted in
// one pass keep every attribution, an end user with tabs, newlines and backslashes included.
func testLargeBatches(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "a"))
	noErr(t, l.CreateOrg(c, "b"))
	var first []ledger.UsageEvent
	for i := range 40 {
		ev := event([]string{"a", "b"}[i%2], int64(10+i), i)
		ev.EndUser, ev.Project = fmt.Sprintf("user\t%d\n\\ \"x\"", i%3), ""
		if i%5 == 0 {
			ev.KeyID, ev.EndUser = "", ""
		}
		first = append(first, ev)
	}
	noErr(t, l.RecordUsage(c, first))
	noErr(t, l.RecordUsage(c, first)) // again: nothing new
	void := event("a", 999, 100)
	noErr(t, l.VoidUsage(c, void))
	second := append([]ledger.UsageEvent{void}, first[:5]...)
	for i := range 34 {
		second = append(second, event("b", int64(100+i), 200+i))
	}
	noErr(t, l.RecordUsage(c, second))
	if a, b := account(t, l, "a"), account(t, l, "b"); a.Pending != 20 || b.Pending != 54 {
		t.Fatalf("pending a %d b %d, want 20 and 54", a.Pending, b.Pending)
	}
	if n := must(l.AccountPending(c, 1000)); n != 74 {
		t.Fatalf("AccountPending = %d, want 74", n)
	}
	if n := must(l.AccountPending(c, 1000)); n != 0 {
		t.Fatalf("second AccountPending = %d, want 0", n)
	}
	byHold := map[string]balance.Entry{}
	for _, org := range []string{"a", "b"} {
		for _, e := range checkLedger(t, l, org) {
			byHold[e.HoldID] = e
		}
	}
	for _, ev := range append(slices.Clone(first), second[6:]...) {
		e, ok := byHold[ev.ID]
		if !ok || e.Delta != -ev.Cost {
			t.Fatalf("event %s (cost %d): entry %+v", ev.ID, ev.Cost, e)
		}
		wantKey, wantUser := "", ""
		if ev.KeyID != "" {
			wantKey = ledger.AttrID(balance.ScopeKey, ev.KeyID)
		}
		if ev.EndUser != "" {
			wantUser = ledger.AttrID(balance.ScopeEndUser, ev.EndUser)
		}
		if e.KeyID != wantKey || e.EndUser != wantUser || e.Tokens != ev.Usage.Prompt+ev.Usage.Completion {
			t.Fatalf("event %s: entry %+v, want key %q end user %q", ev.ID, e, wantKey, wantUser)
		}
		if r := must(l.Request(c, ev.ID)); r.Status != ledger.RequestAccounted || r.Seq != e.Seq || r.EndUser != ev.EndUser {
			t.Fatalf("request %s: %+v, want accounted at seq %d", ev.ID, r, e.Seq)
		}
	}
	if _, ok := byHold[void.ID]; ok {
		t.Fatal("the voided event was charged")
	}
	if r := must(l.Request(c, void.ID)); r.Status != ledger.RequestVoided {
		t.Fatalf("voided request: %+v", r)
	}
}

// testAccountPass: AccountPass reports the orgs it charged and, per model, the highest real
// cost of one choice, ⌈cost / choices⌉; an estimated cost teaches nothing.
func testAccountPass(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "a"))
	noErr(t, l.CreateOrg(c, "b"))
	ev := func(org, model string, cost, choices int64, estimated bool, i int) ledger.UsageEvent {
		e := event(org, cost, i)
		e.Model, e.Choices, e.Estimated = model, choices, estimated
		return e
	}
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{
		ev("a", "m1", 100, 0, false, 0),   // one choice: 100
		ev("a", "m1", 301, 4, false, 1),   // ⌈301/4⌉ = 76
		ev("b", "m1", 90, 1, false, 2),    // 90
		ev("b", "m2", 1000, 1, true, 3),   // estimated: nothing learned
		ev("b", "m3", 7, 3, false, 4),     // ⌈7/3⌉ = 3
		ev("a", "m3", 1, 5, false, 5),     // ⌈1/5⌉ = 1
		ev("a", "m4", 2000, 2, true, 6),   // estimated
		ev("b", "m4", 1001, 10, false, 7), // ⌈1001/10⌉ = 101
	}))
	r, err := l.AccountPass(c, 100)
	noErr(t, err)
	if r.Accounted != 8 {
		t.Fatalf("Accounted = %d, want 8", r.Accounted)
	}
	orgs := slices.Sorted(slices.Values(r.Orgs))
	if !slices.Equal(orgs, []string{"a", "b"}) {
		t.Fatalf("Orgs = %v, want a and b once each", r.Orgs)
	}
	want := map[string]int64{"m1": 100, "m3": 3, "m4": 101}
	if !maps.Equal(r.MaxCost, want) {
		t.Fatalf("MaxCost = %v, want %v", r.MaxCost, want)
	}
	if a, b := account(t, l, "a"), account(t, l, "b"); a.Balance != -2402 || b.Balance != -2098 || a.LedgerSeq != 4 || b.LedgerSeq != 4 {
		t.Fatalf("accounts after the pass: %+v %+v", a, b)
	}
	r, err = l.AccountPass(c, 100)
	if err != nil || r.Accounted != 0 || len(r.Orgs) != 0 || len(r.MaxCost) != 0 {
		t.Fatalf("second pass = %+v, %v; want nothing", r, err)
	}
	if n := must(l.AccountPending(c, 100)); n != 0 {
		t.Fatalf("AccountPending after the pass = %d", n)
	}
}

// testAccountPassSettle: AccountPass hands over, for each org it charged whose entries were all
// settled before it, the entries it wrote: byte for byte what UnsettledEntriesOf then reads
// (attribution and Recorded included), with the epoch. An org that was behind, or that a
// limited pass left with unsettled entries, is not handed over.
func testAccountPassSettle(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	for _, org := range []string{"clean", "behind"} {
		noErr(t, l.CreateOrg(c, org))
		_, _, err := l.Credit(c, org, 1000, "c-"+org)
		noErr(t, err)
	}
	noErr(t, l.MarkSettled(c, "clean", 1))
	var evs []ledger.UsageEvent
	for i, org := range []string{"clean", "fresh", "clean", "behind", "fresh", "clean"} {
		e := event(org, int64(10+i), i)
		switch i {
		case 2:
			e.Project, e.ReservedAt = "proj_1", t0.Add(-time.Minute)
		case 4:
			e.KeyID = ""
		}
		evs = append(evs, e)
	}
	noErr(t, l.RecordUsage(c, evs))
	r, err := l.AccountPass(c, 100)
	noErr(t, err)
	if keys := slices.Sorted(maps.Keys(r.Settle)); !slices.Equal(keys, []string{"clean", "fresh"}) {
		t.Fatalf("handed over %v, want clean and fresh (behind has an unsettled credit)", keys)
	}
	if ep := must(l.Epoch(c)); r.Epoch != ep {
		t.Fatalf("epoch %v, want the ledger's %v", r.Epoch, ep)
	}
	sameAsRead(t, l, r, map[string][]string{"clean": {evs[0].ID, evs[2].ID, evs[5].ID}, "fresh": {evs[1].ID, evs[4].ID}})
	if s := seqs(r.Settle["clean"]); !slices.Equal(s, []int64{2, 3, 4}) {
		t.Fatalf("clean: seqs %v, want 2 3 4", s)
	}

	// A pass limited to part of an org's usage hands that part over; the next pass finds the
	// org behind (nothing was settled in between) and hands nothing over.
	noErr(t, l.MarkSettledMany(c, map[string]int64{"clean": 4, "fresh": 2}))
	more := []ledger.UsageEvent{event("clean", 1, 10), event("clean", 2, 11), event("clean", 3, 12)}
	noErr(t, l.RecordUsage(c, more))
	r, err = l.AccountPass(c, 2)
	noErr(t, err)
	sameAsRead(t, l, r, map[string][]string{"clean": {more[0].ID, more[1].ID}})
	r, err = l.AccountPass(c, 100)
	noErr(t, err)
	if r.Accounted != 1 || len(r.Settle) != 0 || !r.Epoch.IsZero() {
		t.Fatalf("pass after an unsettled one: %+v, want one event and nothing handed over", r)
	}
}

// sameAsRead checks that r hands over exactly the orgs of want, each with entries for the
// event ids of want (in order) that equal, field for field, what UnsettledEntriesOf reads.
func sameAsRead(t *testing.T, l ledger.Ledger, r ledger.AccountResult, want map[string][]string) {
	t.Helper()
	if keys := slices.Sorted(maps.Keys(r.Settle)); !slices.Equal(keys, slices.Sorted(maps.Keys(want))) {
		t.Fatalf("handed over %v, want %v", keys, slices.Sorted(maps.Keys(want)))
	}
	read, ep, err := l.UnsettledEntriesOf(ctx(t), slices.Collect(maps.Keys(want)), 1000)
	noErr(t, err)
	if ep != r.Epoch {
		t.Fatalf("epoch %v, the read's %v", r.Epoch, ep)
	}
	for org, ids := range want {
		got := r.Settle[org]
		if len(got) != len(ids) || len(read[org]) != len(ids) {
			t.Fatalf("%s: handed over %d entries, read %d, want %d", org, len(got), len(read[org]), len(ids))
		}
		for i, e := range got {
			if e.HoldID != ids[i] {
				t.Fatalf("%s entry %d: hold %s, want event %s", org, i, e.HoldID, ids[i])
			}
			if e != read[org][i] { // == : every field, time zones and monotonic readings included
				t.Fatalf("%s entry %d:\nhanded over %#v\nread back   %#v", org, i, e, read[org][i])
			}
		}
	}
}

// testUnsettledOf: UnsettledEntriesOf answers for each org what UnsettledEntries answers
// (limit per org, Seq order, the epoch), and leaves out orgs with nothing to settle.
func testUnsettledOf(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	for _, org := range []string{"x", "y", "z", "settled"} {
		noErr(t, l.CreateOrg(c, org))
	}
	for i := range 5 {
		_, _, err := l.Credit(c, "x", int64(10+i), fmt.Sprint("x", i))
		noErr(t, err)
	}
	_, _, err := l.Credit(c, "y", 7, "y0")
	noErr(t, err)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("y", 3, 0), event("y", 4, 1)}))
	must(l.AccountPending(c, 100))
	_, _, err = l.Credit(c, "settled", 1, "s0")
	noErr(t, err)
	noErr(t, l.MarkSettled(c, "settled", 1))
	noErr(t, l.MarkSettled(c, "x", 1))

	got, ep, err := l.UnsettledEntriesOf(c, []string{"x", "y", "z", "settled", "nobody"}, 3)
	noErr(t, err)
	if ep != must(l.Epoch(c)) {
		t.Fatalf("epoch %v, want the ledger's", ep)
	}
	if keys := slices.Sorted(maps.Keys(got)); !slices.Equal(keys, []string{"x", "y"}) {
		t.Fatalf("orgs = %v, want x and y", keys)
	}
	for _, org := range []string{"x", "y"} {
		one, _, err := l.UnsettledEntries(c, org, 3)
		noErr(t, err)
		if len(one) != len(got[org]) {
			t.Fatalf("%s: %d entries, UnsettledEntries has %d", org, len(got[org]), len(one))
		}
		for i := range one {
			a, b := one[i], got[org][i]
			if a.Seq != b.Seq || a.Delta != b.Delta || a.HoldID != b.HoldID || a.KeyID != b.KeyID || a.Project != b.Project ||
				!a.ReservedAt.Equal(b.ReservedAt) || !a.Recorded.Equal(b.Recorded) {
				t.Fatalf("%s entry %d: %+v, UnsettledEntries has %+v", org, i, b, a)
			}
		}
	}
	if s := seqs(got["x"]); !slices.Equal(s, []int64{2, 3, 4}) {
		t.Fatalf("x: seqs %v, want 2 3 4", s)
	}
	if s := seqs(got["y"]); !slices.Equal(s, []int64{1, 2, 3}) || got["y"][1].HoldID == "" {
		t.Fatalf("y: %+v, want seqs 1 2 3 with the charges' hold ids", got["y"])
	}
	if got, _, err := l.UnsettledEntriesOf(c, nil, 3); err != nil || len(got) != 0 {
		t.Fatalf("no orgs: %v %v", got, err)
	}
	_, _, err = l.UnsettledEntriesOf(c, []string{"x", "bad{org}"}, 3)
	wantErr(t, err, balance.ErrInvalidOrg, "UnsettledEntriesOf with an invalid org id")
}

// testMarkSettledMany: each org's settled_seq moves to its mark, never down, capped at its
// ledger_seq; an org with no account is skipped.
func testMarkSettledMany(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	for _, org := range []string{"p", "q", "r"} {
		noErr(t, l.CreateOrg(c, org))
		for i := range 4 {
			_, _, err := l.Credit(c, org, 5, fmt.Sprint(org, i))
			noErr(t, err)
		}
	}
	noErr(t, l.MarkSettled(c, "r", 3))
	noErr(t, l.MarkSettledMany(c, map[string]int64{"p": 2, "q": 99, "r": 1, "ghost": 4}))
	for org, want := range map[string]int64{"p": 2, "q": 4, "r": 3} {
		if a := account(t, l, org); a.SettledSeq != want {
			t.Fatalf("%s: settled_seq = %d, want %d", org, a.SettledSeq, want)
		}
	}
	noErr(t, l.MarkSettledMany(c, nil))
	noErr(t, l.MarkSettledMany(c, map[string]int64{"p": 4}))
	if orgs := must(l.OrgsToSettle(c, 10)); len(orgs) != 1 || orgs[0] != "r" {
		t.Fatalf("OrgsToSettle = %v, want [r]", orgs)
	}
}

func seqs(es []balance.Entry) []int64 {
	out := make([]int64, len(es))
	for i, e := range es {
		out[i] = e.Seq
	}
	return out
}
