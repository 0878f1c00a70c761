package balance_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestConformanceCluster runs the whole suite on a private 3-master Redis Cluster: miniredis
// never raises CROSSSLOT, so this is the proof that every script call stays in one slot. It runs
// again with every store coalescing (pipelines then span slots and nodes), and a concurrent
// burst over many orgs checks coalesced reserves across the masters.
func TestConformanceCluster(t *testing.T) {
	t.Parallel()
	c := testutil.StartRedisCluster(t)
	t.Run("direct", func(t *testing.T) {
		balancetest.Run(t, balancetest.Env{Client: c.Client(), Prefix: testutil.RandomName("t"), Real: true, NoCoalesce: true})
	})
	t.Run("coalesced", func(t *testing.T) {
		balancetest.Run(t, balancetest.Env{Client: c.Client(), Prefix: testutil.RandomName("t"), Real: true})
	})
	t.Run("coalesced-burst", func(t *testing.T) {
		ctx := context.Background()
		l := balancetest.NewFakeLedger(1)
		s, err := balance.New(ctx, c.Client(), &balance.Config{Ledger: l, Prefix: testutil.RandomName("t"), MaxPipelines: 1})
		if err != nil {
			t.Fatal(err)
		}
		const orgs, perOrg, fit = 30, 20, 15
		for i := range orgs {
			l.Add(fmt.Sprintf("o%d", i), fit*10, "")
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		granted := map[string]int{}
		gate := make(chan struct{})
		for i := range orgs * perOrg {
			wg.Go(func() {
				<-gate
				org := fmt.Sprintf("o%d", i%orgs)
				_, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("h%d", i), Amount: 10})
				switch {
				case err == nil:
					mu.Lock()
					granted[org]++
					mu.Unlock()
				case !errors.Is(err, balance.ErrInsufficient):
					t.Errorf("reserve: %v", err)
				}
			})
		}
		close(gate)
		wg.Wait()
		for i := range orgs {
			org := fmt.Sprintf("o%d", i)
			st, err := s.State(ctx, org)
			if err != nil {
				t.Fatal(err)
			}
			if granted[org] != fit || st.Balance != 0 || st.Holds != fit {
				t.Fatalf("%s: granted %d, state %+v; want %d holds and balance 0", org, granted[org], st, fit)
			}
		}
	})
}
