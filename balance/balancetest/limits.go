package balancetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
)

// redisNow reads the Redis clock (the scripts' clock, before any ClockOffset).
func (x *h) redisNow() time.Time {
	x.t.Helper()
	t, err := x.env.Client.Time(x.ctx).Result()
	if err != nil {
		x.t.Fatalf("TIME: %v", err)
	}
	return t
}

// withClock returns a store on the same Redis, prefix and ledger whose limit clock reads at
// (give or take the test's own run time): a window rollover without a sleep.
func (x *h) withClock(at time.Time) *balance.Store {
	x.t.Helper()
	cfg := x.cfg
	cfg.ClockOffset = at.Sub(x.redisNow())
	s, err := x.env.newStore(x.ctx, &cfg)
	if err != nil {
		x.t.Fatalf("balance.New: %v", err)
	}
	return s
}

// reserveBefore reserves through a store whose limit clock reads just before edge (23:59:59.2
// for a midnight), and checks the reserve time is before edge: on a loaded machine the time
// from computing the offset to the reserve can pass the edge, so a miss is released and tried
// again with a fresh id (a test of the clock, never a sleep). It returns the hold id used.
func (x *h) reserveBefore(edge time.Time, id, key string, amount int64) (string, balance.Reservation) {
	x.t.Helper()
	for attempt := range 10 {
		hid := fmt.Sprintf("%s-%d", id, attempt)
		r, err := x.reserveKey(x.withClock(edge.Add(-800*time.Millisecond)), hid, key, amount)
		if errors.Is(err, balance.ErrLimit) {
			continue // past the edge already, in a window whose counter is full: nothing was held
		}
		if err != nil {
			x.t.Fatalf("reserve %s key %s %d: %v", hid, key, amount, err)
		}
		if r.ReservedAt.Before(edge) {
			return hid, r
		}
		if _, err := x.s.Release(x.ctx, x.org, hid); err != nil {
			x.t.Fatal(err)
		}
	}
	x.t.Fatalf("could not reserve before %v in 10 tries", edge)
	return "", balance.Reservation{}
}

// limited makes a warm org with lim (pushed before the first seed) and start on its balance.
func limited(t *testing.T, env Env, cfg balance.Config, start int64, lim balance.Limits) *h {
	t.Helper()
	x := fixture(t, env, cfg, start, false)
	x.l.SetLimits(x.org, lim)
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatalf("warm: %v", err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			x.counters()
		}
	})
	return x
}

func (x *h) reserveKey(s *balance.Store, id, key string, amount int64) (balance.Reservation, error) {
	return s.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: id, Amount: amount, KeyID: key})
}

func (x *h) mustReserveKey(s *balance.Store, id, key string, amount int64) balance.Reservation {
	x.t.Helper()
	r, err := x.reserveKey(s, id, key, amount)
	if err != nil {
		x.t.Fatalf("reserve %s key %s %d: %v", id, key, amount, err)
	}
	return r
}

// settleUsage records the usage of hold id (cost, attributed to key, its project in the ledger's
// map, and the reserve time r) and settles it through s.
func (x *h) settleUsage(s *balance.Store, id, key string, cost int64, at time.Time) balance.SettleStatus {
	x.t.Helper()
	e := x.l.AddUsage(x.org, cost, id, key, x.l.Limits(x.org).Projects[key], at)
	st, err := s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
	if err != nil {
		x.t.Fatalf("settle %s: %v", id, err)
	}
	x.counters()
	return st[0]
}

// field is a counter's field name.
func field(id string, start int64) string { return id + ":" + strconv.FormatInt(start, 10) }

// u reads the org's counters by field.
func (x *h) u() map[string]int64 {
	x.t.Helper()
	m, err := x.s.Counters(x.ctx, x.org)
	if err != nil {
		x.t.Fatalf("counters: %v", err)
	}
	out := map[string]int64{}
	for c, n := range m {
		f := field(c.LimitID, c.Start)
		if c.EndUser != "" {
			f += ":" + c.EndUser
		}
		out[f] = n
	}
	return out
}

// counters asserts the counter invariant (and the balance invariant) while acct exists: every
// counter of a current window (on the store's limit clock) is Σ cost of the entries attributed
// to it with seq ≤ wm plus the live holds whose record names it.
func (x *h) counters() {
	x.t.Helper()
	x.invariant()
	st := x.state()
	if !st.Exists {
		if n, err := x.env.Client.Exists(x.ctx, x.keys().U).Result(); err != nil || n != 0 {
			x.t.Fatalf("acct gone but u left: %d %v", n, err)
		}
		return
	}
	if n, err := x.env.Client.Exists(x.ctx, x.keys().Lim).Result(); err != nil || n != 1 {
		x.t.Fatalf("acct without lim: %d %v", n, err)
	}
	holds, err := x.env.Client.HGetAll(x.ctx, x.keys().Holds).Result()
	if err != nil {
		x.t.Fatal(err)
	}
	held := map[string]int64{} // what the live holds hold on each counter, in its unit
	for _, rec := range holds {
		parts := strings.Split(rec, "|")
		a, _ := strconv.ParseInt(parts[0], 10, 64)
		units, tokens := "", int64(0)
		if len(parts) >= 8 {
			units = parts[6]
			tokens, _ = strconv.ParseInt(parts[7], 10, 64)
		}
		if len(parts) >= 4 && parts[3] != "" {
			for i, f := range strings.Split(parts[3], ",") {
				switch {
				case i < len(units) && units[i] == 'r':
					held[f]++
				case i < len(units) && units[i] == 't':
					held[f] += tokens
				default:
					held[f] += a
				}
			}
		}
	}
	now, err := x.s.Now(x.ctx)
	if err != nil {
		x.t.Fatal(err)
	}
	u := x.u()
	acct, err := x.env.Client.HGetAll(x.ctx, x.keys().Acct).Result()
	if err != nil {
		x.t.Fatal(err)
	}
	_, lazy := acct["ll"]
	for _, lim := range x.l.Limits(x.org).Limits {
		start := lim.Window.StartMS(now)
		if eachEndUser(lim) {
			// One counter per end user: each one of the current window holds its end user's
			// entries and holds.
			head := field(lim.ID, start) + ":"
			fields := map[string]bool{}
			for f := range u {
				fields[f] = true
			}
			for f := range held {
				fields[f] = true // a field gone at zero while a hold still counts there reads 0
			}
			for f := range fields {
				eu, ok := strings.CutPrefix(f, head)
				if !ok {
					continue
				}
				got, ok := u[f]
				if _, partial := acct["p:"+f]; lazy && lim.Window == balance.Lifetime && (!ok || partial) {
					continue // not loaded, evicted, or a placeholder its ledger part is not in yet: the next request loads it
				}
				if want := x.l.UsedBy(x.org, lim.ID, start, eu, st.Watermark) + held[f]; got != want {
					x.t.Fatalf("counter invariant broken for %s: U = %d, ledger %d + holds %d",
						f, got, x.l.UsedBy(x.org, lim.ID, start, eu, st.Watermark), held[f])
				}
			}
			continue
		}
		f := field(lim.ID, start)
		got, ok := u[f]
		if !ok {
			continue // not created yet in this window (no reserve since the rollover)
		}
		if want := x.l.Used(x.org, lim.ID, start, st.Watermark) + held[f]; got != want {
			x.t.Fatalf("counter invariant broken for %s: U = %d, ledger %d + holds %d",
				f, got, x.l.Used(x.org, lim.ID, start, st.Watermark), held[f])
		}
	}
}

