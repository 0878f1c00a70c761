package balance_test

import (
	"context"
	"fmt"
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
func (h *hangingGets) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
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
		case <-time.After(10 * time.Second):
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
