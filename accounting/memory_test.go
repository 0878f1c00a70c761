package accounting_test

import (
	"context"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/accounting/ledgertest"
)

func TestMemoryLedger(t *testing.T) {
	t.Parallel()
	ledgertest.Run(t, func(t *testing.T) accounting.Ledger {
		l := accounting.NewMemory()
		t.Cleanup(l.Close)
		return l
	})
}

func TestMemoryEpochIsNewEachTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, _ := accounting.NewMemory().Epoch(ctx)
	b, _ := accounting.NewMemory().Epoch(ctx)
	if a == b || a.IsZero() {
		t.Fatalf("two memory ledgers share epoch %v", a)
	}
}