func orgLimit(id string, w balance.Window, cap int64) balance.Limit {
	return balance.Limit{ID: id, Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: w, Cap: cap}
}

func keyLimit(id, key string, w balance.Window, cap int64) balance.Limit {
	return balance.Limit{ID: id, Scope: balance.Scope{Kind: balance.ScopeKey, ID: key}, Window: w, Cap: cap}
}

func projLimit(id, p string, w balance.Window, cap int64) balance.Limit {
	return balance.Limit{ID: id, Scope: balance.Scope{Kind: balance.ScopeProject, ID: p}, Window: w, Cap: cap}
}

// runLimits is the conformance suite of DESIGN.md "Limits", one test per rule.
func runLimits(t *testing.T, env Env) {
	t.Run("LimitsScopeWindowCap", func(t *testing.T) { exerciseLimitsScopeWindowCap(t, env) })
	t.Run("LimitWritesNothing", func(t *testing.T) { exerciseLimitWritesNothing(t, env) })
	t.Run("ReserveOrder", func(t *testing.T) { exerciseReserveOrder(t, env) })
	t.Run("ColdWithoutCurrentLim", func(t *testing.T) { exerciseColdWithoutCurrentLim(t, env) })
	t.Run("ExistOrVanishTogether", func(t *testing.T) { exerciseExistOrVanishTogether(t, env) })
	t.Run("MovesKeepCounters", func(t *testing.T) { exerciseMovesKeepCounters(t, env) })
	t.Run("SeedAndAlready", func(t *testing.T) { exerciseSeedAndAlready(t, env) })
	t.Run("ChargedToTheDayItStarted", func(t *testing.T) { exerciseChargedToTheDayItStarted(t, env) })
	t.Run("FreezeAtOnce", func(t *testing.T) { exerciseFreezeAtOnce(t, env) })
	t.Run("PushFencesStaleSeed", func(t *testing.T) { exercisePushFencesStaleSeed(t, env) })
	t.Run("LowerCapBelowUsed", func(t *testing.T) { exerciseLowerCapBelowUsed(t, env) })
	t.Run("Calendar", func(t *testing.T) { exerciseCalendar(t, env) })
	t.Run("LimitsValidation", func(t *testing.T) { exerciseLimitsValidation(t, env) })
	t.Run("Burst2000KeyCap", func(t *testing.T) { exerciseBurst2000KeyCap(t, env) })
	t.Run("NewLimitCountsHoldsInFlight", func(t *testing.T) { exerciseNewLimitCountsHoldsInFlight(t, env) })
	t.Run("RequestsLimit", func(t *testing.T) { exerciseRequestsLimit(t, env) })
	t.Run("TokensLimit", func(t *testing.T) { exerciseTokensLimit(t, env) })
	t.Run("UnitsAllOrNothing", func(t *testing.T) { exerciseUnitsAllOrNothing(t, env) })
	t.Run("UnitsSeedRebuild", func(t *testing.T) { exerciseUnitsSeedRebuild(t, env) })
	t.Run("EndUsersEachApart", func(t *testing.T) { exerciseEndUsersEachApart(t, env) })
	t.Run("EndUserOverrideTighterHolds", func(t *testing.T) { exerciseEndUserOverride(t, env) })
	t.Run("EndUserMovesAndSeed", func(t *testing.T) { exerciseEndUserMovesAndSeed(t, env) })
	t.Run("NewEndUserLimitCountsHoldsInFlight", func(t *testing.T) { exerciseNewEndUserLimitCountsHolds(t, env) })
	t.Run("EndUserCountersTrimmed", func(t *testing.T) { exerciseEndUserCountersTrimmed(t, env) })
	t.Run("EndUserNothingLeftAtZero", func(t *testing.T) { exerciseEndUserNothingLeftAtZero(t, env) })
	t.Run("EndUserLifetimeLazy", func(t *testing.T) { exerciseEndUserLifetimeLazy(t, env) })
	t.Run("EndUserLifetimeEvicted", func(t *testing.T) { exerciseEndUserLifetimeEvicted(t, env) })
	t.Run("EndUserLifetimeEager", func(t *testing.T) { exerciseEndUserLifetimeEager(t, env) })
	t.Run("EndUserLifetimeBurst", func(t *testing.T) { exerciseEndUserLifetimeBurst(t, env) })
	t.Run("EndUserInvalid", func(t *testing.T) { exerciseEndUserInvalid(t, env) })
	t.Run("EndUserRequired", func(t *testing.T) { exerciseEndUserRequired(t, env) })
	t.Run("NewUnitLimitCountsHoldsInFlight", func(t *testing.T) { exerciseNewUnitLimitCountsHoldsInFlight(t, env) })
	t.Run("Burst2000RequestsPerMinute", func(t *testing.T) { exerciseBurst2000RequestsPerMinute(t, env) })
}

