package balance_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// commandCalls reads the calls of one command (INFO commandstats: "script|load", "eval") since
// the server's last CONFIG RESETSTAT.
func commandCalls(t *testing.T, c *redis.Client, cmd string) int {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":calls="); ok {
			v, _, _ := strings.Cut(rest, ",")
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			return n
		}
	}
	return 0
}

// TestNoScriptOneLoad (issue 22 item 10): when a server has lost its scripts (a restart, a
// failover to a replica, SCRIPT FLUSH), the calls that meet NOSCRIPT together load them once:
// one round of SCRIPT LOADs for the server, not one per call (a failover once set off hundreds,
// on every master), and no call falls back to EVAL. Coalesced or not, every reserve is served.
func TestNoScriptOneLoad(t *testing.T) {
	t.Parallel()
	for _, noCoalesce := range []bool{true, false} {
		t.Run(fmt.Sprintf("NoCoalesce=%v", noCoalesce), func(t *testing.T) {
			t.Parallel()
			srv := testutil.StartRedisServer(t)
			c := srv.Client()
			ctx := context.Background()
			l := balancetest.NewFakeLedger(1)
			s, err := balance.New(ctx, c, &balance.Config{Ledger: l, NoCoalesce: noCoalesce})
			if err != nil {
				t.Fatal(err)
			}
			const orgs, calls = 20, 400
			for i := range orgs {
				org := fmt.Sprintf("o%d", i)
				l.Add(org, 1_000_000, "")
				if err := s.Warm(ctx, org); err != nil {
					t.Fatal(err)
				}
			}
			for _, cmd := range []string{"SCRIPT", "CONFIG"} {
				args := []any{cmd, "FLUSH"}
				if cmd == "CONFIG" {
					args = []any{cmd, "RESETSTAT"}
				}
				if err := c.Do(ctx, args...).Err(); err != nil {
					t.Fatal(err)
				}
			}
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for i := range calls {
				wg.Go(func() {
					<-gate
					req := balance.ReserveRequest{Org: fmt.Sprintf("o%d", i%orgs), HoldID: fmt.Sprintf("h%d", i), Amount: 10}
					if _, err := s.Reserve(ctx, req); err != nil {
						t.Errorf("reserve %d: %v", i, err)
					}
				})
			}
			close(gate)
			wg.Wait()
			if loads, evals := commandCalls(t, c, "script|load"), commandCalls(t, c, "eval"); loads != balance.ScriptCount() || evals != 0 {
				t.Fatalf("%d SCRIPT LOADs and %d EVALs for %d calls that met NOSCRIPT; want one round (%d) and none",
					loads, evals, calls, balance.ScriptCount())
			}
			// A server that loses them again gets them again.
			if err := c.ScriptFlush(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "o1", HoldID: "again", Amount: 10}); err != nil {
				t.Fatal(err)
			}
			if loads := commandCalls(t, c, "script|load"); loads != 2*balance.ScriptCount() {
				t.Fatalf("%d SCRIPT LOADs after a second flush; want two rounds", loads)
			}
		})
	}
}

// hangingGets makes GET calls hang until released (a node that died, a partition).
type hangingGets struct {
	on      chan struct{} // closed: GETs hang
	release chan struct{}
	once    sync.Once
}

func (h *hangingGets) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook hangs a pipeline with GETs (ModelState reads the learned max and the
// model's version in one) like a GET.
func (h *hangingGets) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "get" }) {
			select {
			case <-h.on:
				<-h.release
				return context.DeadlineExceeded
			default:
			}
		}
		return next(ctx, cmds)
	}
}
func (h *hangingGets) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "get" {
			select {
			case <-h.on:
				<-h.release
				return context.DeadlineExceeded
			default:
			}
		}
		return next(ctx, cmd)
	}
}

