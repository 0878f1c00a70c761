package memledger_test

import (
	"context"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/memledger"
)

func TestMemoryLedger(t *testing.T) {
	t.Parallel()
	ledgertest.Run(t, func(t *testing.T) ledger.Ledger {
		l := memledger.New()
		t.Cleanup(l.Close)
		return l
	})
}

func TestMemoryEpochIsNewEachTime(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	a, _ := memledger.New().Epoch(ctx)
	b, _ := memledger.New().Epoch(ctx)
	if a == b || a.IsZero() {
		t.Fatalf("two memory ledgers share epoch %v", a)
	}
}