// "A new or changed limit counts the live holds its scope and window cover": limits created
// while holds are in flight (none existed at their reserve) count them from the reseed the push
// causes, finished holds at their cost; the holds' settle and release then move those counters.
func exerciseNewLimitCountsHoldsInFlight(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Projects: map[string]string{"k1": "p"}})
	var k1 []balance.Reservation
	for i := range 6 {
		k1 = append(k1, x.mustReserveKey(x.s, fmt.Sprintf("a%d", i), "k1", 2_110))
	}
	x.mustReserveKey(x.s, "b", "k2", 1_000)
	fin := x.mustReserveKey(x.s, "f", "k1", 2_110)
	if ok, err := x.s.Finish(x.ctx, x.org, "f", 500); !ok || err != nil {
		t.Fatalf("finish: %v %v", ok, err)
	}
	lim := x.l.Limits(x.org)
	lim.Limits = []balance.Limit{keyLimit("kl", "k1", balance.Lifetime, 20_000), projLimit("pl", "p", balance.Day, 100_000),
		orgLimit("ol", balance.Hour, 1_000_000), keyLimit("k2l", "k2", balance.Day, 5_000)}
	v := x.l.SetLimits(x.org, lim)
	if pushed, err := x.pushLimits(v); err != nil || !pushed {
		t.Fatalf("push: %v %v", pushed, err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	now := x.redisNow()
	f := func(id string, w balance.Window) int64 { return x.u()[field(id, w.StartMS(now))] }
	eq(t, "key limit counts k1's holds", f("kl", balance.Lifetime), 6*2_110+500)
	eq(t, "project limit counts them", f("pl", balance.Day), 6*2_110+500)
	eq(t, "org limit counts every hold", f("ol", balance.Hour), 6*2_110+500+1_000)
	eq(t, "k2's limit counts k2's hold", f("k2l", balance.Day), 1_000)
	x.counters()
	if _, err := x.reserveKey(x.s, "c", "k1", 20_000-(6*2_110+500)+1); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("a hold past the new cap: %v, want ErrLimit", err)
	}
	x.mustReserveKey(x.s, "c", "k1", 20_000-(6*2_110+500)) // exactly to the cap
	eq(t, "at the cap", f("kl", balance.Lifetime), 20_000)
	eq(t, "settled below its hold", x.settleUsage(x.s, "a0", "k1", 1_000, k1[0].ReservedAt), balance.Applied)
	eq(t, "the settle moved the new counter", f("kl", balance.Lifetime), 20_000-1_110)
	if ok, err := x.s.Release(x.ctx, x.org, "a1"); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eq(t, "the release moved it", f("kl", balance.Lifetime), 20_000-1_110-2_110)
	eq(t, "the finished hold settles at its cost", x.settleUsage(x.s, "f", "k1", 500, fin.ReservedAt), balance.Applied)
	eq(t, "unchanged by that settle", f("kl", balance.Lifetime), 20_000-1_110-2_110)
	x.counters()
}

// burst runs requests reserves at once (ids burst-0000 …), released together by a gate, and
// counts those granted and those refused as refusedBy says; any other error fails the test.
func (x *h) burst(requests int, reserve func(id string) (balance.Reservation, error), refusedBy func(error) bool) (granted, refused int64) {
	var wg sync.WaitGroup
	var ok, no atomic.Int64
	gate := make(chan struct{})
	for i := range requests {
		wg.Go(func() {
			<-gate
			_, err := reserve(fmt.Sprintf("burst-%04d", i))
			switch {
			case err == nil:
				ok.Add(1)
			case refusedBy(err):
				no.Add(1)
			default:
				x.t.Errorf("reserve: %v", err)
			}
		})
	}
	close(gate)
	wg.Wait()
	return ok.Load(), no.Load()
}

// roomyClient is a client of c's server(s) with a large pool and long timeouts.
func roomyClient(t *testing.T, c redis.UniversalClient) redis.UniversalClient {
	t.Helper()
	var out redis.UniversalClient
	switch c := c.(type) {
	case *redis.Client:
		o := *c.Options()
		o.PoolSize, o.PoolTimeout, o.ReadTimeout, o.WriteTimeout = 64, time.Minute, 30*time.Second, 30*time.Second
		out = redis.NewClient(&o)
	case *redis.ClusterClient:
		o := *c.Options()
		o.PoolSize, o.PoolTimeout, o.ReadTimeout, o.WriteTimeout = 64, time.Minute, 30*time.Second, 30*time.Second
		out = redis.NewClusterClient(&o)
	default:
		return c
	}
	t.Cleanup(func() { _ = out.Close() })
	return out
}

