package balance_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
)

// A hold on a cold org: the store seeds it from the ledger, then reserves in one call. The
// request's real cost is settled later from the ledger; the rest of the hold comes back.
func ExampleStore_Reserve() {
	ctx := context.Background()
	mr, _ := miniredis.Run() // any Redis ≥ 6.0 (single node or Cluster)
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	ledger := balancetest.NewFakeLedger(1) // pgledger.Open / memledger.New in real use
	ledger.Add("acme", 5_000_000, "")      // a 5.00 credit, in micro-units

	store, err := balance.New(ctx, rdb, &balance.Config{Ledger: ledger})
	if err != nil {
		panic(err)
	}
	r, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "req-1", Amount: 2_000_000})
	fmt.Println(r.Balance, err)

	_, err = store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "req-2", Amount: 4_000_000})
	var short *balance.InsufficientError
	fmt.Println(errors.As(err, &short), short.Balance)

	// The request cost 0.75: the ledger records it, the worker settles it.
	entry := ledger.Add("acme", -750_000, "req-1")
	statuses, _ := store.Settle(ctx, "acme", ledger.CurrentEpoch(), []balance.Entry{entry})
	st, _ := store.State(ctx, "acme")
	fmt.Println(statuses[0], st.Balance, st.Holds)
	// Output:
	// 3000000 <nil>
	// true 3000000
	// applied 4250000 0
}

// Reserves that arrive while other round trips are in flight go to Redis together, as one
// pipeline (unless Config.NoCoalesce); each still gets its own answer.
func ExampleConfig_coalesce() {
	ctx := context.Background()
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	ledger := balancetest.NewFakeLedger(1)
	ledger.Add("acme", 1_000, "")

	store, err := balance.New(ctx, rdb, &balance.Config{Ledger: ledger, MaxPipelines: 1})
	if err != nil {
		panic(err)
	}
	var wg sync.WaitGroup
	var granted, refused atomic.Int64
	for i := range 50 { // 50 holds of 100 on a balance of 1,000: exactly 10 pass
		wg.Go(func() {
			_, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: fmt.Sprintf("req-%d", i), Amount: 100})
			if errors.Is(err, balance.ErrInsufficient) {
				refused.Add(1)
			} else if err == nil {
				granted.Add(1)
			}
		})
	}
	wg.Wait()
	st, _ := store.State(ctx, "acme")
	fmt.Println(granted.Load(), refused.Load(), st.Balance, st.Holds)
	// Output:
	// 10 40 0 10
}
