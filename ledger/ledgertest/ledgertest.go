// Package ledgertest is the conformance suite every ledger.Ledger passes, the spec both stores
// answer to: the memory ledger (memledger) and the Postgres ledger (pgledger) run the same tests,
// so either can stand in for the other.
package ledgertest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// Run runs the suite. newLedger returns a new, empty ledger for each subtest (and arranges for
// it to be closed when the test ends).
func Run(t *testing.T, newLedger func(t *testing.T) ledger.Ledger) {
	tests := []struct {
		name string
		fn   func(t *testing.T, l ledger.Ledger)
	}{
		{"Orgs", testOrgs},
		{"InvalidOrgs", testInvalidOrgs},
		{"Epoch", testEpoch},
		{"Credit", testCredit},
		{"CreditReferenceConflicts", testCreditConflicts},
		{"CreditConcurrentSameRef", testCreditConcurrent},
		{"Adjust", testAdjust},
		{"RecordUsageIdempotent", testRecordIdempotent},
		{"RecordUsageRejectsBadEvents", testRecordInvalid},
		{"VoidUsage", testVoidUsage},
		{"VoidUsageRacesRecord", testVoidRace},
		{"AccountPendingSequencing", testAccountSequencing},
		{"AccountPendingUnknownOrg", testAccountUnknownOrg},
		{"AccountPendingConcurrent", testAccountConcurrent},
		{"SnapshotAccountsPendingFirst", testSnapshot},
		{"EntriesAfter", testEntriesAfter},
		{"SettleBookkeeping", testSettle},
		{"UnsettledUsage", testUnsettledUsage},
		{"Subscribe", testSubscribe},
		{"RecordUsageQuiet", testRecordQuiet},
		{"Models", testModels},
		{"CacheWrite", testCacheWrite},
		{"Keys", testKeys},
	}
	tests = append(tests, consoleTests...)
	tests = append(tests, webhookTests...)
	tests = append(tests, limitsTests...)
	tests = append(tests, limitCrossedTests...)
	tests = append(tests, batchTests...)
	tests = append(tests, endUserTests...)
	tests = append(tests, endUserUsedTests...)
	tests = append(tests, adminTokenTests...)
	tests = append(tests, topUpTests...)
	tests = append(tests, viewTotalsTests...)
	tests = append(tests, grantTests...) // credit grants (grants.go)
	tests = append(tests, jobTests...)
	tests = append(tests, batchFileTests...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			defer func() {
				if r := recover(); r != nil {
					if f, ok := r.(failure); ok {
						t.Fatalf("unexpected error: %v", f.err)
					}
					panic(r)
				}
			}()
			tc.fn(t, newLedger(t))
		})
	}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

// failure is what must panics with; Run's subtests turn it back into t.Fatal. must is only used
// on the test's own goroutine.
type failure struct{ err error }

func must[T any](v T, err error) T {
	if err != nil {
		panic(failure{err})
	}
	return v
}

func noErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantErr(t *testing.T, err, target error, what string) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: err = %v, want %v", what, err, target)
	}
}

// NewEventID returns a new hold/event id (a UUIDv7, as the middleware makes them).
func NewEventID() string { return uuid.Must(uuid.NewV7()).String() }

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func event(org string, cost int64, i int) ledger.UsageEvent {
	return ledger.UsageEvent{
		ID: NewEventID(), Org: org, KeyID: "key_1", Model: "gpt-test", Endpoint: "/v1/chat/completions",
		Usage: pricing.Usage{Prompt: 100, Completion: 50, Reasoning: 5, Units: pricing.Units{pricing.CachedInput: 10}},
		Cost:  cost, HoldAmount: cost * 2, CreatedAt: t0.Add(time.Duration(i) * time.Millisecond),
	}
}

func entries(t *testing.T, l ledger.Ledger, org string) []balance.Entry {
	t.Helper()
	es, _, err := l.EntriesAfter(ctx(t), org, 0, 1_000_000)
	noErr(t, err)
	return es
}

func account(t *testing.T, l ledger.Ledger, org string) ledger.Account {
	t.Helper()
	return must(l.Account(ctx(t), org))
}

// checkLedger checks that org's entries are numbered 1…n with no gap, that they sum to the
// balance, and that ledger_seq is n.
func checkLedger(t *testing.T, l ledger.Ledger, org string) []balance.Entry {
	t.Helper()
	es := entries(t, l, org)
	a := account(t, l, org)
	var sum int64
	for i, e := range es {
		if e.Seq != int64(i+1) {
			t.Fatalf("org %s: entry %d has seq %d (entries %v)", org, i, e.Seq, es)
		}
		sum += e.Delta
	}
	if a.Balance != sum || a.LedgerSeq != int64(len(es)) {
		t.Fatalf("org %s: account %+v, but %d entries summing to %d", org, a, len(es), sum)
	}
	return es
}