func mustSnapSince(t *testing.T, l *FakeLedger, org string, at time.Time) balance.Snapshot {
	t.Helper()
	s, err := l.SnapshotSince(context.Background(), org, at)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// "A limit is scope × window × cap": a hold counts against each limit of its org, its key's
// project (as lim says) and its key, in the window of its reserve time.
func exerciseLimitsScopeWindowCap(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{
		Limits: []balance.Limit{
			orgLimit("o-month", balance.Month, 10_000), projLimit("p-day", "staging", balance.Day, 5_000),
			keyLimit("k-hour", "k1", balance.Hour, 1_000), keyLimit("k2-life", "k2", balance.Lifetime, 700),
		},
		Projects: map[string]string{"k1": "staging"},
	})
	r := x.mustReserveKey(x.s, "a", "k1", 300)
	now := r.ReservedAt
	if d := time.Since(now); d < -time.Minute || d > time.Minute {
		t.Fatalf("reserve time %v is not the Redis clock", now)
	}
	u := x.u()
	eq(t, "org counter", u[field("o-month", balance.Month.StartMS(now))], 300)
	eq(t, "project counter", u[field("p-day", balance.Day.StartMS(now))], 300)
	eq(t, "key counter", u[field("k-hour", balance.Hour.StartMS(now))], 300)
	eq(t, "other key's lifetime counter", u[field("k2-life", 0)], 0)
	x.counters()
	x.mustReserveKey(x.s, "b", "k2", 500) // k2 is in no project: org and k2 only
	x.mustReserveKey(x.s, "c", "", 100)   // no key: the org's limits only
	u = x.u()
	eq(t, "org counter", u[field("o-month", balance.Month.StartMS(now))], 900)
	eq(t, "project counter", u[field("p-day", balance.Day.StartMS(now))], 300)
	eq(t, "k2 counter", u[field("k2-life", 0)], 500)
	x.counters()
	// The cap is exact: U + amount = cap passes, one more refuses.
	x.mustReserveKey(x.s, "d", "k2", 200)
	_, err := x.reserveKey(x.s, "e", "k2", 1)
	var le *balance.LimitError
	if !errors.As(err, &le) || !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("got %v, want *LimitError", err)
	}
	eq(t, "limit", le.Limit, keyLimit("k2-life", "k2", balance.Lifetime, 700))
	eq(t, "used", le.Used, 700)
	eq(t, "lifetime never resets", le.ResetsAt.IsZero(), true)
	x.counters()
}

// "LIMIT: some counter in scope has U + amount > cap; nothing is written."
func exerciseLimitWritesNothing(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{
		orgLimit("o", balance.Day, 1_000), keyLimit("k", "k1", balance.Day, 400),
	}})
	x.mustReserveKey(x.s, "a", "k1", 300)
	before, ubefore := x.state(), x.u()
	_, err := x.reserveKey(x.s, "b", "k1", 101)
	var le *balance.LimitError
	if !errors.As(err, &le) || le.Limit.ID != "k" || le.Used != 300 || le.Amount != 101 {
		t.Fatalf("got %v, want the key's limit with 300 used", err)
	}
	_, next := balance.Day.Bounds(x.redisNow())
	eq(t, "resets at the next day", le.ResetsAt.Equal(next), true)
	after := x.state()
	eq(t, "balance", after.Balance, before.Balance)
	eq(t, "holds", after.Holds, before.Holds)
	eq(t, "counters", fmt.Sprint(x.u()), fmt.Sprint(ubefore))
	x.counters()
}

// The order of reserve's checks: amount, COLD, DUPLICATE, GONE, FROZEN, TOO_MANY, LIMIT,
// INSUFFICIENT — a re-sent reserve whose first try committed is recognised before any cap.
func exerciseReserveOrder(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{MaxInFlight: 2}, 1_000, balance.Limits{Limits: []balance.Limit{
		keyLimit("k", "k1", balance.Day, 500),
	}})
	x.mustReserveKey(x.s, "a", "k1", 500) // the cap is used up
	// DUP before LIMIT, with the original's reserve time (here read through a store whose
	// clock is an hour ahead).
	x.mustReserveKey(x.s, "a2", "", 10)
	ahead := x.withClock(x.redisNow().Add(time.Hour))
	r := x.mustReserveKey(ahead, "a", "k1", 500)
	eq(t, "duplicate", r.Duplicate, true)
	if d := time.Since(r.ReservedAt); d < -time.Minute || d > time.Minute {
		t.Fatalf("duplicate's reserve time %v is not the original's", r.ReservedAt)
	}
	first, _ := x.env.Client.HGet(x.ctx, x.keys().Holds, "a").Result()
	eq(t, "record keeps the reserve time", strings.Contains(first, "|"+strconv.FormatInt(r.ReservedAt.UnixMilli(), 10)+"|"), true)
	// GONE before FROZEN and LIMIT.
	if _, err := x.s.Release(x.ctx, x.org, "a2"); err != nil {
		t.Fatal(err)
	}
	if _, err := x.reserveKey(x.s, "a2", "k1", 10); !errors.Is(err, balance.ErrGone) {
		t.Fatalf("re-sent after release: %v, want ErrGone", err)
	}
	// LIMIT before INSUFFICIENT: 501 is more than the balance left and than the cap.
	if _, err := x.reserveKey(x.s, "b", "k1", 501); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("got %v, want ErrLimit", err)
	}
	// TOO_MANY before LIMIT.
	x.mustReserveKey(x.s, "c", "", 10)
	if _, err := x.reserveKey(x.s, "d", "k1", 1); !errors.Is(err, balance.ErrTooManyHolds) {
		t.Fatalf("got %v, want ErrTooManyHolds", err)
	}
	// FROZEN before TOO_MANY.
	lim := x.l.Limits(x.org)
	lim.Frozen = []balance.Scope{{Kind: balance.ScopeKey, ID: "k1"}}
	if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); err != nil {
		t.Fatal(err)
	}
	_, err := x.reserveKey(x.s, "d", "k1", 1)
	var fe *balance.FrozenError
	if !errors.As(err, &fe) || fe.Scope != (balance.Scope{Kind: balance.ScopeKey, ID: "k1"}) {
		t.Fatalf("got %v, want the key frozen", err)
	}
	// DUP before FROZEN.
	if r, err := x.reserveKey(x.s, "a", "k1", 500); err != nil || !r.Duplicate {
		t.Fatalf("re-sent reserve of a frozen key: %v %v, want DUP", r, err)
	}
	x.counters()
}

