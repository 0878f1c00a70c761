package balance_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
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

// keepAliveTTL is the hold lifetime of the keep-alive tests: short, yet long enough for a
// loaded machine running the race detector to extend in time.
const keepAliveTTL = time.Second

// hangLimit bounds a wait for something that must happen: it only ends a test that would hang,
// so it is far above what a loaded machine (race detector, two cores, other packages compiling)
// takes. A wait returns as soon as its event comes.
const hangLimit = time.Minute

// keepAliveStore makes a store with HoldTTL ttl (reaped right after expiry) on c and a warm org
// with a balance of 1,000,000.
func keepAliveStore(t *testing.T, env *testutil.RedisEnv, c redis.UniversalClient, ttl time.Duration) (*balance.Store, string) {
	t.Helper()
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, c, &balance.Config{Ledger: l, Prefix: env.Prefix, HoldTTL: ttl, PinTTL: time.Hour,
		ReapGrace: time.Millisecond, MaxInFlight: 10_000, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	org := testutil.RandomName("org")
	l.Add(org, 1_000_000, "")
	if err := s.Warm(ctx, org); err != nil {
		t.Fatal(err)
	}
	return s, org
}

func reserveN(t *testing.T, s *balance.Store, org string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if _, err := s.Reserve(context.Background(), balance.ReserveRequest{Org: org, HoldID: id, Amount: 10}); err != nil {
			t.Fatalf("reserve %s: %v", id, err)
		}
	}
}

// reap reaps the org until nothing is left to reap and returns how many holds it released.
func reap(t *testing.T, s *balance.Store, org string) int {
	t.Helper()
	total := 0
	for {
		n, err := s.Reap(context.Background(), org)
		if err != nil {
			t.Fatalf("reap: %v", err)
		}
		if n == 0 {
			return total
		}
		total += n
	}
}

// TestKeepAlive: a kept-alive hold outlives several HoldTTLs (a reaper finds nothing to
// release), a hold whose keep-alive was stopped expires and is reaped, and a stopped Lease is
// stopped for good. Each reap waits, on the Redis clock, until the expiry it tests has passed
// (never a sleep of a guessed length); the TTL leaves the keep-alive, which extends every TTL/3,
// more than a second of slack on a loaded machine.
func TestKeepAlive(t *testing.T) {
	t.Parallel()
	const ttl = 2 * time.Second
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		t.Parallel()
		ctx := context.Background()
		s, org := keepAliveStore(t, env, env.Client, ttl)
		reserveN(t, s, org, "kept", "stopped")
		hexp := balance.KeysOf(env.Prefix, org).Hexp
		expiry := func(id string) int64 {
			t.Helper()
			v, err := env.Client.ZScore(ctx, hexp, id).Result()
			if err != nil {
				t.Fatalf("expiry of %s: %v", id, err)
			}
			return int64(v)
		}
		// pastOnRedis waits until the Redis clock is past ms (by more than the reap grace).
		pastOnRedis := func(ms int64) {
			t.Helper()
			for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
				now, err := env.Client.Time(ctx).Result()
				if err == nil && now.UnixMilli() > ms+10 {
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("the Redis clock never passed %d: %v %v", ms, now, err)
				}
			}
		}
		lost := make(chan error, 2)
		kept, err := s.KeepAlive(org, "kept", func(err error) { lost <- err })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(kept.Stop)
		stopped, err := s.KeepAlive(org, "stopped", func(err error) { lost <- err })
		if err != nil {
			t.Fatal(err)
		}
		stopped.Stop()
		stopped.Stop() // twice is fine

		// Two TTLs past the reserve: the kept hold lives only if it was extended (at least
		// twice); the stopped one expired a TTL ago.
		pastOnRedis(expiry("stopped") + ttl.Milliseconds())
		if n := reap(t, s, org); n != 1 {
			t.Fatalf("reaped %d holds, want 1 (the stopped one)", n)
		}
		if st, err := s.State(ctx, org); err != nil || st.Holds != 1 {
			t.Fatalf("state %+v %v: want the kept hold alone", st, err)
		}
		kept.Stop()
		// Its last extension's expiry: nothing extends it now. An extension already sent when
		// Stop returned may still land (a loaded machine), so wait until the expiry read before
		// the wait is still the hold's after it.
		for {
			e := expiry("kept")
			pastOnRedis(e)
			if expiry("kept") == e {
				break
			}
		}
		if n := reap(t, s, org); n != 1 {
			t.Fatalf("reaped %d holds after the keep-alive stopped, want 1", n)
		}
		select {
		case err := <-lost:
			t.Fatalf("a lease was lost: %v", err)
		default:
		}
	})
}