// TestModelMaxRefreshHangs (issue 22 item 10): every request reads its model's learned max; when
// the node of that key hangs (here: every GET hangs until released), a request that has a value
// (expired) is served it without waiting for the refresh, and a failed refresh keeps it; a
// model never read before still waits (within the caller's context).
func TestModelMaxRefreshHangs(t *testing.T) {
	t.Parallel()
	env := testutil.Redis(t)
	c := ownClient(t, env, nil)
	h := &hangingGets{on: make(chan struct{}), release: make(chan struct{})}
	c.AddHook(h)
	ctx := context.Background()
	const ttl = 50 * time.Millisecond
	s, err := balance.New(ctx, c, &balance.Config{Prefix: env.Prefix, ModelMaxCacheTTL: ttl, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetModelMax(ctx, "m", 42); err != nil {
		t.Fatal(err)
	}
	if v, err := s.ModelMax(ctx, "m"); err != nil || v != 42 {
		t.Fatalf("ModelMax = %d, %v", v, err)
	}
	time.Sleep(2 * ttl) // expired
	close(h.on)
	defer h.once.Do(func() { close(h.release) })
	for i := range 3 {
		got := make(chan int64, 1)
		go func() {
			v, _ := s.ModelMax(ctx, "m")
			got <- v
		}()
		select {
		case v := <-got:
			if v != 42 {
				t.Fatalf("read %d: ModelMax = %d while its refresh hangs, want the last value 42", i, v)
			}
		case <-time.After(hangLimit):
			t.Fatalf("read %d: ModelMax waits for a refresh that hangs", i)
		}
	}
	// A model never read: nothing to serve, so it waits, within the caller's context.
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if v, err := s.ModelMax(cctx, "other"); err == nil {
		t.Fatalf("ModelMax of an unread model while GETs hang: %d, want an error", v)
	}
	h.once.Do(func() { close(h.release) })
}

// TestCoalescePerMaster (issue 22 item 10): on a Cluster, reserves are coalesced per master, so
// the round trips stuck on a master that hangs (here: SIGSTOP) never take the pipeline slots of
// reserves for orgs on the other masters; and the recorder's finish shards (FinishShard) name
// each org's master.
func TestCoalescePerMaster(t *testing.T) {
	t.Parallel()
	// A node timeout far beyond the test: the paused master is never marked failed (with full
	// coverage required, the other masters would then refuse every key).
	cl := testutil.StartRedisCluster(t, testutil.ClusterServer(testutil.RedisArgs("--cluster-node-timeout", "600000")))
	ctx := context.Background()
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ReadTimeout: time.Minute, WriteTimeout: time.Minute})
	t.Cleanup(func() { _ = c.Close() })
	l := balancetest.NewFakeLedger(1)
	prefix := testutil.RandomName("t")
	// One pipeline slot per coalescer: a single stuck call takes it.
	s, err := balance.New(ctx, c, &balance.Config{Ledger: l, Prefix: prefix, MaxPipelines: 1})
	if err != nil {
		t.Fatal(err)
	}
	hung := cl.Nodes[0]
	var onHung, elsewhere []string
	for i := 0; len(onHung) < 3 || len(elsewhere) < 3; i++ {
		org := fmt.Sprintf("o%d", i)
		if cl.NodeFor(balance.KeysOf(prefix, org).Acct) == hung {
			onHung = append(onHung, org)
		} else {
			elsewhere = append(elsewhere, org)
		}
	}
	for _, org := range append(append([]string(nil), onHung...), elsewhere...) {
		l.Add(org, 1_000_000, "")
		if err := s.Warm(ctx, org); err != nil {
			t.Fatal(err)
		}
		if got, want := s.FinishShard(org), cl.NodeFor(balance.KeysOf(prefix, org).Holds).Addr(); got != want {
			t.Fatalf("FinishShard(%s) = %q, want its master %q", org, got, want)
		}
	}

	hung.Pause()
	var resume sync.Once
	t.Cleanup(func() { resume.Do(hung.Resume) })
	node, err := c.MasterForKey(ctx, balance.KeysOf(prefix, onHung[0]).Acct)
	if err != nil {
		t.Fatal(err)
	}
	busy := func() uint32 { st := node.PoolStats(); return st.TotalConns - st.IdleConns }
	before := busy()
	var wg sync.WaitGroup
	for i, org := range onHung {
		wg.Go(func() {
			// Served once the master is back (the test resumes it), or refused: either way not
			// before this test's healthy reserves are done.
			_, _ = s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("stuck%d", i), Amount: 10})
		})
	}
	// A reserve is on its way to the hung master (its connection taken).
	deadline := time.Now().Add(hangLimit)
	for busy() <= before {
		if time.Now().After(deadline) {
			t.Fatal("no call reached the hung master")
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i, org := range elsewhere {
		rctx, cancel := context.WithTimeout(ctx, hangLimit)
		_, err := s.Reserve(rctx, balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("ok%d", i), Amount: 10})
		cancel()
		if err != nil {
			t.Fatalf("reserve for %s (another master) while one master hangs: %v", org, err)
		}
	}
	resume.Do(hung.Resume)
	wg.Wait()
}