// "Reserve answers COLD when lim is missing or its version is older than the one acct
// records" (the script itself; Store.Reserve then reseeds).
func exerciseColdWithoutCurrentLim(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000, balance.Limits{Limits: []balance.Limit{orgLimit("o", balance.Day, 500)}})
	keys := x.keys().ReserveKeys()
	call := func() string {
		res, err := x.env.Client.Eval(x.ctx, reserveSrc(), keys, x.s.Epoch().String(), randomID("h"), "10", "1000", "10", "1000", "1000", "", "0").Slice()
		if err != nil {
			t.Fatal(err)
		}
		return res[0].(string)
	}
	if err := x.env.Client.HSet(x.ctx, x.keys().Lim, "v", "0").Err(); err != nil {
		t.Fatal(err)
	}
	eq(t, "lim older than acct records", call(), "COLD")
	if err := x.env.Client.Del(x.ctx, x.keys().Lim).Err(); err != nil {
		t.Fatal(err)
	}
	eq(t, "lim missing", call(), "COLD")
	// Store.Reserve reseeds all three (the seed rewrites an acct whose lim is not current).
	x.mustReserveKey(x.s, "a", "", 100)
	eq(t, "counter after reseed", x.u()[field("o", balance.Day.StartMS(x.redisNow()))], 100)
	x.counters()
}

// "acct and u exist or vanish together" (DESIGN.md "Two planes"): invalidate and settle's
// newer-epoch drop drop both and leave lim (the admin plane's); PushLimits writes lim and drops
// both; a seed writes both, under the lim it finds.
func exerciseExistOrVanishTogether(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000, balance.Limits{Limits: []balance.Limit{orgLimit("o", balance.Day, 500)}})
	exists := func() int64 {
		n, err := x.env.Client.Exists(x.ctx, x.keys().Acct, x.keys().U).Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	eq(t, "after seed", exists(), 2)
	limStays := func(when string) { x.t.Helper(); eq(t, "lim "+when, x.exists(x.keys().Lim), true) }
	limStays("after seed")
	x.mustReserveKey(x.s, "a", "", 10)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "after invalidate", exists(), 0)
	limStays("after invalidate")
	x.counters()
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "after reseed", exists(), 2)
	eq(t, "live hold counted by the seed", x.u()[field("o", balance.Day.StartMS(x.redisNow()))], 10)
	x.counters()
	newer := balance.Epoch{Gen: x.l.CurrentEpoch().Gen + 1, ID: "newer"}
	if _, err := x.s.Settle(x.ctx, x.org, newer, []balance.Entry{{Seq: 2, Delta: -1}}); !errors.Is(err, balance.ErrCold) {
		t.Fatalf("newer epoch: %v", err)
	}
	eq(t, "after a newer epoch's settle", exists(), 0)
	limStays("after a newer epoch's settle")
	x.l.SetEpoch(newer)
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "after reseed", exists(), 2)
	v := x.l.Limits(x.org).Version
	if pushed, err := x.pushLimits(v); pushed || err != nil {
		t.Fatalf("push of the current version: %v %v, want nothing", pushed, err)
	}
	eq(t, "after a push of the same version", exists(), 2)
	if pushed, err := x.pushLimits(v + 1); !pushed || err != nil {
		t.Fatalf("push of a newer version: %v %v", pushed, err)
	}
	eq(t, "after a push", exists(), 0)
	limStays("after a push")
	x.counters()
}

// Moves: settle seq = wm+1 takes the hold out of its counters and adds the entry's cost to
// the counters it names; release and reap U −= hold; finish U += cost − hold.
func exerciseMovesKeepCounters(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{HoldTTL: 100 * time.Millisecond, PinTTL: time.Second, ReapGrace: time.Millisecond}, 1_000_000,
		balance.Limits{Limits: []balance.Limit{orgLimit("o", balance.Month, 100_000), keyLimit("k", "k1", balance.Day, 50_000)}, Projects: map[string]string{"k1": "p"}})
	f := func(id string) int64 {
		return x.u()[field(id, map[string]balance.Window{"o": balance.Month, "k": balance.Day}[id].StartMS(x.redisNow()))]
	}
	ra := x.mustReserveKey(x.s, "a", "k1", 1_000)
	eq(t, "a held", f("k"), 1_000)
	eq(t, "settle below the hold", x.settleUsage(x.s, "a", "k1", 400, ra.ReservedAt), balance.Applied)
	eq(t, "a charged", f("k"), 400)
	rb := x.mustReserveKey(x.s, "b", "k1", 1_000)
	eq(t, "settle above the hold (overshoot)", x.settleUsage(x.s, "b", "k1", 1_300, rb.ReservedAt), balance.Applied)
	eq(t, "b charged", f("k"), 1_700)
	x.mustReserveKey(x.s, "c", "k1", 1_000)
	if ok, err := x.s.Release(x.ctx, x.org, "c"); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eq(t, "released", f("k"), 1_700)
	x.counters()
	rd := x.mustReserveKey(x.s, "d", "k1", 1_000)
	if ok, err := x.s.Finish(x.ctx, x.org, "d", 250); !ok || err != nil {
		t.Fatalf("finish: %v %v", ok, err)
	}
	eq(t, "finished", f("k"), 1_950)
	eq(t, "org counter", f("o"), 1_950)
	x.counters()
	eq(t, "settle a finished hold", x.settleUsage(x.s, "d", "k1", 250, rd.ReservedAt), balance.Applied)
	eq(t, "settled", f("k"), 1_950)
	x.mustReserveKey(x.s, "e", "k1", 1_000)
	x.mustReserveKey(x.s, "g", "k1", 1_000)
	if ok, err := x.s.Finish(x.ctx, x.org, "g", 10); !ok || err != nil {
		t.Fatalf("finish: %v %v", ok, err)
	}
	x.counters()
	time.Sleep(250 * time.Millisecond) // expiry, not a window: the reaper needs real time
	if n, err := x.s.Reap(x.ctx, x.org); n != 2 || err != nil {
		t.Fatalf("reap: %d %v, want e and g", n, err)
	}
	eq(t, "reaped", f("k"), 1_950)
	x.counters()
	// An entry with no reserve time (a credit, an adjust) counts against no limit.
	x.l.Add(x.org, -5, "")
	if err := x.s.CatchUp(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "unattributed", f("k"), 1_950)
	x.counters()
}