// TestKeepAliveInvalid: KeepAlive takes the ids Reserve takes; a nil Lease stops.
func TestKeepAliveInvalid(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	s, org := keepAliveStore(t, env, env.Client, keepAliveTTL)
	if _, err := s.KeepAlive("{bad}", "a", nil); !errors.Is(err, balance.ErrInvalidOrg) {
		t.Fatalf("bad org: %v", err)
	}
	if _, err := s.KeepAlive(org, "", nil); !errors.Is(err, balance.ErrInvalidHoldID) {
		t.Fatalf("bad hold id: %v", err)
	}
	var l *balance.Lease
	l.Stop()
}

// TestKeepAliveLost: when Redis stops answering, the lease gives up once the hold could expire
// before the next try, and calls onLost once; Stop afterwards is fine.
func TestKeepAliveLost(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		t.Parallel()
		c := ownClient(t, env, nil)
		s, org := keepAliveStore(t, env, c, keepAliveTTL)
		reserveN(t, s, org, "a")
		var calls atomic.Int32
		lost := make(chan error, 1)
		start := time.Now()
		l, err := s.KeepAlive(org, "a", func(err error) { calls.Add(1); lost <- err })
		if err != nil {
			t.Fatal(err)
		}
		_ = c.Close() // every extension fails from now on
		select {
		case err := <-lost:
			if err == nil {
				t.Fatal("onLost got a nil error")
			}
			// Not at the first failure (HoldTTL/3): only once the next try would come after
			// the hold's expiry less the margin (HoldTTL/2 here; a loaded machine may be late).
			if d := time.Since(start); d < keepAliveTTL/2 { // later is fine: a loaded machine is late
				t.Fatalf("given up after %v, want about HoldTTL/2", d)
			}
		case <-time.After(hangLimit):
			t.Fatal("onLost never called")
		}
		l.Stop()
		time.Sleep(keepAliveTTL)
		if n := calls.Load(); n != 1 {
			t.Fatalf("onLost called %d times", n)
		}
	})
}

// extendHook counts the extend calls sent to Redis, per hold and in all, and the round trips
// they took.
type extendHook struct {
	sha        string
	calls      atomic.Int64
	roundTrips atomic.Int64

	mu     sync.Mutex
	perID  map[string]int // hold id (the script's ARGV[1]) → extensions sent
	minIDs []string       // the holds extensionsOfEach looks at
}

func (h *extendHook) isExtend(c redis.Cmder) bool {
	a := c.Args()
	return len(a) > 1 && strings.EqualFold(c.Name(), "evalsha") && fmt.Sprint(a[1]) == h.sha
}

// note counts one extend call: EVALSHA sha numkeys key… id ….
func (h *extendHook) note(c redis.Cmder) {
	a := c.Args()
	if len(a) < 3 {
		return
	}
	nk, err := strconv.Atoi(fmt.Sprint(a[2]))
	if err != nil || len(a) <= 3+nk {
		return
	}
	h.mu.Lock()
	if h.perID == nil {
		h.perID = map[string]int{}
	}
	h.perID[fmt.Sprint(a[3+nk])]++
	h.mu.Unlock()
}

// extensionsOf returns the extensions sent for each of ids.
func (h *extendHook) extensionsOf(ids []string) []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := make([]int, len(ids))
	for i, id := range ids {
		n[i] = h.perID[id]
	}
	return n
}

// extensionsOfEach returns the fewest extensions sent for any of ids.
func (h *extendHook) extensionsOfEach(ids []string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	least := -1
	for _, id := range ids {
		if n := h.perID[id]; least < 0 || n < least {
			least = n
		}
	}
	return least
}

