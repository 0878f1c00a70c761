package accounting_test

import (
	"context"
	"fmt"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

func ExampleRecorder() {
	ctx := context.Background()
	l := memledger.New()
	rec, err := accounting.NewRecorder(l, nil) // nil config: the defaults (batches of ≤ 500)
	if err != nil {
		panic(err)
	}
	rec.Start(ctx)
	defer rec.Stop(ctx) // writes whatever is still queued

	// Called by each request before its response's final bytes: returns once the event is durable.
	err = rec.Record(ctx, ledger.UsageEvent{
		ID: "0192f0c4-6c1e-7cde-8000-000000000001", Org: "acme", Model: "gpt-4o",
		Usage: pricing.Usage{Prompt: 10, Completion: 5}, Cost: 42, HoldAmount: 100,
	})
	fmt.Println("recorded:", err == nil)
	n, _ := l.AccountPending(ctx, 10)
	fmt.Println("accounted:", n)
	// Output:
	// recorded: true
	// accounted: 1
}