func testOrgs(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	_, err := l.Account(c, "acme")
	wantErr(t, err, ledger.ErrUnknownOrg, "Account of a missing org")
	noErr(t, l.CreateOrg(c, "acme"))
	wantErr(t, l.CreateOrg(c, "acme"), ledger.ErrOrgExists, "CreateOrg twice")
	a := account(t, l, "acme")
	if a != (ledger.Account{Org: "acme"}) {
		t.Fatalf("new account = %+v", a)
	}
	_, err = l.Snapshot(c, "nobody")
	wantErr(t, err, ledger.ErrUnknownOrg, "Snapshot of a missing org")
	wantErr(t, l.MarkSettled(c, "nobody", 1), ledger.ErrUnknownOrg, "MarkSettled of a missing org")
	_, _, err = l.Credit(c, "nobody", 5, "r-nobody")
	wantErr(t, err, ledger.ErrUnknownOrg, "Credit of a missing org")
	es, ep, err := l.EntriesAfter(c, "nobody", 0, 10)
	if err != nil || len(es) != 0 || ep.IsZero() {
		t.Fatalf("EntriesAfter of a missing org = %v, %v, %v; want none and the epoch", es, ep, err)
	}
	// The one org-id rule (balance.ValidateOrg): letters, digits, '.', '_', '-'.
	for _, org := range []string{"org_1", "Org-2.x", "9", strings.Repeat("a", balance.MaxOrgLen)} {
		noErr(t, l.CreateOrg(c, org))
	}
}

func testInvalidOrgs(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	// The same rule as balance and the admin routes: ids the hot balance or an admin URL could
	// not take are refused by the ledger too (they once reached the worker and failed there).
	for _, org := range []string{"", "a{b", "a}b", "a:b", "a b", "a\tb", "a\nb", strings.Repeat("a", balance.MaxOrgLen+1), "\xff",
		"ü", "ÄÖ", "team/a", ".", "..", "-x", "a%2Fb"} {
		wantErr(t, l.CreateOrg(c, org), balance.ErrInvalidOrg, fmt.Sprintf("CreateOrg(%q)", org))
		_, err := l.Snapshot(c, org)
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("Snapshot(%q)", org))
		_, _, err = l.Credit(c, org, 1, "r")
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("Credit(%q)", org))
		err = l.RecordUsage(c, []ledger.UsageEvent{event(org, 1, 0)})
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("RecordUsage(%q)", org))
		_, _, err = l.EntriesAfter(c, org, 0, 1)
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("EntriesAfter(%q)", org))
		_, _, err = l.CreateKey(c, org)
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("CreateKey(%q)", org))
		_, err = l.Account(c, org)
		wantErr(t, err, balance.ErrInvalidOrg, fmt.Sprintf("Account(%q)", org))
	}
}

func testEpoch(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	e1 := must(l.Epoch(c))
	if e1.IsZero() || e1.Gen < 1 || len(e1.ID) < 16 {
		t.Fatalf("epoch %+v: want generation ≥ 1 and a random id", e1)
	}
	if e2 := must(l.Epoch(c)); e2 != e1 {
		t.Fatalf("epoch changed: %v then %v", e1, e2)
	}
	noErr(t, l.CreateOrg(c, "o"))
	s := must(l.Snapshot(c, "o"))
	_, e3, err := l.EntriesAfter(c, "o", 0, 10)
	noErr(t, err)
	_, e4, err := l.UnsettledEntries(c, "o", 10)
	noErr(t, err)
	if s.Epoch != e1 || e3 != e1 || e4 != e1 {
		t.Fatalf("epochs differ: Epoch %v, Snapshot %v, EntriesAfter %v, UnsettledEntries %v", e1, s.Epoch, e3, e4)
	}
	// After a restore the generation goes up, with a new id, and every read carries it.
	r := must(l.RaiseEpoch(c))
	if r.Gen != e1.Gen+1 || r.ID == e1.ID || len(r.ID) < 16 {
		t.Fatalf("RaiseEpoch: %v after %v", r, e1)
	}
	if got := must(l.Epoch(c)); got != r {
		t.Fatalf("Epoch after RaiseEpoch: %v, want %v", got, r)
	}
	if s := must(l.Snapshot(c, "o")); s.Epoch != r {
		t.Fatalf("Snapshot after RaiseEpoch carries %v, want %v", s.Epoch, r)
	}
}

func testCredit(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	e, created, err := l.Credit(c, "o", 1_000, "pay-1")
	noErr(t, err)
	if !created || e.Seq != 1 || e.Delta != 1_000 || e.Kind != ledger.KindCredit || e.Ref != "pay-1" || e.Org != "o" || e.HoldID != "" {
		t.Fatalf("Credit = %+v, %v", e, created)
	}
	again, created, err := l.Credit(c, "o", 1_000, "pay-1")
	noErr(t, err)
	if created || again.Seq != e.Seq || again.Delta != e.Delta || again.Org != "o" {
		t.Fatalf("Credit again = %+v, %v; want the original entry, not created", again, created)
	}
	e2, created, err := l.Credit(c, "o", 500, "pay-2")
	noErr(t, err)
	if !created || e2.Seq != 2 {
		t.Fatalf("second credit %+v", e2)
	}
	es := checkLedger(t, l, "o")
	if len(es) != 2 || account(t, l, "o").Balance != 1_500 {
		t.Fatalf("entries %v", es)
	}
	for _, amount := range []int64{0, -1, balance.MaxAmount + 1} {
		_, _, err := l.Credit(c, "o", amount, fmt.Sprint("bad-", amount))
		wantErr(t, err, ledger.ErrInvalidAmount, fmt.Sprintf("Credit(%d)", amount))
	}
	// The balance never leaves ±MaxAmount.
	_, _, err = l.Credit(c, "o", balance.MaxAmount, "huge")
	wantErr(t, err, ledger.ErrInvalidAmount, "credit past MaxAmount")
	_, _, err = l.Credit(c, "o", balance.MaxAmount-1_500, "exact")
	noErr(t, err)
	if a := account(t, l, "o"); a.Balance != balance.MaxAmount || a.LedgerSeq != 3 {
		t.Fatalf("account %+v", a)
	}
}