// "Finish and release with no acct touch no counter"; seq ≤ wm only takes a present hold
// out of its counters; the seed counts the window's spend so far plus live holds.
func exerciseSeedAndAlready(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{keyLimit("k", "k1", balance.Day, 50_000)}})
	f := func() int64 { return x.u()[field("k", balance.Day.StartMS(x.redisNow()))] }
	ra := x.mustReserveKey(x.s, "a", "k1", 1_000)
	x.mustReserveKey(x.s, "b", "k1", 2_000)
	x.mustReserveKey(x.s, "c", "k1", 3_000)
	// a's usage is in the ledger, unsettled; yesterday's usage too (not this window's).
	ea := x.l.AddUsage(x.org, 600, "a", "k1", "", ra.ReservedAt)
	x.l.AddUsage(x.org, 999, "old", "k1", "", ra.ReservedAt.Add(-24*time.Hour))
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	// No acct: release and finish touch no counter (there is none to touch).
	if ok, _ := x.s.Release(x.ctx, x.org, "c"); !ok {
		t.Fatal("release c")
	}
	if ok, _ := x.s.Finish(x.ctx, x.org, "b", 500); !ok {
		t.Fatal("finish b")
	}
	n, _ := x.env.Client.Exists(x.ctx, x.keys().U).Result()
	eq(t, "no counters recreated", n, 0)
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	// The seed: a's cost (ledger, this window) + a's hold + b's (finished) hold.
	eq(t, "seeded counter", f(), 600+1_000+500)
	if u := x.u(); len(u) != 1 {
		t.Fatalf("seed created a past window's counter: %v", u)
	}
	x.counters()
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{ea})
	if err != nil || st[0] != balance.Already {
		t.Fatalf("settle a: %v %v, want already", st, err)
	}
	eq(t, "already: only the hold left", f(), 600+500)
	x.counters()
}

// "A request reserved at 23:59:59 belongs to that day": settled after midnight, its cost is
// charged to the day it started; the new day's counter is created by the next reserve.
func exerciseChargedToTheDayItStarted(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 1_000_000, balance.Limits{Limits: []balance.Limit{keyLimit("k", "k1", balance.Day, 5_000)}})
	midnight := time.Date(2031, 3, 4, 0, 0, 0, 0, time.UTC)
	late, r := x.reserveBefore(midnight, "late", "k1", 1_000) // at 23:59:59
	day1 := midnight.AddDate(0, 0, -1).UnixMilli()
	if got := balance.Day.StartMS(r.ReservedAt); got != day1 {
		t.Fatalf("reserved at %v: day %d, want %d", r.ReservedAt, got, day1)
	}
	after := x.withClock(midnight.Add(2 * time.Second))
	eq(t, "settled after midnight", x.settleUsage(after, late, "k1", 4_000, r.ReservedAt), balance.Applied)
	u := x.u()
	eq(t, "charged to its day", u[field("k", day1)], 4_000)
	if _, ok := u[field("k", midnight.UnixMilli())]; ok {
		t.Fatal("the new day's counter was charged")
	}
	// The new day has its own cap: 5,000 fit. Its first hold drops the past day's counter
	// (past windows are not kept in Redis); a settle there is then skipped.
	x.mustReserveKey(after, "next", "k1", 5_000)
	u = x.u()
	eq(t, "new day", u[field("k", midnight.UnixMilli())], 5_000)
	if _, ok := u[field("k", day1)]; ok {
		t.Fatalf("the past day's counter is kept: %v", u)
	}
	if _, err := x.reserveKey(after, "more", "k1", 1); !errors.Is(err, balance.ErrLimit) {
		t.Fatalf("got %v, want ErrLimit", err)
	}
	// A reseed on the new day keeps only the current window; a settle for the past window
	// then skips its missing field and creates nothing.
	late2, r2 := x.reserveBefore(midnight, "late2", "k1", 500)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	if _, err := after.Seed(x.ctx, x.org, mustSnapSince(t, x.l, x.org, midnight.Add(2*time.Second))); err != nil {
		t.Fatal(err)
	}
	if err := after.CatchUp(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	u = x.u()
	if _, ok := u[field("k", day1)]; ok {
		t.Fatalf("a reseed kept a past window: %v", u)
	}
	eq(t, "new day after reseed", u[field("k", midnight.UnixMilli())], 5_000)
	x.settleUsage(after, late2, "k1", 300, r2.ReservedAt)
	u = x.u()
	if _, ok := u[field("k", day1)]; ok {
		t.Fatalf("a settle re-created a past window: %v", u)
	}
	eq(t, "new day untouched", u[field("k", midnight.UnixMilli())], 5_000)
}

// "A freeze flag on the org, a project or a key refuses every new hold at once; holds in
// flight finish normally."
func exerciseFreezeAtOnce(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 100_000, balance.Limits{
		Limits: []balance.Limit{orgLimit("o", balance.Day, 50_000)}, Projects: map[string]string{"k1": "p", "k2": "p"},
	})
	ra := x.mustReserveKey(x.s, "a", "k1", 1_000)
	rb := x.mustReserveKey(x.s, "b", "k3", 1_000)
	for _, sc := range []balance.Scope{{Kind: balance.ScopeKey, ID: "k1"}, {Kind: balance.ScopeProject, ID: "p"}, {Kind: balance.ScopeOrg}} {
		lim := x.l.Limits(x.org)
		lim.Frozen = []balance.Scope{sc}
		if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); err != nil {
			t.Fatal(err)
		}
		key := map[balance.ScopeKind]string{balance.ScopeKey: "k1", balance.ScopeProject: "k2", balance.ScopeOrg: "k3"}[sc.Kind]
		_, err := x.reserveKey(x.s, randomID("h"), key, 1)
		var fe *balance.FrozenError
		if !errors.As(err, &fe) || !errors.Is(err, balance.ErrFrozen) || fe.Scope != sc {
			t.Fatalf("frozen %v: got %v", sc, err)
		}
		x.counters()
	}
	// The holds in flight finish and settle normally while the org is frozen.
	if ok, err := x.s.Finish(x.ctx, x.org, "a", 700); !ok || err != nil {
		t.Fatalf("finish: %v %v", ok, err)
	}
	eq(t, "settle a", x.settleUsage(x.s, "a", "k1", 700, ra.ReservedAt), balance.Applied)
	eq(t, "settle b", x.settleUsage(x.s, "b", "k3", 1_200, rb.ReservedAt), balance.Applied)
	eq(t, "balance", x.state().Balance, 100_000-700-1_200)
	eq(t, "counter", x.u()[field("o", balance.Day.StartMS(x.redisNow()))], 1_900)
	// Unfreeze: holds pass again.
	lim := x.l.Limits(x.org)
	lim.Frozen = nil
	if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); err != nil {
		t.Fatal(err)
	}
	x.mustReserveKey(x.s, "c", "k1", 1)
}

