package accounting_test

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
)

// watchedLedger records which orgs the worker reads unsettled entries of, counts the orgs
// AccountPass hands over, and runs during (after the inner call, before returning) each
// AccountPass, as a notification that arrives while the pass runs.
type watchedLedger struct {
	ledger.Ledger
	mu     sync.Mutex
	read   [][]string // the orgs of each UnsettledEntriesOf call, sorted
	handed atomic.Int64
	during func()
}

func (l *watchedLedger) UnsettledEntriesOf(ctx context.Context, orgs []string, limit int) (map[string][]balance.Entry, balance.Epoch, error) {
	l.mu.Lock()
	l.read = append(l.read, slices.Sorted(slices.Values(orgs)))
	l.mu.Unlock()
	return l.Ledger.UnsettledEntriesOf(ctx, orgs, limit)
}

func (l *watchedLedger) AccountPass(ctx context.Context, limit int) (ledger.AccountResult, error) {
	r, err := l.Ledger.AccountPass(ctx, limit)
	l.handed.Add(int64(len(r.Settle)))
	l.mu.Lock()
	during := l.during
	l.mu.Unlock()
	if during != nil {
		during()
	}
	return r, err
}

// reads returns the reads since the last call.
func (l *watchedLedger) reads() [][]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.read
	l.read = nil
	return r
}

// checkSettled fails unless each org's hot balance equals its ledger balance with no hold left
// and every entry is applied and marked settled.
func checkSettled(t *testing.T, store *balance.Store, l ledger.Ledger, orgs ...string) {
	t.Helper()
	ctx := context.Background()
	for _, o := range orgs {
		st, err := store.State(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		a, err := l.Account(ctx, o)
		if err != nil {
			t.Fatal(err)
		}
		if st.Holds != 0 || st.Balance != a.Balance || st.Watermark != a.LedgerSeq || a.SettledSeq != a.LedgerSeq || a.Pending != 0 {
			t.Fatalf("%s: redis %+v, ledger %+v; want agreement, all settled", o, st, a)
		}
	}
}

// TestPassSettlesHandedOver: a pass settles the orgs that were fully settled before it from
// the entries the account pass handed over, and reads back only the org that was behind; a
// cold org handed over is seeded on its own. A notification heard before the pass costs no
// read for a handed-over org; one heard during it (maybe the pass's own NOTIFY) is read back by
// the next pass.
func TestPassSettlesHandedOver(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, inner ledger.Ledger) {
		ctx := context.Background()
		l, store, w := cleanAndBehind(t, env, inner)
		var evs []ledger.UsageEvent
		for i, o := range []string{"clean", "behind", "clean", "fresh", "clean", "behind"} {
			id := newID()
			if o != "fresh" { // fresh: no account, no hot balance (a fail-open request)
				if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: 100}); err != nil {
					t.Fatal(err)
				}
			}
			evs = append(evs, ledger.UsageEvent{ID: id, Org: o, Model: "m", Cost: int64(10 + i), HoldAmount: 100, CreatedAt: time.Now()})
		}
		if err := l.RecordUsage(ctx, evs); err != nil {
			t.Fatal(err)
		}
		for _, o := range []string{"clean", "behind", "fresh"} { // the recorder's NOTIFY
			w.Notify(o)
		}
		l.reads()
		if err := w.Pass(ctx, false); err != nil {
			t.Fatal(err)
		}
		if got := l.reads(); len(got) != 1 || !slices.Equal(got[0], []string{"behind"}) {
			t.Fatalf("reads %v, want one of behind only", got)
		}
		if n := l.handed.Load(); n != 2 {
			t.Fatalf("%d orgs handed over, want 2 (clean, fresh)", n)
		}
		checkSettled(t, store, inner, "clean", "behind", "fresh")
		if s := w.Stats(); s.Settled != 8 || s.Seeds != 1 {
			t.Fatalf("stats %+v: want 8 entries settled (2 credits, 6 charges), fresh seeded", s)
		}

		// A notification heard during the pass, on an org it hands over: not read now, read
		// (finding nothing) by the next pass.
		if err := l.RecordUsage(ctx, []ledger.UsageEvent{{ID: newID(), Org: "clean", Model: "m", Cost: 7, CreatedAt: time.Now()}}); err != nil {
			t.Fatal(err)
		}
		l.during = func() { w.Notify("clean") }
		if err := w.Pass(ctx, false); err != nil {
			t.Fatal(err)
		}
		l.during = nil
		if got := l.reads(); len(got) != 0 {
			t.Fatalf("reads %v, want none", got)
		}
		checkSettled(t, store, inner, "clean")
		if err := w.Pass(ctx, false); err != nil {
			t.Fatal(err)
		}
		if got := l.reads(); len(got) != 1 || !slices.Equal(got[0], []string{"clean"}) {
			t.Fatalf("reads %v, want one of clean (the mark heard during the pass before)", got)
		}
	})
}