func testCreditConflicts(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "secret-org"))
	noErr(t, l.CreateOrg(c, "other"))
	_, _, err := l.Credit(c, "secret-org", 100, "ref-x")
	noErr(t, err)
	_, _, err = l.Credit(c, "secret-org", 101, "ref-x")
	wantErr(t, err, ledger.ErrReferenceConflict, "same ref, other amount")
	_, _, err = l.Credit(c, "other", 100, "ref-x")
	wantErr(t, err, ledger.ErrReferenceConflict, "same ref, other org")
	if strings.Contains(err.Error(), "secret-org") {
		t.Fatalf("conflict error reveals the other org: %v", err)
	}
	if a := account(t, l, "other"); a.Balance != 0 || a.LedgerSeq != 0 {
		t.Fatalf("conflicting credit wrote something: %+v", a)
	}
	if a := account(t, l, "secret-org"); a.Balance != 100 || a.LedgerSeq != 1 {
		t.Fatalf("conflicting credit changed the original org: %+v", a)
	}
}

func testCreditConcurrent(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	var wg sync.WaitGroup
	var mu sync.Mutex
	created := 0
	for range 8 {
		wg.Go(func() {
			_, ok, err := l.Credit(c, "o", 7, "same-ref")
			if err != nil {
				t.Error(err)
			}
			mu.Lock()
			if ok {
				created++
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	if a := account(t, l, "o"); created != 1 || a.Balance != 7 || a.LedgerSeq != 1 {
		t.Fatalf("8 concurrent credits with one ref: created %d, account %+v; want exactly one", created, a)
	}
}

func testAdjust(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	e, created, err := l.Adjust(c, "o", -250, "fix-1")
	noErr(t, err)
	if !created || e.Seq != 1 || e.Delta != -250 || e.Kind != ledger.KindAdjust {
		t.Fatalf("Adjust = %+v, %v", e, created)
	}
	again, created, err := l.Adjust(c, "o", -250, "fix-1")
	if err != nil || created || again.Seq != 1 {
		t.Fatalf("Adjust again = %+v, %v, %v", again, created, err)
	}
	_, _, err = l.Adjust(c, "o", 250, "fix-1")
	wantErr(t, err, ledger.ErrReferenceConflict, "adjust ref reused with another amount")
	_, _, err = l.Adjust(c, "o", 0, "fix-0")
	wantErr(t, err, ledger.ErrInvalidAmount, "zero adjustment")
	_, _, err = l.Adjust(c, "o", -balance.MaxAmount-1, "fix-big")
	wantErr(t, err, ledger.ErrInvalidAmount, "adjustment below -MaxAmount")
	// Without a reference an adjustment is simply written each time.
	for range 2 {
		_, created, err := l.Adjust(c, "o", 50, "")
		if err != nil || !created {
			t.Fatalf("unreferenced adjust: %v %v", created, err)
		}
	}
	es := checkLedger(t, l, "o")
	if len(es) != 3 || account(t, l, "o").Balance != -150 {
		t.Fatalf("entries %v", es)
	}
}

func testRecordIdempotent(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	ev := event("o", 42, 0)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	ev2 := event("o", 8, 1)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev2, ev2, ev}))
	noErr(t, l.RecordUsage(c, nil))
	if p := account(t, l, "o").Pending; p != 2 {
		t.Fatalf("pending = %d, want 2", p)
	}
	n := must(l.AccountPending(c, 100))
	if n != 2 {
		t.Fatalf("AccountPending = %d, want 2", n)
	}
	// Recording an accounted event again charges nothing.
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev, ev2}))
	if n := must(l.AccountPending(c, 100)); n != 0 {
		t.Fatalf("AccountPending after re-record = %d, want 0", n)
	}
	es := checkLedger(t, l, "o")
	// A charge carries its key, its input + output tokens (what tokens limits count) and, with
	// no reserve time (fail-open), its record time.
	want := []balance.Entry{{Seq: 1, Delta: -42, HoldID: ev.ID, KeyID: "key_1", ReservedAt: ev.CreatedAt, Tokens: ev.Usage.Tokens()},
		{Seq: 2, Delta: -8, HoldID: ev2.ID, KeyID: "key_1", ReservedAt: ev2.CreatedAt, Tokens: ev2.Usage.Tokens()}}
	if !slices.Equal(es, want) {
		t.Fatalf("entries %v, want %v", es, want)
	}
	// The hold id comes back in canonical form whatever case it was recorded in.
	up := event("o", 1, 2)
	up.ID = strings.ToUpper(up.ID)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{up}))
	must(l.AccountPending(c, 10))
	es = entries(t, l, "o")
	if es[2].HoldID != strings.ToLower(up.ID) {
		t.Fatalf("hold id %q, want %q", es[2].HoldID, strings.ToLower(up.ID))
	}
}

