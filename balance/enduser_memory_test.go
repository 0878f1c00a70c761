package balance_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestEndUserCounterMemory measures what the end users of one limit of each end user apart cost
// Redis: the counter fields in u (MEMORY USAGE, exact: SAMPLES 0) after N
// distinct end users each made one request, reserved and settled through the scripts. It fails
// past 150 bytes an end user (DESIGN "Limits": the figure stated for a million end users a day).
// N is 20,000, or ESCROW_MEMORY_END_USERS (1,000,000 measured 104.4 bytes an end user, 104 MB).
func TestEndUserCounterMemory(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	n := 20_000
	if v, err := strconv.Atoi(os.Getenv("ESCROW_MEMORY_END_USERS")); err == nil && v > 0 {
		n = v
	}
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, MaxInFlight: 1 << 30, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	org := testutil.RandomName("mem")
	l.Add(org, balance.MaxAmount, "")
	l.SetLimits(org, balance.Limits{Version: 1, Limits: []balance.Limit{
		{ID: "lim_eu_day", Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Day, Cap: 1_000_000_000},
	}})
	if err := s.Warm(ctx, org); err != nil {
		t.Fatal(err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				id, eu := fmt.Sprintf("h%d", i), fmt.Sprintf("user-%08d@example.com", i)
				r, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: 2_000, EndUser: eu})
				if err == nil {
					e := l.AddCharge(org, balance.Entry{Delta: -1_234, HoldID: id, EndUser: eu, ReservedAt: r.ReservedAt})
					_, err = s.Settle(ctx, org, l.CurrentEpoch(), []balance.Entry{e})
				}
				if err != nil && !isGap(err) {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Concurrent settles may arrive out of order (GAP): re-send everything once, in order.
	if _, err := s.Settle(ctx, org, l.CurrentEpoch(), l.Entries(org, 0)); err != nil {
		t.Fatal(err)
	}
	k := balance.KeysOf(env.Prefix, org)
	if c, err := env.Client.HLen(ctx, k.U).Result(); err != nil || c != int64(n) {
		t.Fatalf("counters: %d %v, want %d", c, err, n)
	}
	bytes, err := env.Client.MemoryUsage(ctx, k.U, 0).Result()
	if err != nil {
		t.Fatalf("MEMORY USAGE: %v", err)
	}
	per := float64(bytes) / float64(n)
	t.Logf("%d end users: u = %d bytes, %.1f bytes an end user (a million: %.0f MB)", n, bytes, per, per)
	if per > 150 {
		t.Fatalf("%.1f bytes an end user, over the stated 150", per)
	}
}

func isGap(err error) bool {
	var g *balance.GapError
	return err != nil && errors.As(err, &g)
}