// cleanAndBehind returns a watched ledger over inner, a store and a worker, and two warm orgs
// with a credit of 1000 each: "clean", settled and marked, and "behind", in the hot balance (by
// a seed) but not marked settled in the ledger.
func cleanAndBehind(t *testing.T, env *testutil.RedisEnv, inner ledger.Ledger) (*watchedLedger, *balance.Store, *accounting.Worker) {
	ctx := context.Background()
	l := &watchedLedger{Ledger: inner}
	store := newStore(t, env, inner, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	for _, o := range []string{"clean", "behind"} {
		if err := l.CreateOrg(ctx, o); err != nil {
			t.Fatal(err)
		}
		if err := store.Warm(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := w.Credit(ctx, "clean", 1000, "c1"); err != nil { // settled at once
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, "behind", 1000, "c2"); err != nil {
		t.Fatal(err)
	}
	if err := store.Invalidate(ctx, "behind"); err != nil {
		t.Fatal(err)
	}
	if err := store.Warm(ctx, "behind"); err != nil {
		t.Fatal(err)
	}
	return l, store, w
}

// TestTwoWorkersPass runs two workers' passes at once over one ledger and one Redis (each with
// its own store, as in two processes) while requests reserve and record usage on a few orgs:
// both hand entries over, both may settle the same org, and every charge is applied once.
func TestTwoWorkersPass(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, inner ledger.Ledger) {
		ctx := context.Background()
		orgs := []string{"o1", "o2", "o3"}
		const start = 1_000_000
		for _, o := range orgs {
			if err := inner.CreateOrg(ctx, o); err != nil {
				t.Fatal(err)
			}
			if _, _, err := inner.Credit(ctx, o, start, "init-"+o); err != nil {
				t.Fatal(err)
			}
		}
		var ledgers []*watchedLedger
		var workers []*accounting.Worker
		for range 2 {
			l := &watchedLedger{Ledger: inner}
			st := newStore(t, env, inner, balance.Config{})
			ledgers = append(ledgers, l)
			workers = append(workers, newWorker(t, l, st, &accounting.WorkerConfig{Logger: quiet, AccountBatch: 5, SettleBatch: 4}))
		}
		if err := workers[0].Drain(ctx); err != nil {
			t.Fatal(err)
		}
		store := newStore(t, env, inner, balance.Config{MaxInFlight: 10000})
		var cost atomic.Int64
		done := make(chan struct{})
		var wg sync.WaitGroup
		for _, w := range workers {
			wg.Go(func() { passUntil(t, w, done) })
		}
		for i := range 300 {
			o := orgs[i%len(orgs)]
			id := newID()
			if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: 50}); err != nil {
				t.Fatal(err)
			}
			c := int64(i%37 + 1)
			if err := inner.RecordUsage(ctx, []ledger.UsageEvent{{ID: id, Org: o, Model: "m", Cost: c, HoldAmount: 50, CreatedAt: time.Now()}}); err != nil {
				t.Fatal(err)
			}
			cost.Add(c)
			if i%20 == 0 {
				time.Sleep(time.Millisecond) // let the passes catch up now and then
			}
		}
		close(done)
		wg.Wait()
		if err := workers[1].Drain(ctx); err != nil {
			t.Fatal(err)
		}
		checkSettled(t, store, inner, orgs...)
		var total int64
		for _, o := range orgs {
			a, _ := inner.Account(ctx, o)
			total += start - a.Balance
		}
		if total != cost.Load() {
			t.Fatalf("charged %d in all, want %d", total, cost.Load())
		}
		for i, l := range ledgers {
			if l.handed.Load() == 0 {
				t.Errorf("worker %d never had entries handed over", i)
			}
		}
	})
}

// passUntil runs w's passes back to back (every tenth a sweep) until done closes.
func passUntil(t *testing.T, w *accounting.Worker, done <-chan struct{}) {
	for i := 0; ; i++ {
		select {
		case <-done:
			return
		default:
		}
		if err := w.Pass(context.Background(), i%10 == 9); err != nil {
			t.Error(err)
			return
		}
	}
}
