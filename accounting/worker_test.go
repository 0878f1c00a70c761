package accounting_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// eachBackend runs fn on miniredis + the memory ledger and on real Redis + real Postgres.
func eachBackend(t *testing.T, fn func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger)) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		fn(t, testutil.MiniRedis(t), memledger.New())
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		fn(t, testutil.RealRedis(t), openTestPostgres(t))
	})
}

func newStore(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger, cfg balance.Config) *balance.Store {
	t.Helper()
	cfg.Ledger, cfg.Prefix, cfg.Logger = l, env.Prefix, quiet
	s, err := balance.New(context.Background(), env.Client, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// newWorker is accounting.NewWorker, failing the test on a config error.
func newWorker(t testing.TB, l ledger.Ledger, store *balance.Store, cfg *accounting.WorkerConfig) *accounting.Worker {
	t.Helper()
	w, err := accounting.NewWorker(l, store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func newID() string { return uuid.Must(uuid.NewV7()).String() }

// TestCreditUnblocks: an org at 0 is refused, a credit lands, and the very next reserve passes
// (no TTL, no cold path).
func TestCreditUnblocks(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
		if err := l.CreateOrg(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		_, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 100})
		var ie *balance.InsufficientError
		if !errors.As(err, &ie) || ie.Balance != 0 {
			t.Fatalf("reserve at 0: %v, want insufficient with balance 0", err)
		}
		e, created, err := w.Credit(ctx, "acme", 250, "pay_1")
		if err != nil || !created || e.Delta != 250 {
			t.Fatalf("credit: %+v %v %v", e, created, err)
		}
		st, err := store.State(ctx, "acme")
		if err != nil || !st.Exists || st.Balance != 250 {
			t.Fatalf("hot balance right after Credit: %+v %v, want 250", st, err)
		}
		r, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 100})
		if err != nil || r.Balance != 150 {
			t.Fatalf("reserve after credit: %+v %v", r, err)
		}
		// The same reference again: the original entry, no second credit.
		e2, created, err := w.Credit(ctx, "acme", 250, "pay_1")
		if err != nil || created || e2.Seq != e.Seq {
			t.Fatalf("repeated credit: %+v %v %v", e2, created, err)
		}
		if st, _ := store.State(ctx, "acme"); st.Balance != 150 {
			t.Fatalf("balance after repeated credit: %d, want 150", st.Balance)
		}
		if _, _, err := w.Credit(ctx, "acme", 999, "pay_1"); !errors.Is(err, ledger.ErrReferenceConflict) {
			t.Fatalf("same reference, other amount: %v", err)
		}
	})
}

