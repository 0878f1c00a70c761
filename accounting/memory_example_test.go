package accounting_test

import (
	"context"
	"fmt"

	"github.com/llmescrow/escrow/accounting"
)

// The ledger's life of one request: a credit, the usage recorded, accounted into a charge entry,
// and the entries the hot balance settles.
func ExampleNewMemory() {
	ctx := context.Background()
	ledger := accounting.NewMemory() // or accounting.OpenPostgres(ctx, databaseURL, nil)
	defer ledger.Close()

	_ = ledger.CreateOrg(ctx, "acme")
	_, created, _ := ledger.Credit(ctx, "acme", 5_000_000, "invoice-42")
	_, again, _ := ledger.Credit(ctx, "acme", 5_000_000, "invoice-42") // same payment: no-op
	fmt.Println("credited:", created, "again:", again)

	_ = ledger.RecordUsage(ctx, []accounting.UsageEvent{{
		ID: "0192f0c4-6c1e-7cde-8000-00000000002a", Org: "acme", Model: "gpt-4o",
		Usage: accounting.Usage{Prompt: 1200, Completion: 300}, Cost: 6_000, HoldAmount: 50_000,
	}})
	n, _ := ledger.AccountPending(ctx, 100)
	entries, _, _ := ledger.UnsettledEntries(ctx, "acme", 10)
	acct, _ := ledger.Account(ctx, "acme")
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
