package pgledger_test

import (
	"context"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestPostgresBacklog: recorded usage counts as pending until accounted; entries count as
// unsettled until marked settled.
func TestPostgresBacklog(t *testing.T) {
	t.Parallel()
	l, _ := testutil.PostgresLedger(t)
	ctx := context.Background()
	check := func(when string, want pgledger.Backlog) {
		t.Helper()
		got, err := l.Backlog(ctx)
		if err != nil || got != want {
			t.Fatalf("%s: backlog %+v (%v), want %+v", when, got, err, want)
		}
	}
	check("empty", pgledger.Backlog{})
	if err := l.CreateOrg(ctx, "o"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, "o", 1000, "ref-backlog"); err != nil {
		t.Fatal(err)
	}
	check("after a credit", pgledger.Backlog{UnsettledEntries: 1})
	evs := []ledger.UsageEvent{
		{ID: ledgertest.NewEventID(), Org: "o", Model: "m", Cost: 5, HoldAmount: 10},
		{ID: ledgertest.NewEventID(), Org: "o", Model: "m", Cost: 7, HoldAmount: 10},
	}
	if err := l.RecordUsage(ctx, evs); err != nil {
		t.Fatal(err)
	}
	check("after two usage events", pgledger.Backlog{PendingEvents: 2, UnsettledEntries: 1})
	if n, err := l.AccountPending(ctx, 100); err != nil || n != 2 {
		t.Fatalf("accounted %d (%v), want 2", n, err)
	}
	check("after accounting", pgledger.Backlog{UnsettledEntries: 3})
	if err := l.MarkSettled(ctx, "o", 3); err != nil {
		t.Fatal(err)
	}
	check("after settling", pgledger.Backlog{})
}