// A seeder that read the ledger before a freeze and seeds after the freeze was pushed must not
// seed under the old limits: lim's own version is the floor, and a seed of an older snapshot of
// the same epoch is refused.
func exercisePushFencesStaleSeed(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 10_000, false)
	x.l.SetLimits(x.org, balance.Limits{Limits: []balance.Limit{orgLimit("o", balance.Day, 5_000)}})
	stale := mustSnapSince(t, x.l, x.org, x.redisNow()) // read before the freeze
	lim := x.l.Limits(x.org)
	lim.Frozen = []balance.Scope{{Kind: balance.ScopeOrg}}
	v := x.l.SetLimits(x.org, lim)
	// The org is cold: the push writes the limits, which are the floor.
	if pushed, err := x.pushLimits(v); err != nil || !pushed {
		t.Fatalf("push on a cold org: %v %v", pushed, err)
	}
	if _, err := x.s.Seed(x.ctx, x.org, stale); !errors.Is(err, balance.ErrCold) || !strings.Contains(err.Error(), "snapshot older") {
		t.Fatalf("seed of the snapshot read before the freeze: %v, want ErrCold (a stale snapshot)", err)
	}
	eq(t, "acct written", x.exists(x.keys().Acct), false)
	_, err := x.reserveKey(x.s, "a", "k1", 1) // cold: warms from the ledger, which has the freeze
	if !errors.Is(err, balance.ErrFrozen) {
		t.Fatalf("reserve after the freeze: %v, want ErrFrozen", err)
	}
	// A snapshot at the pushed version or newer seeds; so does one of another epoch (a restored
	// ledger may have an older limits version: the floor belongs to the old timeline).
	if ok, err := x.s.Seed(x.ctx, x.org, mustSnapSince(t, x.l, x.org, x.redisNow())); err != nil || ok {
		t.Fatalf("seed of a current snapshot on a warm org: %v %v (want a no-op)", ok, err)
	}
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	next := balance.Epoch{Gen: x.l.CurrentEpoch().Gen + 1, ID: "restored"}
	x.l.SetEpoch(next)
	old := stale
	old.Epoch = next
	// lim carries its epoch: the old timeline's limits are not the new one's, so a seed needs
	// the new epoch's pushed first (a store that may write them does it itself: Warm).
	if ok, err := x.s.Seed(x.ctx, x.org, old); !errors.Is(err, balance.ErrCold) || !strings.Contains(err.Error(), "not pushed") || ok {
		t.Fatalf("seed in a new epoch under the old epoch's limits: %v %v, want ErrCold (limits not pushed)", ok, err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatalf("warm in a new epoch (pushes its limits): %v", err)
	}
	eq(t, "acct of the new epoch", x.state().Epoch, next)
}

// "Lowering a cap below used refuses new holds and never moves money."
func exerciseLowerCapBelowUsed(t *testing.T, env Env) {
	t.Parallel()
	x := limited(t, env, balance.Config{}, 100_000, balance.Limits{Limits: []balance.Limit{keyLimit("k", "k1", balance.Month, 1_000)}})
	ra := x.mustReserveKey(x.s, "a", "k1", 500)
	x.settleUsage(x.s, "a", "k1", 300, ra.ReservedAt)
	rb := x.mustReserveKey(x.s, "b", "k1", 500) // in flight across the change
	before := x.state()
	lim := x.l.Limits(x.org)
	lim.Limits[0].Cap = 200
	if _, err := x.pushLimits(x.l.SetLimits(x.org, lim)); err != nil {
		t.Fatal(err)
	}
	_, err := x.reserveKey(x.s, "c", "k1", 1)
	var le *balance.LimitError
	if !errors.As(err, &le) || le.Used != 800 || le.Limit.Cap != 200 {
		t.Fatalf("got %v, want the lowered cap with 800 used", err)
	}
	after := x.state()
	eq(t, "balance", after.Balance, before.Balance)
	eq(t, "held", after.Held, before.Held)
	x.counters()
	eq(t, "the hold in flight settles", x.settleUsage(x.s, "b", "k1", 450, rb.ReservedAt), balance.Applied)
	eq(t, "balance", x.state().Balance, 100_000-300-450)
	eq(t, "used over the cap", x.u()[field("k", balance.Month.StartMS(x.redisNow()))], 750)
}

