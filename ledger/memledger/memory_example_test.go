package memledger_test

import (
	"context"
	"fmt"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

// The ledger's life of one request: a credit, the usage recorded, accounted into a charge entry,
// and the entries the hot balance settles.
func ExampleNew() {
	ctx := context.Background()
	l := memledger.New() // or pgledger.Open(ctx, databaseURL, nil)
	defer l.Close()

	_ = l.CreateOrg(ctx, "acme")
	_, created, _ := l.Credit(ctx, "acme", 5_000_000, "invoice-42")
	_, again, _ := l.Credit(ctx, "acme", 5_000_000, "invoice-42") // same payment: no-op
	fmt.Println("credited:", created, "again:", again)

	_ = l.RecordUsage(ctx, []ledger.UsageEvent{{
		ID: "0192f0c4-6c1e-7cde-8000-00000000002a", Org: "acme", Model: "gpt-4o",
		Usage: pricing.Usage{Prompt: 1200, Completion: 300}, Cost: 6_000, HoldAmount: 50_000,
	}})
	n, _ := l.AccountPending(ctx, 100)
	entries, _, _ := l.UnsettledEntries(ctx, "acme", 10)
	acct, _ := l.Account(ctx, "acme")
	fmt.Println("accounted:", n)
	for _, e := range entries {
		fmt.Printf("seq %d delta %d hold %q\n", e.Seq, e.Delta, e.HoldID)
	}
	fmt.Println("balance:", acct.Balance)
	// Output:
	// credited: true again: false
	// accounted: 1
	// seq 1 delta 5000000 hold ""
	// seq 2 delta -6000 hold "0192f0c4-6c1e-7cde-8000-00000000002a"
	// balance: 4994000
}