// testVoidUsage: a voided id is never charged, whatever arrives later; an event stored first
// cannot be voided.
func testVoidUsage(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	voided, recorded := event("o", 40, 0), event("o", 7, 1)

	// Void first: the late RecordUsage (a stalled batch, a journal replay) stores nothing.
	noErr(t, l.VoidUsage(c, voided))
	noErr(t, l.VoidUsage(c, voided)) // twice is fine
	late := voided
	late.ID = strings.ToUpper(late.ID) // the same id in another case is the same event
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{late, recorded}))
	if a := account(t, l, "o"); a.Pending != 1 {
		t.Fatalf("pending %d after a voided and a recorded event, want 1", a.Pending)
	}
	if got := must(l.UnsettledUsage(c, "o", []string{voided.ID, recorded.ID})); got[voided.ID] || !got[recorded.ID] {
		t.Fatalf("UnsettledUsage = %v: a voided event is never unsettled usage", got)
	}

	// Recorded first: voiding it is refused, so the caller knows it is charged.
	err := l.VoidUsage(c, recorded)
	wantErr(t, err, ledger.ErrUsageRecorded, "VoidUsage of a recorded event")
	if n := must(l.AccountPending(c, 100)); n != 1 {
		t.Fatalf("AccountPending = %d, want 1 (the voided event is not charged)", n)
	}
	wantErr(t, l.VoidUsage(c, recorded), ledger.ErrUsageRecorded, "VoidUsage of an accounted event")
	es := checkLedger(t, l, "o")
	if want := []balance.Entry{{Seq: 1, Delta: -7, HoldID: recorded.ID, KeyID: "key_1", ReservedAt: recorded.CreatedAt, Tokens: recorded.Usage.Tokens()}}; !slices.Equal(es, want) {
		t.Fatalf("entries %v, want %v", es, want)
	}
	// A snapshot accounts nothing for it either, and no sweep is owed for it.
	snap := must(l.Snapshot(c, "o"))
	if snap.Balance != -7 || snap.Seq != 1 {
		t.Fatalf("snapshot %+v, want balance -7 at seq 1", snap)
	}
	noErr(t, l.MarkSettled(c, "o", 1))
	if orgs := must(l.OrgsToSettle(c, 10)); slices.Contains(orgs, "o") {
		t.Fatalf("OrgsToSettle = %v: nothing is owed for a voided event", orgs)
	}

	// A void of an org with no account creates nothing to bill either.
	ghost := event("ghost", 5, 2)
	noErr(t, l.VoidUsage(c, ghost))
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ghost}))
	if n := must(l.AccountPending(c, 100)); n != 0 {
		t.Fatalf("AccountPending = %d after a voided event of an org with no account", n)
	}
	_, err = l.Account(c, "ghost")
	wantErr(t, err, ledger.ErrUnknownOrg, "Account of an org with only a voided event")
	if got := must(l.UnsettledUsage(c, "ghost", []string{ghost.ID})); got[ghost.ID] {
		t.Fatalf("UnsettledUsage of a voided event without an account = %v", got)
	}

	bad := event("o", 1, 3)
	bad.ID = "not-a-uuid"
	wantErr(t, l.VoidUsage(c, bad), pricing.ErrInvalidUsage, "VoidUsage of a bad id")
}

// testVoidRace: RecordUsage and VoidUsage of the same ids at once; for every id exactly one
// wins, and the ledger charges exactly the events whose void was refused.
func testVoidRace(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	const n = 40
	evs := make([]ledger.UsageEvent, n)
	for i := range evs {
		evs[i] = event("o", int64(i+1), i)
	}
	var wg sync.WaitGroup
	refused := make([]bool, n)
	errs := make(chan error, 2*n)
	for i := range evs {
		wg.Add(2)
		go func() {
			defer wg.Done()
			if err := l.RecordUsage(c, []ledger.UsageEvent{evs[i]}); err != nil {
				errs <- err
			}
		}()
		go func() {
			defer wg.Done()
			err := l.VoidUsage(c, evs[i])
			switch {
			case errors.Is(err, ledger.ErrUsageRecorded):
				refused[i] = true
			case err != nil:
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var want int64
	var charged int
	for i, r := range refused {
		if r {
			want -= evs[i].Cost
			charged++
		}
	}
	if got := must(l.AccountPending(c, 1000)); got != charged {
		t.Fatalf("accounted %d events, want the %d whose void was refused", got, charged)
	}
	checkLedger(t, l, "o")
	if a := account(t, l, "o"); a.Balance != want {
		t.Fatalf("balance %d, want %d (exactly the events whose void was refused)", a.Balance, want)
	}
}

func testRecordInvalid(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	good := event("o", 1, 0)
	cases := map[string]struct {
		mod    func(*ledger.UsageEvent)
		target error
	}{
		"non-uuid id":          {func(e *ledger.UsageEvent) { e.ID = "req-1" }, pricing.ErrInvalidUsage},
		"no model":             {func(e *ledger.UsageEvent) { e.Model = "" }, pricing.ErrInvalidUsage},
		"negative token":       {func(e *ledger.UsageEvent) { e.Usage.Completion = -1 }, pricing.ErrInvalidUsage},
		"negative cache write": {func(e *ledger.UsageEvent) { e.Usage = e.Usage.With(pricing.CacheWrite, -1) }, pricing.ErrInvalidUsage},
		"unknown class":        {func(e *ledger.UsageEvent) { e.Usage = e.Usage.With("no_such_class", 1) }, pricing.ErrInvalidUsage},
		"negative cost":        {func(e *ledger.UsageEvent) { e.Cost = -1 }, ledger.ErrInvalidAmount},
		"huge cost":            {func(e *ledger.UsageEvent) { e.Cost = balance.MaxAmount + 1 }, ledger.ErrInvalidAmount},
		"negative hold":        {func(e *ledger.UsageEvent) { e.HoldAmount = -1 }, ledger.ErrInvalidAmount},
	}
	for name, tc := range cases {
		bad := event("o", 1, 1)
		tc.mod(&bad)
		err := l.RecordUsage(c, []ledger.UsageEvent{good, bad})
		wantErr(t, err, tc.target, name)
	}
	// A rejected batch stores nothing, not even its good events.
	if n := must(l.AccountPending(c, 100)); n != 0 {
		t.Fatalf("a rejected batch left %d events", n)
	}
}

func testAccountSequencing(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	noErr(t, l.CreateOrg(c, "p"))
	_, _, err := l.Credit(c, "o", 10_000, "pay")
	noErr(t, err)
	var evs []ledger.UsageEvent
	for i := range 5 {
		evs = append(evs, event("o", int64(100+i), 4-i)) // recorded newest first
	}
	evs = append(evs, event("p", 0, 10)) // a zero cost still gets an entry: it settles the hold
	noErr(t, l.RecordUsage(c, evs))
	if a := account(t, l, "o"); a.Pending != 5 || a.LedgerSeq != 1 {
		t.Fatalf("before accounting: %+v", a)
	}
	n1 := must(l.AccountPending(c, 3))
	if n1 != 3 {
		t.Fatalf("AccountPending(3) = %d", n1)
	}
	n2 := must(l.AccountPending(c, 100))
	if n2 != 3 {
		t.Fatalf("second AccountPending = %d, want 3", n2)
	}
	if n := must(l.AccountPending(c, 100)); n != 0 {
		t.Fatalf("third AccountPending = %d, want 0", n)
	}
	es := checkLedger(t, l, "o")
	if len(es) != 6 {
		t.Fatalf("entries %v", es)
	}
	// Charges come in the order the events were made (CreatedAt), one per event.
	for i, e := range es[1:] {
		src := evs[4-i]
		if e.HoldID != src.ID || e.Delta != -src.Cost {
			t.Fatalf("entry %d = %+v, want hold %s delta %d", e.Seq, e, src.ID, -src.Cost)
		}
	}
	if a := account(t, l, "o"); a.Balance != 10_000-510 || a.Pending != 0 {
		t.Fatalf("account %+v", a)
	}
	pes := checkLedger(t, l, "p")
	if len(pes) != 1 || pes[0].Delta != 0 || pes[0].HoldID != evs[5].ID {
		t.Fatalf("zero-cost entries %v", pes)
	}
}

func testAccountUnknownOrg(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	// A served request is billed even when its org has no account: accounting creates it.
	ev := event("ghost", 30, 0)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	orgs := must(l.OrgsToSettle(c, 10))
	if !slices.Contains(orgs, "ghost") {
		t.Fatalf("OrgsToSettle = %v; want the org with pending usage", orgs)
	}
	if n := must(l.AccountPending(c, 10)); n != 1 {
		t.Fatalf("AccountPending = %d", n)
	}
	if a := account(t, l, "ghost"); a.Balance != -30 || a.LedgerSeq != 1 {
		t.Fatalf("account %+v", a)
	}
	// Snapshot also accounts usage of an org without an account.
	ev2 := event("ghost2", 5, 0)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev2}))
	s := must(l.Snapshot(c, "ghost2"))
	if s.Balance != -5 || s.Seq != 1 {
		t.Fatalf("snapshot %+v", s)
	}
}

