package balance_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/lua"
)

func envOf(e *testutil.RedisEnv) balancetest.Env {
	return balancetest.Env{Client: e.Client, Prefix: e.Prefix, Real: e.Real()}
}

// TestConformance runs every script rule on miniredis and on the real Redis.
func TestConformance(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		balancetest.Run(t, envOf(env))
	})
}

// TestConformanceUncoalesced runs the suite again with every store sending each reserve on its
// own (Config.NoCoalesce). That is a setting of the store, not a backend: it runs on one Redis,
// the real one when there is one, else miniredis (TestConformance covers every backend; a second
// miniredis run cost a minute of CPU under the race detector).
func TestConformanceUncoalesced(t *testing.T) {
	t.Parallel()
	e := envOf(testutil.Redis(t))
	e.NoCoalesce = true
	balancetest.Run(t, e)
}

// ownClient makes a client of the env's server with room for many goroutines.
func ownClient(t *testing.T, env *testutil.RedisEnv, tweak func(*redis.Options)) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	opt.PoolSize = 64
	opt.PoolTimeout = 60 * time.Second
	if tweak != nil {
		tweak(opt)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestBurst: 2,000 concurrent reserves on one org whose balance fits exactly N holds → exactly
// N succeed, the balance is never seen below zero, and after settling every hold with a random
// real cost the balance is start − Σ costs to the micro-unit.
// Coalesced (the default) the reserves go in pipelines, with the same outcome as one by one.
func TestBurst(t *testing.T) {
	t.Parallel()
	for _, coalesce := range []bool{false, true} {
		t.Run(fmt.Sprintf("coalesce=%v", coalesce), func(t *testing.T) {
			t.Parallel()
			testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) { burst(t, env, coalesce) })
		})
	}
}

func burst(t *testing.T, env *testutil.RedisEnv, coalesce bool) {
	{
		ctx := context.Background()
		// 2,000 reserves at once on miniredis (one goroutine, under the race detector) can take
		// seconds per call on a loaded machine: the client waits as long as it takes, so the
		// outcome counts reserves, never the machine's speed.
		c := ownClient(t, env, func(o *redis.Options) { o.ReadTimeout, o.WriteTimeout = time.Minute, time.Minute })
		l := balancetest.NewFakeLedger(1)
		s, err := balance.New(ctx, c, &balance.Config{Ledger: l, Prefix: env.Prefix, MaxInFlight: 5000, NoCoalesce: !coalesce, MaxBatch: 16})
		if err != nil {
			t.Fatal(err)
		}
		const (
			requests = 2000
			n        = 737
			hold     = 1_234_567
		)
		org := testutil.RandomName("burst")
		start := int64(n * hold)
		l.Add(org, start, "")
		if err := s.Warm(ctx, org); err != nil {
			t.Fatal(err)
		}

		stop := make(chan struct{})
		var samples, negative atomic.Int64
		var sampler sync.WaitGroup
		sampler.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				v, err := c.HGet(ctx, balance.KeysOf(env.Prefix, org).Acct, "bal").Int64()
				if err == nil {
					samples.Add(1)
					if v < 0 {
						negative.Add(1)
					}
				}
			}
		})

		var wg sync.WaitGroup
		var mu sync.Mutex
		var granted []string
		var insufficient atomic.Int64
		gate := make(chan struct{})
		for i := range requests {
			wg.Go(func() {
				<-gate
				id := fmt.Sprintf("burst-%04d", i)
				_, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: hold})
				switch {
				case err == nil:
					mu.Lock()
					granted = append(granted, id)
					mu.Unlock()
				case errors.Is(err, balance.ErrInsufficient):
					insufficient.Add(1)
				default:
					t.Errorf("reserve %s: %v", id, err)
				}
			})
		}
		close(gate)
		wg.Wait()
		close(stop)
		sampler.Wait()

		if len(granted) != n || insufficient.Load() != requests-n {
			t.Fatalf("granted %d, insufficient %d; want %d and %d", len(granted), insufficient.Load(), n, requests-n)
		}
		if negative.Load() != 0 || samples.Load() == 0 {
			t.Fatalf("sampler: %d samples, %d below zero", samples.Load(), negative.Load())
		}
		st, _ := s.State(ctx, org)
		if st.Balance != 0 || st.Held != start || st.Holds != n {
			t.Fatalf("after the burst: %+v", st)
		}

		// Settle every hold with a random real cost, in ledger order, in batches.
		rng := rand.New(rand.NewPCG(1, 2))
		var costs int64
		for _, id := range granted {
			cost := rng.Int64N(hold + 1)
			if rng.IntN(10) == 0 {
				cost = hold + rng.Int64N(1000) // sometimes more than the hold
			}
			costs += cost
			l.Add(org, -cost, id)
		}
		all := l.Entries(org, 1)
		for i := 0; i < len(all); i += 100 {
			batch := all[i:min(i+100, len(all))]
			statuses, err := s.Settle(ctx, org, l.CurrentEpoch(), batch)
			if err != nil {
				t.Fatal(err)
			}
			for _, st := range statuses {
				if st != balance.Applied {
					t.Fatalf("status %v", st)
				}
			}
		}
		st, _ = s.State(ctx, org)
		if st.Balance != start-costs || st.Holds != 0 || st.Held != 0 || st.Watermark != int64(n+1) {
			t.Fatalf("after settling: %+v; want balance %d", st, start-costs)
		}
	}
}