// Window boundaries are computed by the script from TIME: minute, hour, day, week (Monday), calendar
// month, UTC; month ends, year ends, leap years and the 100/400 rules, checked against Go's
// calendar (Window.Bounds) through the counter fields and the reset times reserve reports.
func exerciseCalendar(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 0, false)
	var instants []time.Time
	for _, b := range []time.Time{
		time.Date(2024, 2, 29, 0, 0, 0, 0, time.UTC), // leap day
		time.Date(2024, 3, 1, 0, 0, 0, 0, time.UTC),  // after a leap February
		time.Date(2023, 3, 1, 0, 0, 0, 0, time.UTC),  // after a common February
		time.Date(2000, 3, 1, 0, 0, 0, 0, time.UTC),  // 2000: divisible by 400, leap
		time.Date(2100, 3, 1, 0, 0, 0, 0, time.UTC),  // 2100: divisible by 100, common
		time.Date(1900, 3, 1, 0, 0, 0, 0, time.UTC),  // 1900: common (a negative timestamp)
		time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC),  // year end
		time.Date(2031, 5, 1, 0, 0, 0, 0, time.UTC),  // after a 30-day month
		time.Date(2026, 12, 7, 0, 0, 0, 0, time.UTC), // a Monday
		time.Date(2026, 8, 1, 13, 0, 0, 0, time.UTC), // an hour
	} {
		instants = append(instants, b.Add(-1500*time.Millisecond), b.Add(1500*time.Millisecond))
	}
	rnd := rand.New(rand.NewPCG(7, 13))
	for range 20 {
		instants = append(instants, time.UnixMilli(-2_208_988_800_000+rnd.Int64N(300*365*86_400_000)).UTC())
	}
	windows := []balance.Window{balance.Minute, balance.Hour, balance.Day, balance.Week, balance.Month, balance.Lifetime}
	var lims []balance.Limit
	for _, w := range windows {
		lims = append(lims, keyLimit("l-"+string(w), "k-"+string(w), w, 10))
	}
	for i, at := range instants {
		s := x.withClock(at)
		org := fmt.Sprintf("%s-%d", x.org, i)
		x.l.Add(org, 1_000, "")
		x.l.SetLimits(org, balance.Limits{Limits: lims})
		// The script's windows are compared with Go's at the reserve time it reports (the
		// instants are only aimed at: the test's own run time moves them a little).
		for _, w := range windows {
			_, err := s.Reserve(x.ctx, balance.ReserveRequest{Org: org, HoldID: "a-" + string(w), Amount: 11, KeyID: "k-" + string(w)})
			var le *balance.LimitError
			if !errors.As(err, &le) {
				t.Fatalf("%v: %s: got %v, want a limit", at, w, err)
			}
			r, err := s.Reserve(x.ctx, balance.ReserveRequest{Org: org, HoldID: "b-" + string(w), Amount: 5, KeyID: "k-" + string(w)})
			if err != nil {
				t.Fatalf("%v: reserve: %v", at, err)
			}
			if d := r.ReservedAt.Sub(at); d < -time.Minute || d > time.Minute {
				t.Fatalf("%v: reserve time %v", at, r.ReservedAt)
			}
			start, next := w.Bounds(r.ReservedAt)
			// The refusal came first: its window is the reserve's, or the one before it.
			if w != balance.Lifetime && !le.ResetsAt.Equal(next) && !le.ResetsAt.Equal(start) {
				t.Fatalf("%v: %s resets at %v, want %v", r.ReservedAt, w, le.ResetsAt, next)
			}
			c, err := s.Counters(x.ctx, org)
			if err != nil {
				t.Fatal(err)
			}
			want := balance.Counter{LimitID: "l-" + string(w), Start: w.StartMS(r.ReservedAt)}
			if c[want] != 5 {
				t.Fatalf("%v: %s window start: counters %v, want %v (%v)", r.ReservedAt, w, c, want, start)
			}
		}
	}
}

func exerciseLimitsValidation(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1_000, true)
	for _, lim := range []balance.Limits{
		{Limits: []balance.Limit{orgLimit("", balance.Day, 1)}},
		{Limits: []balance.Limit{orgLimit("a:b", balance.Day, 1)}},
		{Limits: []balance.Limit{orgLimit("a", "fortnight", 1)}},
		{Limits: []balance.Limit{orgLimit("a", balance.Day, 0)}},
		{Limits: []balance.Limit{orgLimit("a", balance.Day, balance.MaxAmount+1)}},
		{Limits: []balance.Limit{orgLimit("a", balance.Day, 1), orgLimit("a", balance.Hour, 1)}},
		{Limits: []balance.Limit{keyLimit("a", "", balance.Day, 1)}},
		{Limits: []balance.Limit{{ID: "a", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Minute, Cap: 1, Unit: "bytes"}}},
		{Frozen: []balance.Scope{{Kind: "team", ID: "x"}}},
		{Projects: map[string]string{"k,1": "p"}},
	} {
		_, err := x.s.Seed(x.ctx, randomID("org"), balance.Snapshot{Epoch: x.l.CurrentEpoch(), Seq: 1, Limits: &balance.LimitSnapshot{Limits: lim}})
		if !errors.Is(err, balance.ErrInvalidLimits) {
			t.Fatalf("%+v: got %v, want ErrInvalidLimits", lim, err)
		}
	}
	if _, err := x.reserveKey(x.s, "h", "a;b", 1); !errors.Is(err, balance.ErrInvalidKeyID) {
		t.Fatalf("bad key id: %v", err)
	}
}

// 2,000 concurrent reserves on one key with a daily cap for exactly N holds and a balance far
// larger: exactly N pass.
func exerciseBurst2000KeyCap(t *testing.T, env Env) {
	t.Parallel()
	const requests, n, hold = 2000, 137, 1_000
	// Exact counts: a client of its own with room for the burst and timeouts a loaded machine
	// (the race detector, a shared CI box) cannot hit, as TestBurst does.
	env.Client = roomyClient(t, env.Client) // env is this function's copy
	x := limited(t, env, balance.Config{MaxInFlight: 5000}, 1_000_000_000, balance.Limits{Limits: []balance.Limit{
		keyLimit("daily", "k1", balance.Day, n*hold), orgLimit("o", balance.Month, 1_000_000_000),
	}})
	granted, refused := x.burst(requests, func(id string) (balance.Reservation, error) { return x.reserveKey(x.s, id, "k1", hold) },
		func(err error) bool { return errors.Is(err, balance.ErrLimit) })
	eq(t, "granted", granted, n)
	eq(t, "refused by the cap", refused, requests-n)
	eq(t, "counter", x.u()[field("daily", balance.Day.StartMS(x.redisNow()))], n*hold)
	eq(t, "balance", x.state().Balance, 1_000_000_000-n*hold)
	x.counters()
}
