package balance_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// pipeHook counts the pipelines a client sends, their commands, and the NOSCRIPT replies in them.
// Armed with flushAfter, it runs SCRIPT FLUSH right after the next lone EVALSHA, so that the
// reserves queued behind it meet NOSCRIPT in their pipeline.
type pipeHook struct {
	pipelines, cmds, noscript atomic.Int64
	flushAfter                atomic.Pointer[redis.Client]
}

func (h *pipeHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *pipeHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cmd.Name() == "evalsha" {
			if c := h.flushAfter.Swap(nil); c != nil {
				_ = c.ScriptFlush(ctx).Err()
			}
		}
		return err
	}
}
func (h *pipeHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.pipelines.Add(1)
		h.cmds.Add(int64(len(cmds)))
		for _, c := range cmds {
			if c.Err() != nil && len(c.Err().Error()) >= 8 && c.Err().Error()[:8] == "NOSCRIPT" {
				h.noscript.Add(1)
			}
		}
		return err
	}
}

// coalesced returns a coalescing store on its own client (with a pipeline counter), a warm org
// with balance start, and its ledger double.
func coalesced(t *testing.T, env *testutil.RedisEnv, start int64, cfg balance.Config) (*balance.Store, *pipeHook, string, *balancetest.FakeLedger, *redis.Client) {
	t.Helper()
	// Tests here count exact outcomes: a reply that times out on a loaded machine (the race
	// detector, miniredis, a shared CI box) would read as a failure of the rule under test.
	c := ownClient(t, env, func(o *redis.Options) { o.ReadTimeout, o.WriteTimeout = 30*time.Second, 30*time.Second })
	h := &pipeHook{}
	c.AddHook(h)
	l := balancetest.NewFakeLedger(1)
	cfg.Ledger, cfg.Prefix, cfg.NoCoalesce = l, env.Prefix, false
	cfg.MaxInFlight = 100_000
	s, err := balance.New(context.Background(), c, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	org := testutil.RandomName("co")
	l.Add(org, start, "")
	if err := s.Warm(context.Background(), org); err != nil {
		t.Fatal(err)
	}
	return s, h, org, l, c
}

// TestCoalescedReplies: reserves that go together in pipelines each get their own reply: a
// duplicate id answers Duplicate once, a released id GONE, a hold past the balance INSUFFICIENT,
// the rest OK; and the balance is exactly what the granted holds left.
func TestCoalescedReplies(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		ctx := context.Background()
		const requests, hold, fit = 600, 1000, 400
		s, h, org, _, _ := coalesced(t, env, fit*hold, balance.Config{MaxPipelines: 1})
		// 20 ids are released first: their reserves meet the tombstone.
		for i := range 20 {
			if _, err := s.Release(ctx, org, fmt.Sprintf("gone-%d", i)); err != nil {
				t.Fatal(err)
			}
		}
		var ok, dup, gone, short atomic.Int64
		var wg sync.WaitGroup
		gate := make(chan struct{})
		do := func(id string) {
			<-gate
			r, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: hold})
			switch {
			case err == nil && r.Duplicate:
				dup.Add(1)
			case err == nil:
				ok.Add(1)
			case errors.Is(err, balance.ErrGone):
				gone.Add(1)
			case errors.Is(err, balance.ErrInsufficient):
				short.Add(1)
			default:
				t.Errorf("reserve %s: %v", id, err)
			}
		}
		for i := range requests {
			wg.Go(func() { do(fmt.Sprintf("h-%d", i)) })
		}
		for i := range 20 {
			wg.Go(func() { do(fmt.Sprintf("gone-%d", i)) })
		}
		for i := range 10 { // the same id twice: one hold, one duplicate
			wg.Go(func() { do(fmt.Sprintf("h-%d", i)) })
		}
		close(gate)
		wg.Wait()
		// Of the 610 calls on h-*, 600 distinct ids: 400 fit. A duplicate of a granted id says
		// Duplicate; a duplicate of a refused one is refused again.
		if gone.Load() != 20 {
			t.Fatalf("gone %d, want 20", gone.Load())
		}
		if ok.Load() != fit || ok.Load()+dup.Load()+short.Load() != requests+10 {
			t.Fatalf("ok %d dup %d insufficient %d", ok.Load(), dup.Load(), short.Load())
		}
		st, err := s.State(ctx, org)
		if err != nil {
			t.Fatal(err)
		}
		if st.Balance != 0 || st.Holds != fit || st.Held != fit*hold {
			t.Fatalf("state %+v", st)
		}
		if h.pipelines.Load() == 0 {
			t.Fatal("no reserve went in a pipeline")
		}
		t.Logf("%d pipelines, %d commands", h.pipelines.Load(), h.cmds.Load())
	})
}

// TestCoalescedCancel: callers whose context ends while they wait in the queue leave without a
// hold (or with one that was already sent, like any timed-out reserve); nobody else is stuck.
func TestCoalescedCancel(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		s, _, org, _, _ := coalesced(t, env, balance.MaxAmount, balance.Config{MaxPipelines: 1, MaxBatch: 4})
		var wg sync.WaitGroup
		var ok, canceled atomic.Int64
		for i := range 400 {
			wg.Go(func() {
				ctx := context.Background()
				if i%3 == 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, time.Duration(i%7)*50*time.Microsecond)
					defer cancel()
				}
				_, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("c-%d", i), Amount: 1})
				switch {
				case err == nil:
					ok.Add(1)
				case ctx.Err() != nil:
					// Its deadline passed: context.DeadlineExceeded from the queue, or the
					// client's i/o timeout when it was on the wire.
					canceled.Add(1)
				default:
					t.Errorf("reserve: %v", err)
				}
			})
		}
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatal("reserves stuck")
		}
		// The store still works, alone and in batches.
		for i := range 50 {
			wg.Go(func() {
				if _, err := s.Reserve(context.Background(), balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("after-%d", i), Amount: 1}); err != nil {
					t.Errorf("reserve after cancellations: %v", err)
				}
			})
		}
		wg.Wait()
		st, _ := s.State(context.Background(), org)
		// Every granted reserve holds; a cancelled one may hold too (it may have been sent).
		if int64(st.Holds) < ok.Load()+50 || int64(st.Holds) > 450 {
			t.Fatalf("holds %d, granted %d, cancelled %d", st.Holds, ok.Load(), canceled.Load())
		}
		t.Logf("granted %d, cancelled %d, holds %d", ok.Load(), canceled.Load(), st.Holds)
	})
}