// TestThreeWorkers runs three workers at once over one ledger and one Redis while requests
// record usage; every charge is applied exactly once and the hot balance ends equal to the ledger.
func TestThreeWorkers(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		orgs := []string{"o1", "o2", "o3", "o4"}
		const start = 1_000_000
		for _, o := range orgs {
			if err := l.CreateOrg(ctx, o); err != nil {
				t.Fatal(err)
			}
			if _, _, err := l.Credit(ctx, o, start, "init-"+o); err != nil {
				t.Fatal(err)
			}
		}
		var workers []*accounting.Worker
		for i := 0; i < 3; i++ {
			// Each worker has its own store (as if in its own process) on the same Redis.
			st := newStore(t, env, l, balance.Config{})
			w := newWorker(t, l, st, &accounting.WorkerConfig{Logger: quiet, SweepInterval: 20 * time.Millisecond, AccountBatch: 7, SettleBatch: 5})
			if err := w.Start(ctx); err != nil {
				t.Fatal(err)
			}
			workers = append(workers, w)
		}
		store := newStore(t, env, l, balance.Config{MaxInFlight: 10000})
		costs := map[string]int64{}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for g := 0; g < 8; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				for i := 0; i < 40; i++ {
					o := orgs[(g+i)%len(orgs)]
					id := newID()
					if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: 500}); err != nil {
						t.Error(err)
						return
					}
					cost := int64((g*41+i*7)%500 + 1)
					if err := l.RecordUsage(ctx, []ledger.UsageEvent{{ID: id, Org: o, Model: "m", Cost: cost, HoldAmount: 500, CreatedAt: time.Now()}}); err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					costs[o] += cost
					mu.Unlock()
				}
			}(g)
		}
		wg.Wait()
		deadline := time.Now().Add(waitLimit)
		for _, o := range orgs {
			for {
				st, err := store.State(ctx, o)
				acct, aerr := l.Account(ctx, o)
				if err == nil && aerr == nil && st.Holds == 0 && acct.Pending == 0 && st.Watermark == acct.LedgerSeq {
					if st.Balance != start-costs[o] || acct.Balance != start-costs[o] {
						t.Fatalf("org %s: redis %d, ledger %d, want %d", o, st.Balance, acct.Balance, start-costs[o])
					}
					if acct.LedgerSeq != 1+40*8/int64(len(orgs)) {
						t.Fatalf("org %s: ledger seq %d, want %d (one entry per request)", o, acct.LedgerSeq, 1+40*8/len(orgs))
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("org %s not settled: %+v %+v %v %v", o, st, acct, err, aerr)
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		for _, w := range workers {
			if err := w.Stop(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestReconcileRepairsDrift corrupts a hot balance and checks the reconciler finds the drift,
// drops the hot balance, and the reseed agrees with the ledger.
func TestReconcileRepairsDrift(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
		if err := l.CreateOrg(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := w.Credit(ctx, "acme", 1000, "c1"); err != nil {
			t.Fatal(err)
		}
		d, err := w.Reconcile(ctx, "acme")
		if err != nil || d.Drift != 0 || d.Repaired || !d.Warm {
			t.Fatalf("clean org: %+v %v", d, err)
		}
		// Somebody edits Redis by hand.
		if err := env.Client.HIncrBy(ctx, env.Prefix+":{acme}:acct", "bal", 37).Err(); err != nil {
			t.Fatal(err)
		}
		d, err = w.Reconcile(ctx, "acme")
		if err != nil || d.Drift != 37 || !d.Repaired {
			t.Fatalf("drifted org: %+v %v, want drift 37 repaired", d, err)
		}
		if w.Stats().DriftRepairs != 1 {
			t.Fatalf("repairs: %d", w.Stats().DriftRepairs)
		}
		if err := store.Warm(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		if st, _ := store.State(ctx, "acme"); st.Balance != 1000 {
			t.Fatalf("after repair: %d, want 1000", st.Balance)
		}
	})
}

// TestWorkerStopFlushes: usage recorded before Stop is accounted and settled when Stop returns.
func TestWorkerStopFlushes(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet, SweepInterval: time.Hour})
		if err := l.CreateOrg(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := w.Credit(ctx, "acme", 10_000, "c1"); err != nil {
			t.Fatal(err)
		}
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		var evs []ledger.UsageEvent
		for i := 0; i < 25; i++ {
			id := newID()
			if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 100}); err != nil {
				t.Fatal(err)
			}
			evs = append(evs, ledger.UsageEvent{ID: id, Org: "acme", Model: "m", Cost: int64(i), HoldAmount: 100, CreatedAt: time.Now()})
		}
		if err := l.RecordUsage(ctx, evs); err != nil {
			t.Fatal(err)
		}
		if err := w.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		st, _ := store.State(ctx, "acme")
		acct, _ := l.Account(ctx, "acme")
		want := int64(10_000 - 300) // Σ 0..24
		if st.Holds != 0 || st.Balance != want || acct.Balance != want || acct.SettledSeq != acct.LedgerSeq {
			t.Fatalf("after Stop: redis %+v, ledger %+v; want balance %d, everything settled", st, acct, want)
		}
	})
}

var _ = fmt.Sprint

// TestReconcileLoopVisitsIdleOrgs: the background reconciler visits warm orgs at rest (no
// holds), finds a hand-made drift and repairs it.
func TestReconcileLoopVisitsIdleOrgs(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet, ReconcileInterval: 30 * time.Millisecond})
		if err := l.CreateOrg(ctx, "idle"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := w.Credit(ctx, "idle", 700, "c1"); err != nil {
			t.Fatal(err)
		}
		if err := env.Client.HIncrBy(ctx, env.Prefix+":{idle}:acct", "bal", -5).Err(); err != nil {
			t.Fatal(err)
		}
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = w.Stop(ctx) }()
		deadline := time.Now().Add(waitLimit)
		for w.Stats().DriftRepairs == 0 {
			if time.Now().After(deadline) {
				t.Fatal("the reconciler never repaired the idle org's drift")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if got := w.Stats().LastDrift; got != -5 {
			t.Fatalf("drift %d, want -5", got)
		}
		if err := store.Warm(ctx, "idle"); err != nil {
			t.Fatal(err)
		}
		if st, _ := store.State(ctx, "idle"); st.Balance != 700 {
			t.Fatalf("after repair: %d, want 700", st.Balance)
		}
	})
}