// TestDroppedReply: a reply lost after Redis ran the script (the client times out, and go-redis
// re-sends the command on a new connection) debits exactly once, for reserve and for settle.
func TestDroppedReply(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		ctx := context.Background()
		addr := strings.TrimPrefix(strings.TrimSuffix(env.URL, "/0"), "redis://")
		proxy := testutil.StartFaultProxy(t, addr)
		c := ownClient(t, env, func(o *redis.Options) {
			o.Addr = proxy.Addr()
			o.ReadTimeout = time.Second // the dropped reply costs one timeout; the re-sent call must not time out on a loaded machine
			o.MaxRetries = 3
			o.MinRetryBackoff = time.Millisecond
			o.MaxRetryBackoff = 5 * time.Millisecond
		})
		l := balancetest.NewFakeLedger(1)
		s, err := balance.New(ctx, c, &balance.Config{Ledger: l, Prefix: env.Prefix})
		if err != nil {
			t.Fatal(err)
		}
		org := testutil.RandomName("drop")
		l.Add(org, 1000, "")
		if err := s.Warm(ctx, org); err != nil {
			t.Fatal(err)
		}
		evalsha := func(b []byte) bool { return bytes.Contains(bytes.ToUpper(b), []byte("EVALSHA")) }

		proxy.DropRepliesIf(1, evalsha)
		r, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: "h1", Amount: 100})
		if err != nil {
			t.Fatalf("reserve through a lost reply: %v", err)
		}
		if proxy.Stats().DroppedReplies != 1 {
			t.Fatalf("no reply was dropped: %+v", proxy.Stats())
		}
		if !r.Duplicate || r.Balance != 900 {
			t.Fatalf("reservation %+v; want the re-sent call to meet its own hold (duplicate, 900)", r)
		}
		st, _ := s.State(ctx, org)
		if st.Balance != 900 || st.Held != 100 {
			t.Fatalf("debited more than once: %+v", st)
		}

		e := l.Add(org, -40, "h1")
		proxy.DropRepliesIf(1, evalsha)
		statuses, err := s.Settle(ctx, org, l.CurrentEpoch(), []balance.Entry{e})
		if err != nil {
			t.Fatalf("settle through a lost reply: %v", err)
		}
		if proxy.Stats().DroppedReplies != 2 {
			t.Fatalf("no reply was dropped: %+v", proxy.Stats())
		}
		if statuses[0] != balance.Already {
			t.Fatalf("re-sent settle answered %v, want already", statuses[0])
		}
		st, _ = s.State(ctx, org)
		if st.Balance != 960 || st.Held != 0 || st.Watermark != 2 {
			t.Fatalf("settled more than once: %+v", st)
		}
	})
}

// tagOf is the Redis Cluster hash tag rule: the part between the first '{' and the next '}'
// when non-empty, else the whole key.
func tagOf(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

type recordHook struct {
	mu    sync.Mutex
	calls [][]any
}

func (h *recordHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *recordHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if n := strings.ToLower(cmd.Name()); n == "evalsha" || n == "eval" {
			h.mu.Lock()
			h.calls = append(h.calls, cmd.Args())
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}
func (h *recordHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			if n := strings.ToLower(c.Name()); n == "evalsha" || n == "eval" {
				h.mu.Lock()
				h.calls = append(h.calls, c.Args())
				h.mu.Unlock()
			}
		}
		return next(ctx, cmds)
	}
}

