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
// replica acknowledged it, and a re-sent one (DUP) not at all. With the replica stopped (SIGSTOP: it acknowledges nothing) every
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
			// Two stores on the one Redis: s waits for a running replica as long as a loaded
			// machine takes (its bound only ends a hang), short (50 ms) for the stopped one,
			// which acknowledges nothing however long it is given: no reserve races a timeout.
			newStore := func(wait time.Duration) *balance.Store {
				s, err := balance.New(ctx, m.Client(), &balance.Config{Ledger: l, NoCoalesce: noCoalesce,
					WaitReplicas: 1, WaitTimeout: wait, MaxPipelines: 1})
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			s, short := newStore(hangLimit), newStore(50*time.Millisecond)
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "o", HoldID: "before", Amount: 10}); err != nil {
				t.Fatalf("reserve with the replica up: %v", err)
			}
			// A re-sent reserve (DUP) is refused: the write it found may have been made on
			// another connection, which its WAIT does not cover.
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "o", HoldID: "before", Amount: 10}); !errors.Is(err, balance.ErrNotReplicated) {
				t.Fatalf("re-sent reserve: %v, want ErrNotReplicated", err)
			}
			reserveAll := func(s *balance.Store, prefix string) []error {
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
			for i, err := range reserveAll(short, "paused") {
				if !errors.Is(err, balance.ErrNotReplicated) || !errors.Is(err, balance.ErrRedis) {
					t.Errorf("reserve %d with the replica stopped: %v, want ErrNotReplicated and ErrRedis", i, err)
				}
			}
			r.Resume()
			for i, err := range reserveAll(s, "resumed") {
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
	// A Cluster: the reserve and its WAIT go to the node of the org's slot; a stopped replica
	// refuses the holds of its master's orgs only.
	t.Run("Cluster", func(t *testing.T) {
		t.Parallel()
		cl := testutil.StartRedisCluster(t, testutil.ClusterReplicas(1))
		ctx := context.Background()
		l := balancetest.NewFakeLedger(1)
		prefix := testutil.RandomName("w")
		var orgs []string
		for i := range 12 {
			org := fmt.Sprintf("o%d", i)
			l.Add(org, 1_000_000, "")
			orgs = append(orgs, org)
		}
		// As above: a running replica is waited for as long as it takes, the stopped one 50 ms.
		newStore := func(wait time.Duration) *balance.Store {
			s, err := balance.New(ctx, cl.Client(), &balance.Config{Ledger: l, Prefix: prefix, WaitReplicas: 1, WaitTimeout: wait})
			if err != nil {
				t.Fatal(err)
			}
			return s
		}
		long, short := newStore(hangLimit), newStore(50*time.Millisecond)
		stopped := cl.Replicas[0][0]
		reserveAll := func(round string) map[string]error {
			errs := make([]error, len(orgs))
			var wg sync.WaitGroup
			for i, org := range orgs {
				s := long
				if round == "paused" && cl.ReplicaFor(balance.KeysOf(prefix, org).Holds) == stopped {
					s = short
				}
				wg.Go(func() {
					_, errs[i] = s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: round + "-" + org, Amount: 10})
				})
			}
			wg.Wait()
			m := map[string]error{}
			for i, org := range orgs {
				m[org] = errs[i]
			}
			return m
		}
		for org, err := range reserveAll("up") {
			if err != nil {
				t.Fatalf("reserve of %s with every replica up: %v", org, err)
			}
			k := balance.KeysOf(prefix, org)
			conn := cl.ReplicaFor(k.Holds).Client().Conn() // a Cluster replica answers reads after READONLY
			_ = conn.ReadOnly(ctx).Err()
			ok, err := conn.HExists(ctx, k.Holds, "up-"+org).Result()
			_ = conn.Close()
			if err != nil || !ok {
				t.Errorf("hold of %s granted but not on its master's replica: %v %v", org, ok, err)
			}
		}
		stopped.Pause()
		defer stopped.Resume()
		refused := 0
		for org, err := range reserveAll("paused") {
			onStopped := cl.ReplicaFor(balance.KeysOf(prefix, org).Holds) == stopped
			switch {
			case onStopped && errors.Is(err, balance.ErrNotReplicated):
				refused++
			case onStopped:
				t.Errorf("reserve of %s, whose master's replica is stopped: %v, want ErrNotReplicated", org, err)
			case err != nil:
				t.Errorf("reserve of %s, whose master's replica runs: %v", org, err)
			}
		}
		if refused == 0 {
			t.Error("no org on the master whose replica is stopped")
		}
	})
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