// testAccountConcurrent records usage in batches while three workers and a snapshotter account
// it at once, then checks every org's balance and sequence are exact. One piece: the checks at
// the end read what the goroutines above them did.
func testAccountConcurrent(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	orgs := []string{"a", "b", "c"}
	const perOrg = 120
	var all []ledger.UsageEvent
	for _, o := range orgs {
		noErr(t, l.CreateOrg(c, o))
		_, _, err := l.Credit(c, o, 1_000_000, "seed-"+o)
		noErr(t, err)
	}
	for i := range perOrg {
		for j, o := range orgs {
			all = append(all, event(o, int64(1+i%7+j), i))
		}
	}
	// Record in several batches while three workers (and a snapshotter) account concurrently.
	var recorded atomic.Bool
	var workers, snapper sync.WaitGroup
	workers.Go(func() {
		defer recorded.Store(true)
		for b := 0; b < len(all); b += 40 {
			if err := l.RecordUsage(c, all[b:min(b+40, len(all))]); err != nil {
				t.Error(err)
				return
			}
		}
	})
	idle := func() bool {
		if !recorded.Load() {
			return false
		}
		for _, o := range orgs {
			if a, err := l.Account(c, o); err != nil || a.Pending > 0 {
				return false
			}
		}
		return true
	}
	for range 3 {
		workers.Go(func() {
			for c.Err() == nil {
				n, err := l.AccountPending(c, 7)
				if err != nil {
					t.Error(err)
					return
				}
				if n == 0 {
					if idle() {
						return
					}
					time.Sleep(time.Millisecond)
				}
			}
		})
	}
	stop := make(chan struct{})
	snapper.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			if _, err := l.Snapshot(c, "b"); err != nil {
				t.Error(err)
				return
			}
		}
	})
	workers.Wait()
	close(stop)
	snapper.Wait()
	if t.Failed() {
		return
	}
	for _, o := range orgs {
		es := checkLedger(t, l, o)
		if len(es) != perOrg+1 {
			t.Fatalf("org %s has %d entries, want %d", o, len(es), perOrg+1)
		}
		seen := map[string]bool{}
		for _, e := range es[1:] {
			if e.HoldID == "" || seen[e.HoldID] {
				t.Fatalf("org %s: hold %q charged twice or missing", o, e.HoldID)
			}
			seen[e.HoldID] = true
		}
		for _, ev := range all {
			if ev.Org == o && !seen[ev.ID] {
				t.Fatalf("org %s: event %s never charged", o, ev.ID)
			}
		}
	}
}