// TestOneHashTagPerCall drives every script call site and asserts that the keys of each call
// share one hash tag (one Cluster slot), and that every script was called.
func TestOneHashTagPerCall(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	hook := &recordHook{}
	c := ownClient(t, env, nil)
	c.AddHook(hook)
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, c, &balance.Config{Ledger: l, Prefix: env.Prefix, HoldTTL: 10 * time.Millisecond, PinTTL: time.Second, ReapGrace: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	org := "acme"
	l.Add(org, 1000, "")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err = s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: "a", Amount: 10}) // cold → seed → catch-up → reserve
	must(err)
	_, err = s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: "b", Amount: 10})
	must(err)
	_, err = s.Extend(ctx, org, "a")
	must(err)
	_, err = s.Pin(ctx, org, "a")
	must(err)
	_, err = s.Unpin(ctx, org, "a")
	must(err)
	_, err = s.Finish(ctx, org, "b", 3)
	must(err)
	_, err = s.FinishBatch(ctx, []balance.Finish{{Org: org, HoldID: "b", Cost: 3}, {Org: "other", HoldID: "x", Cost: 1}}) // pipelined
	must(err)
	e := l.Add(org, -5, "a")
	_, err = s.Settle(ctx, org, l.CurrentEpoch(), []balance.Entry{e})
	must(err)
	_, err = s.Release(ctx, org, "zzz")
	must(err)
	time.Sleep(30 * time.Millisecond)
	_, err = s.Reap(ctx, org)
	must(err)
	_, err = s.State(ctx, org)
	must(err)
	_, err = s.RaiseModelMax(ctx, "gpt-{x}", 5, 0, 10)
	must(err)
	_, err = s.PushLimits(ctx, org, balance.Limits{Version: 1})
	must(err)
	done, err := s.UseModel(ctx, "gpt-{x}")
	must(err)
	done()
	_, err = s.ModelInFlight(ctx, "gpt-{x}")
	must(err)

	shas := map[string]bool{}
	hook.mu.Lock() // a background renewal of the model's use may still be appending
	calls := append([][]any(nil), hook.calls...)
	hook.mu.Unlock()
	for _, args := range calls {
		shas[fmt.Sprint(args[1])] = true
		nkeys, _ := strconv.Atoi(fmt.Sprint(args[2]))
		if nkeys == 0 {
			t.Fatalf("script call without keys: %v", args)
		}
		tag := tagOf(fmt.Sprint(args[3]))
		for _, k := range args[3 : 3+nkeys] {
			if tagOf(fmt.Sprint(k)) != tag {
				t.Fatalf("keys of one call span hash tags: %v", args[3:3+nkeys])
			}
		}
	}
	files, err := fs.Glob(lua.FS, "*.lua")
	if err != nil || len(files) == 0 {
		t.Fatalf("embedded scripts: %v %v", files, err)
	}
	if len(shas) != len(files) {
		t.Fatalf("%d distinct scripts called, want all %d", len(shas), len(files))
	}
}

// TestNoScriptReload: after the server forgets its scripts (restart, failover), calls load them
// again and go through.
func TestNoScriptReload(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	l.Add("acme", 100, "")
	if err := env.Client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	r, err := s.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "a", Amount: 10})
	if err != nil || r.Balance != 90 {
		t.Fatalf("reserve after SCRIPT FLUSH: %+v %v", r, err)
	}
	if err := env.Client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Release(ctx, "acme", "a"); err != nil {
		t.Fatal(err)
	}
	// A pipelined finish (two orgs: two script calls in one pipeline) after a flush.
	l.Add("beta", 100, "")
	for _, org := range []string{"acme", "beta"} {
		if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: "f", Amount: 10}); err != nil {
			t.Fatal(err)
		}
	}
	if err := env.Client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	n, err := s.FinishBatch(ctx, []balance.Finish{{Org: "acme", HoldID: "f", Cost: 4}, {Org: "beta", HoldID: "f", Cost: 6}})
	if err != nil || n != 2 {
		t.Fatalf("pipelined finish after SCRIPT FLUSH: %d %v", n, err)
	}
	for org, want := range map[string]int64{"acme": 96, "beta": 94} {
		if st, err := s.State(ctx, org); err != nil || st.Balance != want || st.Finished != 1 {
			t.Fatalf("%s after finish: %+v %v, want balance %d", org, st, err, want)
		}
	}
}

