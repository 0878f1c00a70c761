package accounting_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
)

// TestWorkerChargedHook: the running worker's account pass tells WorkerConfig.Charged which
// orgs it charged (auto top-up's seam), once the charges are written; a pass that charges
// nothing does not call it.
func TestWorkerChargedHook(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*waitLimit) // bounds a hang of the whole test
		defer cancel()
		store := newStore(t, env, l, balance.Config{})
		got := make(chan []string, 16)
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet, Charged: func(orgs []string) {
			got <- slices.Clone(orgs)
		}})
		for _, org := range []string{"acme", "idle"} {
			if err := l.CreateOrg(ctx, org); err != nil {
				t.Fatal(err)
			}
		}
		if n, err := w.AccountAll(ctx); err != nil || n != 0 {
			t.Fatalf("empty pass: %d %v", n, err)
		}
		select {
		case orgs := <-got:
			t.Fatalf("a pass that charged nothing called Charged with %v", orgs)
		default:
		}
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = w.Stop(context.Background()) }()
		ev := ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 7, HoldAmount: 7, CreatedAt: time.Now()}
		if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
		w.Wake()
		select {
		case orgs := <-got:
			if !slices.Equal(orgs, []string{"acme"}) {
				t.Fatalf("Charged(%v), want [acme]", orgs)
			}
			if a, err := l.Account(ctx, "acme"); err != nil || a.Balance != -7 {
				t.Fatalf("account when Charged ran: %+v %v (the charge must be written first)", a, err)
			}
		case <-ctx.Done():
			t.Fatal("Charged never called after a charge")
		}
	})
}
