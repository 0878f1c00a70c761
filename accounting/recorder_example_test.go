package accounting_test

import (
	"context"
	"fmt"

	"github.com/llmescrow/escrow/accounting"
)

func ExampleRecorder() {
	ctx := context.Background()
	ledger := accounting.NewMemory()
	rec, err := accounting.NewRecorder(ledger, nil) // nil config: the defaults (batches of ≤ 500)
	if err != nil {
		panic(err)
	}
	rec.Start(ctx)
	defer rec.Stop(ctx) // writes whatever is still queued

	// Called by each request before its response's final bytes: returns once the event is durable.
	err = rec.Record(ctx, accounting.UsageEvent{
		ID: "0192f0c4-6c1e-7cde-8000-000000000001", Org: "acme", Model: "gpt-4o",
		Usage: accounting.Usage{Prompt: 10, Completion: 5}, Cost: 42, HoldAmount: 100,
	})
	fmt.Println("recorded:", err == nil)
	n, _ := ledger.AccountPending(ctx, 10)
	fmt.Println("accounted:", n)
	// Output:
	// recorded: true
	// accounted: 1
}