// TestNoScriptRealRestart restarts a private redis-server (scripts and data gone) under a store.
func TestNoScriptRealRestart(t *testing.T) {
	t.Parallel()
	srv := testutil.StartRedisServer(t)
	c := srv.Client()
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, c, &balance.Config{Ledger: l})
	if err != nil {
		t.Fatal(err)
	}
	if len(balance.Warnings(s)) == 0 {
		t.Fatal("no warning for a server without AOF")
	}
	l.Add("acme", 100, "")
	if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "a", Amount: 10}); err != nil {
		t.Fatal(err)
	}
	srv.Restart()
	// Data and scripts are gone: the reserve reloads the scripts, reseeds, and goes through.
	r, err := s.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: "b", Amount: 10})
	if err != nil || r.Balance != 90 {
		t.Fatalf("reserve after restart: %+v %v", r, err)
	}
}

// TestRefusesEviction: a server that may evict keys is refused unless AllowEviction is set.
func TestRefusesEviction(t *testing.T) {
	t.Parallel()
	srv := testutil.StartRedisServer(t, testutil.RedisArgs("--maxmemory-policy", "allkeys-lru"))
	ctx := context.Background()
	if _, err := balance.New(ctx, srv.Client(), &balance.Config{}); !errors.Is(err, balance.ErrUnsupportedRedis) {
		t.Fatalf("got %v, want ErrUnsupportedRedis", err)
	}
	s, err := balance.New(ctx, srv.Client(), &balance.Config{AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, w := range balance.Warnings(s) {
		found = found || strings.Contains(w, "allkeys-lru")
	}
	if !found {
		t.Fatalf("no eviction warning: %q", balance.Warnings(s))
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	ctx := context.Background()
	for _, cfg := range []balance.Config{
		{HoldTTL: time.Hour, PinTTL: 2 * time.Hour},
		{Prefix: "a{b}"},
		{Prefix: "has space"},
		{MaxInFlight: -1},
	} {
		if _, err := balance.New(ctx, env.Client, &cfg); err == nil {
			t.Fatalf("config %+v accepted", cfg)
		}
	}
	if _, err := balance.New(ctx, nil, &balance.Config{}); err == nil {
		t.Fatal("nil client accepted")
	}
}

// TestConfigShape: a nil Config is every default; an unusable one is refused with an error
// wrapping ErrConfig, never corrected.
func TestConfigShape(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	ctx := context.Background()
	s, err := balance.New(ctx, env.Client, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := s.Config()
	if got.Prefix != balance.DefaultPrefix || got.HoldTTL != balance.DefaultHoldTTL || got.PinTTL != balance.DefaultPinTTL ||
		got.SettleDeadline != balance.DefaultHoldTTL || got.MaxInFlight != balance.DefaultMaxInFlight {
		t.Fatalf("nil config: %+v", got)
	}
	if s.PinRenewal() != balance.DefaultPinTTL/4 {
		t.Fatalf("pin renewal %v", s.PinRenewal())
	}
	for _, cfg := range []*balance.Config{
		{HoldTTL: time.Hour, PinTTL: 2 * time.Hour},
		{MaxInFlight: -1},
		{BatchWindow: 2 * time.Second},
		{SettleDeadline: 13 * time.Hour},
		{ScanPause: -time.Second},
	} {
		if _, err := balance.New(ctx, env.Client, cfg); !errors.Is(err, balance.ErrConfig) {
			t.Fatalf("config %+v: got %v, want ErrConfig", *cfg, err)
		}
	}
	if _, err := balance.New(ctx, nil, nil); !errors.Is(err, balance.ErrConfig) {
		t.Fatalf("nil client: %v, want ErrConfig", err)
	}
}

func TestValidOrg(t *testing.T) {
	t.Parallel()
	for org, want := range map[string]bool{
		"acme": true, "org_123-x.y": true, strings.Repeat("a", 128): true, "Org-2.x": true, "9": true,
		"": false, strings.Repeat("a", 129): false, "a{b": false, "a}b": false, "a:b": false,
		"a b": false, "a\nb": false, "é": false, "ÄÖ": false, "team/a": false, ".": false, "..": false,
		".hidden": false, "-flag": false, "_x": false, "a%2Fb": false, "a?b": false, "a#b": false, "a\\b": false,
	} {
		err := balance.ValidateOrg(org)
		if (err == nil) != want || (err != nil && (!errors.Is(err, balance.ErrInvalidOrg) || !strings.Contains(err.Error(), "A-Z, a-z, 0-9"))) {
			t.Errorf("ValidateOrg(%q) = %v; want valid=%v and an error that says what is allowed", org, err, want)
		}
	}
}