func testSnapshot(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	_, _, err := l.Credit(c, "o", 1_000, "pay")
	noErr(t, err)
	s := must(l.Snapshot(c, "o"))
	if s.Balance != 1_000 || s.Seq != 1 {
		t.Fatalf("snapshot %+v", s)
	}
	evs := []ledger.UsageEvent{event("o", 10, 0), event("o", 20, 1), event("other", 99, 2)}
	noErr(t, l.RecordUsage(c, evs))
	s = must(l.Snapshot(c, "o"))
	if s.Balance != 970 || s.Seq != 3 {
		t.Fatalf("snapshot after usage %+v; want the pending usage accounted first", s)
	}
	if a := account(t, l, "o"); a.Pending != 0 || a.LedgerSeq != 3 {
		t.Fatalf("account %+v", a)
	}
	// Only the org's own events are accounted.
	if n := must(l.AccountPending(c, 10)); n != 1 {
		t.Fatalf("AccountPending after snapshot = %d, want the other org's 1", n)
	}
	// With nothing pending, a snapshot writes nothing.
	s2 := must(l.Snapshot(c, "o"))
	if s2 != s {
		t.Fatalf("second snapshot %+v != %+v", s2, s)
	}
	checkLedger(t, l, "o")
}

func testEntriesAfter(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	for i := range 5 {
		_, _, err := l.Credit(c, "o", int64(i+1), fmt.Sprint("r", i))
		noErr(t, err)
	}
	es, _, err := l.EntriesAfter(c, "o", 2, 2)
	noErr(t, err)
	if want := []balance.Entry{{Seq: 3, Delta: 3}, {Seq: 4, Delta: 4}}; !slices.Equal(es, want) {
		t.Fatalf("EntriesAfter(2, 2) = %v, want %v", es, want)
	}
	es, _, err = l.EntriesAfter(c, "o", 5, 10)
	if err != nil || len(es) != 0 {
		t.Fatalf("EntriesAfter(5) = %v, %v", es, err)
	}
	es, _, err = l.EntriesAfter(c, "o", -3, 0) // limit ≤ 0: a default limit
	if err != nil || len(es) != 5 {
		t.Fatalf("EntriesAfter(-3, 0) = %v, %v", es, err)
	}
}

func testSettle(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	noErr(t, l.CreateOrg(c, "quiet"))
	for i := range 4 {
		_, _, err := l.Credit(c, "o", 10, fmt.Sprint("r", i))
		noErr(t, err)
	}
	orgs := must(l.OrgsToSettle(c, 10))
	if !slices.Equal(orgs, []string{"o"}) {
		t.Fatalf("OrgsToSettle = %v, want [o]", orgs)
	}
	es, ep, err := l.UnsettledEntries(c, "o", 3)
	noErr(t, err)
	if len(es) != 3 || es[0].Seq != 1 || ep.IsZero() {
		t.Fatalf("UnsettledEntries = %v %v", es, ep)
	}
	noErr(t, l.MarkSettled(c, "o", 3))
	noErr(t, l.MarkSettled(c, "o", 1)) // never lowers
	if a := account(t, l, "o"); a.SettledSeq != 3 {
		t.Fatalf("settled_seq = %d, want 3", a.SettledSeq)
	}
	es, _, err = l.UnsettledEntries(c, "o", 10)
	if err != nil || len(es) != 1 || es[0].Seq != 4 {
		t.Fatalf("UnsettledEntries after 3 = %v, %v", es, err)
	}
	noErr(t, l.MarkSettled(c, "o", 99)) // capped at ledger_seq
	if a := account(t, l, "o"); a.SettledSeq != 4 {
		t.Fatalf("settled_seq = %d, want 4 (capped at ledger_seq)", a.SettledSeq)
	}
	if orgs := must(l.OrgsToSettle(c, 10)); len(orgs) != 0 {
		t.Fatalf("OrgsToSettle when all settled = %v", orgs)
	}
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("quiet", 1, 0)}))
	if orgs := must(l.OrgsToSettle(c, 10)); !slices.Equal(orgs, []string{"quiet"}) {
		t.Fatalf("OrgsToSettle with pending usage = %v, want [quiet]", orgs)
	}
}

func testUnsettledUsage(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	settled, accounted, pending, other := event("o", 1, 0), event("o", 2, 1), event("o", 3, 2), event("x", 4, 3)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{settled, accounted}))
	must(l.AccountPending(c, 10))
	noErr(t, l.MarkSettled(c, "o", 1))
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{pending, other}))
	unknown := NewEventID()
	got := must(l.UnsettledUsage(c, "o", []string{settled.ID, accounted.ID, pending.ID, other.ID, unknown, "not-a-uuid"}))
	want := map[string]bool{settled.ID: false, accounted.ID: true, pending.ID: true, other.ID: false, unknown: false, "not-a-uuid": false}
	for id, w := range want {
		if got[id] != w {
			t.Fatalf("UnsettledUsage[%s] = %v, want %v (all: %v)", id, got[id], w, got)
		}
	}
	if got := must(l.UnsettledUsage(c, "o", nil)); len(got) != 0 {
		t.Fatalf("UnsettledUsage(nil) = %v", got)
	}
}