// TestCoalescedNoScript: after the server forgets its scripts, pipelined reserves meet NOSCRIPT;
// the scripts are loaded again and exactly those calls are sent again.
func TestCoalescedNoScript(t *testing.T) {
	t.Parallel()
	// SCRIPT FLUSH would disturb other tests on the shared server: miniredis and a private one.
	private := func(t *testing.T) *testutil.RedisEnv {
		if testutil.RealRedisURL() == "" {
			if testutil.RequireServices() {
				t.Fatal("ESCROW_REQUIRE_SERVICES=1 but ESCROW_TEST_REDIS_URL is not set")
			}
			t.Skip("a private redis-server is started only when real services are configured")
		}
		srv := testutil.StartRedisServer(t)
		return &testutil.RedisEnv{Client: srv.Client(), Prefix: testutil.RandomName("t"), URL: srv.URL()}
	}
	for name, mk := range map[string]func(*testing.T) *testutil.RedisEnv{"miniredis": func(t *testing.T) *testutil.RedisEnv { return testutil.MiniRedis(t) }, "private-redis": private} {
		t.Run(name, func(t *testing.T) { noScript(t, mk(t)) })
	}
}

func noScript(t *testing.T, env *testutil.RedisEnv) {
	{
		ctx := context.Background()
		s, h, org, _, c := coalesced(t, env, balance.MaxAmount, balance.Config{MaxPipelines: 1})
		for round := range 3 {
			h.flushAfter.Store(c)
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for i := range 100 {
				wg.Go(func() {
					<-gate
					if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: fmt.Sprintf("n-%d-%d", round, i), Amount: 1}); err != nil {
						t.Errorf("reserve: %v", err)
					}
				})
			}
			close(gate)
			wg.Wait()
		}
		st, _ := s.State(ctx, org)
		if st.Holds != 300 || st.Held != 300 {
			t.Fatalf("state %+v", st)
		}
		if h.noscript.Load() == 0 {
			t.Fatal("no pipeline met NOSCRIPT: the test did not test the reload")
		}
	}
}

// getCounter counts the GET commands a client sends (a pipeline with GETs counts as one:
// ModelState reads the learned max and the model's version in one). Once armed, the next GET
// waits until the stall channel is closed, whatever its context says: the read it belongs to
// stays in flight until the test lets it go.
type getCounter struct {
	gets  atomic.Int64
	mu    sync.Mutex
	stall chan struct{} // armed: the next GET waits for it to be closed
}

// arm makes the next GET wait until the returned channel is closed.
func (h *getCounter) arm() chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stall = make(chan struct{})
	return h.stall
}

func (h *getCounter) got() {
	h.gets.Add(1)
	h.mu.Lock()
	st := h.stall
	h.stall = nil
	h.mu.Unlock()
	if st != nil {
		<-st
	}
}

func (h *getCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *getCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return c.Name() == "get" }) {
			h.got()
		}
		return next(ctx, cmds)
	}
}
func (h *getCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "get" {
			h.got()
		}
		return next(ctx, cmd)
	}
}

// TestModelMaxOneGet: requests that find the learned max expired together share one GET (the
// hot path stays at one round trip per request: the reserve). The cache lives 1 ns, so every
// caller finds the entry expired, and the first read of each round is held in the hook until
// all 200 callers have returned (each is served the expired value after modelMaxWait): every
// caller meets that read in flight, at any speed, so exactly one GET is sent; without the shared
// read each caller sends its own.
func TestModelMaxOneGet(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		ctx := context.Background()
		c := ownClient(t, env, nil)
		h := &getCounter{}
		c.AddHook(h)
		s, err := balance.New(ctx, c, &balance.Config{Prefix: env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
		if err != nil {
			t.Fatal(err)
		}
		for round := range 2 {
			want := int64(42 + round)
			if err := s.SetModelMax(ctx, "m", want); err != nil {
				t.Fatal(err)
			}
			// The cache holds want (and no read is in flight: a caller is served a read's
			// answer only once that read has left the group).
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
				if v, err := s.ModelMax(ctx, "m"); err == nil && v == want {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("round %d: ModelMax never read %d", round, want)
				}
			}
			before := h.gets.Load()
			stall := h.arm()
			var wg sync.WaitGroup
			gate := make(chan struct{})
			for range 200 {
				wg.Go(func() {
					<-gate
					if v, err := s.ModelMax(ctx, "m"); err != nil || v != want {
						t.Errorf("ModelMax = %d, %v, want %d", v, err, want)
					}
				})
			}
			close(gate)
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(time.Minute):
				close(stall)
				t.Fatalf("round %d: callers with an expired value waited for a stalled read", round)
			}
			n := h.gets.Load() - before
			close(stall)
			if n != 1 {
				t.Fatalf("round %d: %d GETs for 200 concurrent callers, want 1", round, n)
			}
		}
	})
}
