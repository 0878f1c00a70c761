package balance_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// startReplica makes r a replica of m and waits until it is in sync.
func startReplica(t *testing.T, m, r *testutil.RedisServer) {
	t.Helper()
	ctx := context.Background()
	if err := r.Client().ReplicaOf(ctx, "127.0.0.1", fmt.Sprint(m.Port())).Err(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err := m.Client().Info(ctx, "replication").Result()
		if err == nil && strings.Contains(info, "connected_slaves:1") && strings.Contains(info, "state=online") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %s never came online: %q %v", r.Addr(), info, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWaitReplicas (issue 34 item 7): with WaitReplicas a reserve is granted only once a
// replica acknowledged it. With the replica stopped (SIGSTOP: it acknowledges nothing) every
// reserve — alone or coalesced into pipelines — is refused with ErrNotReplicated, which wraps
// ErrRedis (so the middleware answers 503 and releases the hold); once it runs again, they pass,
// and every hold granted is on the replica.
func TestWaitReplicas(t *testing.T) {
	t.Parallel()
	for _, noCoalesce := range []bool{true, false} {
		t.Run(fmt.Sprintf("NoCoalesce=%v", noCoalesce), func(t *testing.T) {
			t.Parallel()
			m, r := testutil.StartRedisServer(t), testutil.StartRedisServer(t)
			startReplica(t, m, r)
			ctx := context.Background()
			l := balancetest.NewFakeLedger(1)
			l.Add("o", 1_000_000, "")
			s, err := balance.New(ctx, m.Client(), &balance.Config{Ledger: l, NoCoalesce: noCoalesce,
				WaitReplicas: 1, WaitTimeout: 50 * time.Millisecond, MaxPipelines: 1})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "o", HoldID: "before", Amount: 10}); err != nil {
				t.Fatalf("reserve with the replica up: %v", err)
			}
			reserveAll := func(prefix string) []error {
				errs := make([]error, 20)
				var wg sync.WaitGroup
				for i := range errs {
					wg.Go(func() {
						_, errs[i] = s.Reserve(ctx, balance.ReserveRequest{Org: "o", HoldID: fmt.Sprintf("%s%d", prefix, i), Amount: 10})
					})
				}
				wg.Wait()
				return errs
			}
			r.Pause()
			for i, err := range reserveAll("paused") {
				if !errors.Is(err, balance.ErrNotReplicated) || !errors.Is(err, balance.ErrRedis) {
					t.Errorf("reserve %d with the replica stopped: %v, want ErrNotReplicated and ErrRedis", i, err)
				}
			}
			r.Resume()
			for i, err := range reserveAll("resumed") {
				if err != nil {
					t.Errorf("reserve %d with the replica running again: %v", i, err)
				}
			}
			// Every hold granted is on the replica: the WAIT covered it.
			holds := balance.KeysOf(balance.DefaultPrefix, "o").Holds
			for _, id := range []string{"before", "resumed0", "resumed19"} {
				if ok, err := r.Client().HExists(ctx, holds, id).Result(); err != nil || !ok {
					t.Errorf("hold %s granted but not on the replica: %v %v", id, ok, err)
				}
			}
		})
	}
	// No replica at all: every reserve is refused.
	t.Run("NoReplica", func(t *testing.T) {
		t.Parallel()
		m := testutil.StartRedisServer(t)
		ctx := context.Background()
		l := balancetest.NewFakeLedger(1)
		l.Add("o", 1_000_000, "")
		s, err := balance.New(ctx, m.Client(), &balance.Config{Ledger: l, WaitReplicas: 1, WaitTimeout: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "o", HoldID: "h", Amount: 10}); !errors.Is(err, balance.ErrNotReplicated) {
			t.Fatalf("reserve with no replica: %v, want ErrNotReplicated", err)
		}
	})
}