// testRecordQuiet: a ledger that is a QuietUsageStore stores usage with RecordUsageQuiet like
// RecordUsage (pending, idempotent by id, accounted by the next pass) but notifies no one: a
// credit written after it is the first notification its subscriber gets.
func testRecordQuiet(t *testing.T, l ledger.Ledger) {
	q, ok := l.(ledger.QuietUsageStore)
	if !ok { // both of escrow's ledgers are: a Recorder with a Wake relies on it
		t.Fatalf("%T is not a QuietUsageStore", l)
	}
	c := ctx(t)
	sctx, cancel := context.WithCancel(c)
	defer cancel()
	ch := must(l.Subscribe(sctx))
	noErr(t, l.CreateOrg(c, "o"))
	listening(t, l, ch)
	ev := event("q", 7, 0)
	noErr(t, q.RecordUsageQuiet(c, []ledger.UsageEvent{ev, event("q", 3, 1)}))
	noErr(t, q.RecordUsageQuiet(c, []ledger.UsageEvent{ev})) // stored already: ignored
	_, _, err := l.Credit(c, "o", 5, "r")
	noErr(t, err)
	for first := true; first; {
		select {
		case got := <-ch:
			if got == listenProbe { // a late one of the probe's, committed before
				continue
			}
			first = false
			// Both ledgers deliver in commit order: a notification of the usage would come first.
			if got != "o" {
				t.Fatalf("first notification for %q, want the credit's (o): the quiet usage notified", got)
			}
		case <-time.After(waitLimit):
			t.Fatal("no notification for the credit")
		}
	}
	if n := must(l.AccountPending(c, 10)); n != 2 {
		t.Fatalf("accounted %d quietly recorded events, want 2", n)
	}
}

// waitLimit bounds a wait for something that must happen: it only ends a test that would hang,
// so it is far above what a loaded machine (race detector, two cores, other packages compiling)
// takes. A wait returns as soon as its event comes.
const waitLimit = time.Minute

// listenProbe is the org whose credits tell that a subscription is listening.
const listenProbe = "listen-probe"

// listening returns once the subscription ch is in place (a LISTEN takes a moment on a
// Postgres ledger): it credits listenProbe until one of its notifications comes through. Later
// ones may still come: the caller skips them.
func listening(t *testing.T, l ledger.Ledger, ch <-chan string) {
	t.Helper()
	c := ctx(t)
	noErr(t, l.CreateOrg(c, listenProbe))
	deadline := time.After(waitLimit)
	for i := 0; ; i++ {
		_, _, err := l.Credit(c, listenProbe, 1, fmt.Sprintf("probe-%d", i))
		noErr(t, err)
		select {
		case got := <-ch:
			if got == listenProbe {
				return
			}
		case <-time.After(50 * time.Millisecond): // not yet listening, or slow: credit again
		case <-deadline:
			t.Fatal("the subscription never delivered a notification")
		}
	}
}

func testSubscribe(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	sctx, cancel := context.WithCancel(c)
	ch := must(l.Subscribe(sctx))
	noErr(t, l.CreateOrg(c, "o"))
	expect := func(what, org string) {
		t.Helper()
		deadline := time.After(waitLimit)
		for {
			select {
			case got, ok := <-ch:
				if !ok {
					t.Fatalf("%s: subscription closed", what)
				}
				if got == org {
					return
				}
			case <-deadline:
				t.Fatalf("%s: no notification for %s", what, org)
			}
		}
	}
	listening(t, l, ch)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("o", 1, 0)}))
	expect("RecordUsage", "o")
	_, _, err := l.Credit(c, "o", 5, "r")
	noErr(t, err)
	expect("Credit", "o")
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("p", 1, 0)}))
	must(l.AccountPending(c, 10))
	expect("AccountPending", "p")
	cancel()
	deadline := time.After(waitLimit)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("subscription not closed after its context ended")
		}
	}
}

func testModels(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	_, err := l.Model(c, "m")
	wantErr(t, err, ledger.ErrUnknownModel, "missing model")
	wantErr(t, l.RaiseMaxCost(c, "m", 5), ledger.ErrUnknownModel, "RaiseMaxCost of a missing model")
	m := ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 1_250_000, pricing.Output: 10_000_000, pricing.CacheWrite: 3_125_000, pricing.CacheWrite1h: 5_000_001},
		MaxInputTokens: 128_000, MaxOutputTokens: 16_384, MaxCost: 100, DefaultHold: 50_000}
	noErr(t, l.PutModel(c, m))
	noErr(t, l.PutModel(c, ledger.Model{Name: "a", DefaultHold: 1}))
	// A price left out is stored as not given (Prices.Price defaults it), not replaced; a class
	// with no column of its own (audio tokens, one image) is stored like the others.
	b := pricing.Prices{pricing.Input: 7, pricing.Output: 9, pricing.AudioOutput: 80, pricing.PerImage("1024x1024", "hd"): 80_000}
	noErr(t, l.PutModel(c, ledger.Model{Name: "b", Prices: b}))
	if got := must(l.Model(c, "b")); !maps.Equal(got.Prices, b) {
		t.Fatalf("Model b = %+v", got)
	}
	if got := must(l.Model(c, "m")); !reflect.DeepEqual(got, m) {
		t.Fatalf("Model = %+v, want %+v", got, m)
	}
	noErr(t, l.RaiseMaxCost(c, "m", 300))
	noErr(t, l.RaiseMaxCost(c, "m", 200)) // never lowers
	if got := must(l.Model(c, "m")); got.MaxCost != 300 {
		t.Fatalf("max cost %d, want 300", got.MaxCost)
	}
	wantErr(t, l.RaiseMaxCost(c, "m", -1), ledger.ErrInvalidAmount, "negative max cost")
	ms := must(l.Models(c))
	if len(ms) != 3 || ms[0].Name != "a" || ms[2].Name != "m" || ms[2].MaxCost != 300 || ms[2].Prices[pricing.CacheWrite1h] != 5_000_001 || ms[1].Prices[pricing.AudioOutput] != 80 {
		t.Fatalf("Models = %+v", ms)
	}
	// PutModel replaces the prices and limits, but never lowers the max cost below what the
	// ledger learned (issue 23: a repricing reset it to 0, and holds of requests escrow cannot
	// bound fell to the next cheap request's cost); a larger one given is kept.
	m.MaxCost = 10
	m.Prices = maps.Clone(m.Prices)
	m.Prices[pricing.Output] = 1
	delete(m.Prices, pricing.CacheWrite1h)
	noErr(t, l.PutModel(c, m))
	want := m
	want.MaxCost = 300
	if got := must(l.Model(c, "m")); !reflect.DeepEqual(got, want) {
		t.Fatalf("after replace: %+v, want %+v", got, want)
	}
	m.MaxCost = 400
	noErr(t, l.PutModel(c, m))
	if got := must(l.Model(c, "m")); got.MaxCost != 400 {
		t.Fatalf("after a replace with a larger max cost: %+v", got)
	}
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{pricing.Input: -1}}), ledger.ErrInvalidAmount, "negative price")
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{pricing.CacheWrite: -1}}), ledger.ErrInvalidAmount, "negative cache-write price")
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{pricing.CacheWrite: balance.MaxAmount + 1}}), ledger.ErrInvalidAmount, "huge cache-write price")
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{pricing.CacheWrite1h: -1}}), ledger.ErrInvalidAmount, "negative 1-hour cache-write price")
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{pricing.CacheWrite1h: balance.MaxAmount + 1}}), ledger.ErrInvalidAmount, "huge 1-hour cache-write price")
	wantErr(t, l.PutModel(c, ledger.Model{Name: "bad", Prices: pricing.Prices{"no_such_class": 1}}), ledger.ErrInvalidAmount, "unknown class")
	wantErr(t, l.PutModel(c, ledger.Model{Name: ""}), ledger.ErrInvalidAmount, "empty name")
}

