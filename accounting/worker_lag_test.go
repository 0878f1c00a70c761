package accounting_test

import (
	"context"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestSettleLag: every usage entry the worker settles is counted in its settle-lag histogram,
// measured from the usage event's created_at (an event recorded "long ago" shows up in a high
// bucket); a credit counts from its own entry time.
func TestSettleLag(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
		org := testutil.RandomName("lag")
		if err := l.CreateOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
		if _, _, err := w.Credit(ctx, org, 1_000_000, org+"-ref"); err != nil {
			t.Fatal(err)
		}
		if got := w.SettleLag(); got.Count != 1 || got.Counts[len(got.Counts)-1] != 0 {
			t.Fatalf("after one credit: %+v", got)
		}
		old := time.Now().Add(-3 * time.Second)
		var evs []ledger.UsageEvent
		for i := range 5 {
			at := time.Now()
			if i == 0 {
				at = old
			}
			id := newID()
			if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: 100}); err != nil {
				t.Fatal(err)
			}
			evs = append(evs, ledger.UsageEvent{ID: id, Org: org, Model: "m", Cost: 10, HoldAmount: 100, CreatedAt: at})
		}
		if err := l.RecordUsage(ctx, evs); err != nil {
			t.Fatal(err)
		}
		if err := w.Drain(ctx); err != nil {
			t.Fatal(err)
		}
		lag := w.SettleLag()
		if lag.Count != 6 || lag.Sum < 3*time.Second && isPostgres(l) {
			t.Fatalf("lag histogram %+v", lag)
		}
		if isPostgres(l) {
			// The event recorded 3 s ago lands in the (3 s, 5 s] bucket; the p99 says so.
			if q := lag.Quantile(0.99); q != 5*time.Second {
				t.Fatalf("p99 %v, want 5s (histogram %+v)", q, lag)
			}
		}
		if q := lag.Quantile(0.5); q > time.Second {
			t.Fatalf("p50 %v", q)
		}
	})
}

func isPostgres(l ledger.Ledger) bool {
	_, ok := l.(*pgledger.Ledger)
	return ok
}

func TestSettleLagQuantile(t *testing.T) {
	t.Parallel()
	var l accounting.SettleLag
	if l.Quantile(0.99) != 0 {
		t.Fatal("quantile of nothing")
	}
	l.Bounds = []time.Duration{time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond, time.Minute}
	l.Counts = make([]uint64, len(l.Bounds)+1)
	l.Counts[0], l.Counts[3], l.Counts[len(l.Counts)-1] = 90, 9, 1 // ≤1ms, (5ms,10ms], above all
	l.Count = 100
	for q, want := range map[float64]time.Duration{0.5: time.Millisecond, 0.9: time.Millisecond, 0.95: 10 * time.Millisecond, 0.99: 10 * time.Millisecond, 1: time.Minute} {
		if got := l.Quantile(q); got != want {
			t.Errorf("Quantile(%v) = %v, want %v", q, got, want)
		}
	}
}