func (h *extendHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *extendHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.isExtend(cmd) {
			h.calls.Add(1)
			h.roundTrips.Add(1)
			h.note(cmd)
		}
		return next(ctx, cmd)
	}
}
func (h *extendHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := int64(0)
		for _, c := range cmds {
			if h.isExtend(c) {
				n++
				h.note(c)
			}
		}
		if n > 0 {
			h.calls.Add(n)
			h.roundTrips.Add(1)
		}
		return next(ctx, cmds)
	}
}

// TestKeepAliveBatched: many holds kept alive at once, from many goroutines, are extended
// together, a pipeline for many holds, not a round trip each; all of them outlive HoldTTL and
// all of them expire once stopped.
//
// Time is the Redis clock, which every script reads (TIME): the test waits for events — each
// hold extended k times, then the Redis clock at T0 + k·HoldTTL/2 — never for a guessed
// length. On miniredis that clock is frozen at T0 and moved only by the test, so the outcome
// does not depend on the machine's speed at all; on a real Redis it runs, and a keeper late by
// more than 2/3 of HoldTTL (2 s here) would lose holds, as it would in production.
func TestKeepAliveBatched(t *testing.T) {
	t.Parallel()
	testutil.EachRedis(t, func(t *testing.T, env *testutil.RedisEnv) {
		t.Parallel()
		ctx := context.Background()
		// A pipeline of hundreds of scripts takes a while on miniredis under the race detector,
		// and each must answer within HoldTTL/6 (the keeper's timeout, on this process's clock):
		// a longer HoldTTL gives it time.
		const holds = 300
		ttl := 2 * keepAliveTTL
		if env.Mini != nil {
			ttl = 6 * keepAliveTTL
		}
		hook := &extendHook{sha: extendSHA(t, env)}
		c := ownClient(t, env, nil)
		c.AddHook(hook)
		s, org := keepAliveStore(t, env, c, ttl)
		ids := make([]string, holds)
		for i := range ids {
			ids[i] = fmt.Sprintf("h%03d", i)
		}
		reserveN(t, s, org, ids...)
		hexp := balance.KeysOf(env.Prefix, org).Hexp

		redisNow := func() int64 {
			t.Helper()
			now, err := env.Client.Time(ctx).Result()
			if err != nil {
				t.Fatalf("redis TIME: %v", err)
			}
			return now.UnixMilli()
		}
		// advanceTo gets the Redis clock past ms: miniredis is set there, a real Redis waited for.
		advanceTo := func(ms int64) {
			t.Helper()
			if env.Mini != nil {
				if ms > redisNow() {
					env.Mini.SetTime(time.UnixMilli(ms + 1))
				}
				return
			}
			for deadline := time.Now().Add(time.Minute); redisNow() <= ms; time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("the Redis clock never passed %d", ms)
				}
			}
		}
		// latestExpiry is the latest expiry of a hold still in hexp (0 when none is).
		latestExpiry := func() int64 {
			t.Helper()
			zs, err := env.Client.ZRangeWithScores(ctx, hexp, -1, -1).Result()
			if err != nil {
				t.Fatalf("hexp: %v", err)
			}
			if len(zs) == 0 {
				return 0
			}
			return int64(zs[0].Score)
		}

		t0 := redisNow() // every reserve's expiry is at most t0 + ttl
		if env.Mini != nil {
			env.Mini.SetTime(time.UnixMilli(t0))
		}
		leases := make([]*balance.Lease, holds)
		var wg sync.WaitGroup
		for i := range ids {
			wg.Go(func() {
				l, err := s.KeepAlive(org, ids[i], func(err error) { t.Errorf("lease %s lost: %v", ids[i], err) })
				if err != nil {
					t.Error(err)
				}
				leases[i] = l
			})
		}
		wg.Wait()
		stopAll := func() {
			for _, l := range leases {
				l.Stop()
			}
		}
		t.Cleanup(stopAll)

		// Three rounds: each hold extended k times, then the Redis clock at t0 + k·ttl/2. At
		// the end it is half a HoldTTL past every reserve's expiry: a hold not extended since
		// would be reaped.
		for k := 1; k <= 3; k++ {
			for deadline := time.Now().Add(time.Minute); hook.extensionsOfEach(ids) < k; time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("round %d: some hold extended only %d times", k, hook.extensionsOfEach(ids))
				}
			}
			advanceTo(t0 + int64(k)*ttl.Milliseconds()/2)
		}
		if n := reap(t, s, org); n != 0 {
			t.Fatalf("reaped %d kept-alive holds", n)
		}
		stopAll()
		calls, trips := hook.calls.Load(), hook.roundTrips.Load()
		t.Logf("%d extensions in %d round trips", calls, trips)
		if calls < 3*holds {
			t.Fatalf("%d extensions of %d holds in three rounds, want ≥ %d", calls, holds, 3*holds)
		}
		if trips*20 > calls {
			t.Fatalf("%d extensions took %d round trips: not batched", calls, trips)
		}
		// A stopped lease is extended no more (one extension already on its way may still be
		// sent): a control lease, kept alive after the others stopped, is extended twice — the
		// keeper has passed every stopped lease's due time since, in queue order.
		atStop := hook.extensionsOf(ids)
		reserveN(t, s, org, "control")
		control, err := s.KeepAlive(org, "control", nil)
		if err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(time.Minute); hook.extensionsOfEach([]string{"control"}) < 2; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the control lease was never extended twice")
			}
		}
		control.Stop()
		for i, n := range hook.extensionsOf(ids) {
			if n > atStop[i]+1 {
				t.Fatalf("hold %s extended %d times after its lease stopped", ids[i], n-atStop[i])
			}
		}
		// An extension already sent when its lease stopped may still land (Lease.Stop): move
		// the Redis clock past the latest expiry and reap, until every hold is gone.
		n := 0
		for deadline := time.Now().Add(time.Minute); n < holds+1; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("reaped %d holds after every keep-alive stopped, want %d", n, holds+1)
			}
			advanceTo(latestExpiry() + 10) // past the reap grace
			n += reap(t, s, org)
		}
		if n != holds+1 {
			t.Fatalf("reaped %d holds after every keep-alive stopped, want %d", n, holds+1)
		}
	})
}