func testKeys(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	_, _, err := l.CreateKey(c, "o")
	wantErr(t, err, ledger.ErrUnknownOrg, "CreateKey for a missing org")
	noErr(t, l.CreateOrg(c, "o"))
	k, secret, err := l.CreateKey(c, "o")
	noErr(t, err)
	k2, secret2, err := l.CreateKey(c, "o")
	noErr(t, err)
	if !strings.HasPrefix(secret, ledger.KeyPrefix) || len(secret) < 40 || secret == secret2 || k.ID == k2.ID || k.Org != "o" {
		t.Fatalf("keys %+v %q, %+v %q", k, secret, k2, secret2)
	}
	if got := must(l.LookupKey(c, secret)); !reflect.DeepEqual(got, k) {
		t.Fatalf("LookupKey = %+v, want %+v", got, k)
	}
	_, err = l.LookupKey(c, secret+"x")
	wantErr(t, err, ledger.ErrUnknownKey, "wrong secret")
	noErr(t, l.RevokeKey(c, k.ID))
	_, err = l.LookupKey(c, secret)
	wantErr(t, err, ledger.ErrUnknownKey, "revoked key")
	noErr(t, l.RevokeKey(c, k.ID)) // revoking twice is fine
	wantErr(t, l.RevokeKey(c, "key_nope"), ledger.ErrUnknownKey, "revoke missing key")
	if got := must(l.LookupKey(c, secret2)); !reflect.DeepEqual(got, k2) {
		t.Fatalf("other key after revoke: %+v", got)
	}
}

// testCacheWrite: a usage event's cache-write tokens (Anthropic's cache_creation_input_tokens)
// and its 1-hour ones (cache_creation.ephemeral_1h_input_tokens) are stored with it and read back
// unchanged, pending, accounted and voided.
func testCacheWrite(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "cw"))
	ev := event("cw", 10_050, 0)
	ev.Usage = pricing.Usage{Prompt: 7100, Completion: 50, Units: pricing.Units{pricing.CachedInput: 5000, pricing.CacheWrite1h: 1500, pricing.CacheWrite: 500}}
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	if r := must(l.Request(c, ev.ID)); !r.Usage.Equal(ev.Usage) || r.Status != ledger.RequestPending {
		t.Fatalf("pending request %+v, want usage %+v", r, ev.Usage)
	}
	if n := must(l.AccountPending(c, 10)); n != 1 {
		t.Fatalf("accounted %d events, want 1", n)
	}
	if r := must(l.Request(c, ev.ID)); !r.Usage.Equal(ev.Usage) || r.Status != ledger.RequestAccounted || r.Cost != 10_050 {
		t.Fatalf("accounted request %+v, want usage %+v", r, ev.Usage)
	}
	page := must(l.ListEntries(c, "cw", ledger.EntryQuery{}))
	if len(page.Data) != 1 || page.Data[0].Request == nil || !page.Data[0].Request.Usage.Equal(ev.Usage) {
		t.Fatalf("entries %+v, want one charge with usage %+v", page.Data, ev.Usage)
	}
	void := event("cw", 7, 1)
	void.Usage = void.Usage.With(pricing.CacheWrite, 22).With(pricing.CacheWrite1h, 11).With(pricing.AudioInput, 5)
	noErr(t, l.VoidUsage(c, void))
	if r := must(l.Request(c, void.ID)); !r.Usage.Equal(void.Usage) || r.Status != ledger.RequestVoided {
		t.Fatalf("voided request %+v, want usage %+v", r, void.Usage)
	}
}