// extendSHA is the SHA1 of the extend script, as EVALSHA names it.
func extendSHA(t *testing.T, env *testutil.RedisEnv) string {
	t.Helper()
	sha, err := env.Client.ScriptLoad(context.Background(), lua.Extend).Result()
	if err != nil {
		t.Fatal(err)
	}
	return sha
}

// afterFuncExtender is the keep-alive the middleware used to run per request, for comparison:
// a timer armed at every third of HoldTTL, stopped (and waited for) when the request ends.
type afterFuncExtender struct {
	mu      sync.Mutex
	t       *time.Timer
	stopped bool
	running sync.WaitGroup
}

func startAfterFunc(every time.Duration, extend func() error, onLost func(error)) *afterFuncExtender {
	e := &afterFuncExtender{}
	var tick func()
	tick = func() {
		defer e.running.Done()
		if err := extend(); err != nil {
			onLost(err)
			return
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		if !e.stopped {
			e.running.Add(1)
			e.t = time.AfterFunc(every, tick)
		}
	}
	e.mu.Lock()
	e.running.Add(1)
	e.t = time.AfterFunc(every, tick)
	e.mu.Unlock()
	return e
}

func (e *afterFuncExtender) stop() {
	e.mu.Lock()
	e.stopped = true
	if e.t != nil && e.t.Stop() {
		e.running.Done()
	}
	e.mu.Unlock()
	e.running.Wait()
}

// BenchmarkKeepAlive is the cost a request that ends before its first extension pays for its
// keep-alive: the store's (a queue slot) against a timer per request (the former extender),
// from one goroutine and from many.
func BenchmarkKeepAlive(b *testing.B) {
	env := testutil.MiniRedis(b)
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	s, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	every := s.Config().HoldTTL / 3
	extend := func() error { _, err := s.Extend(ctx, "acme", "h"); return err }
	cancel := func(error) {}
	store := func() {
		onLost := func(err error) { cancel(err) } // the middleware's closure, in both cases
		lease, err := s.KeepAlive("acme", "h", onLost)
		if err != nil {
			b.Fatal(err)
		}
		lease.Stop()
	}
	timer := func() {
		onLost := func(err error) { cancel(err) }
		startAfterFunc(every, extend, onLost).stop()
	}
	for _, bc := range []struct {
		name string
		f    func()
	}{{"store", store}, {"afterfunc", timer}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				bc.f()
			}
		})
		b.Run(bc.name+"/parallel", func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					bc.f()
				}
			})
		})
	}
}
