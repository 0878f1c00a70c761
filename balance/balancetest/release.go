package balancetest

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/redis/go-redis/v9"
)

func exerciseReleaseWithoutAcct(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	ok, err := x.s.Release(x.ctx, x.org, "a")
	eq(t, "released", ok, true)
	eq(t, "err", err, nil)
	st := x.state()
	eq(t, "acct not recreated", st.Exists, false)
	eq(t, "holds", st.Holds, 0)
	eq(t, "tombstone", x.inGone("a"), true)
	ok, err = x.s.Release(x.ctx, x.org, "never")
	eq(t, "released unknown", ok, false)
	eq(t, "err", err, nil)
	eq(t, "tombstone of unknown", x.inGone("never"), true)
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "balance after reseed", x.state().Balance, 1000)
}

func exerciseReleaseRacesReaper(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: 20 * time.Millisecond, PinTTL: time.Second, ReapGrace: time.Millisecond}, 1000, true)
	const n = 10
	for i := range n {
		x.mustReserve(fmt.Sprint("h", i), 10)
	}
	time.Sleep(60 * time.Millisecond)
	var released, reaped atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		for range 3 {
			wg.Go(func() {
				if ok, err := x.s.Release(x.ctx, x.org, fmt.Sprint("h", i)); err != nil {
					t.Error(err)
				} else if ok {
					released.Add(1)
				}
			})
		}
	}
	for range 3 {
		wg.Go(func() {
			k, err := x.s.Reap(x.ctx, x.org)
			if err != nil {
				t.Error(err)
			}
			reaped.Add(int64(k))
		})
	}
	wg.Wait()
	eq(t, "holds given back", released.Load()+reaped.Load(), n)
	eq(t, "balance", x.state().Balance, 1000)
	eq(t, "holds", x.state().Holds, 0)
}

func exerciseReapRules(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute, PinTTL: time.Hour, ReapGrace: 50 * time.Millisecond}, 1000, true) // aged, not slept past: see FinishedReapRules
	x.mustReserve("usage", 100)                                                                                                 // usage recorded, not settled: never reaped
	x.mustReserve("pinned", 100)                                                                                                // journaled: pinned
	x.mustReserve("phantom", 100)                                                                                               // a late re-send whose usage is settled: released
	x.mustReserve("dead", 100)                                                                                                  // owner died, no usage: released
	x.reapNothingYet()                                                                                                          // not yet expired past the grace, then the ledger down: nothing
	eq(t, "holds while ledger down", x.state().Holds, 4)
	x.l.SetErr(nil)
	n, err := x.s.Reap(x.ctx, x.org)
	eq(t, "reaped", n, 2)
	eq(t, "err", err, nil)
	st := x.state()
	eq(t, "holds", st.Holds, 2)
	eq(t, "balance", st.Balance, 800)
	eq(t, "phantom tombstoned", x.inGone("phantom"), true)
	if _, ok := x.expiry("usage"); !ok {
		t.Fatal("hold with unsettled usage was reaped")
	}
	if _, ok := x.expiry("pinned"); !ok {
		t.Fatal("pinned hold was reaped")
	}
	// Still tracked: holds are left.
	eq(t, "held orgs", len(x.s.HeldOrgs()), 1)
	x.reapUsageAndPinned()
	eq(t, "balance", x.state().Balance, 1000)
	if _, err := x.s.Reap(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "held orgs after all reaped", len(x.s.HeldOrgs()), 0)
}

func exerciseReapScriptRechecksExpiry(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute}, 1000, true)
	x.mustReserve("live", 100)
	keys := []string{x.keys().Acct, x.keys().Holds, x.keys().Hexp, x.keys().Gone, x.keys().Hfin, x.keys().U}
	n, err := x.env.Client.Eval(x.ctx, reapSrc(), keys, "30000", "0", "live", "unknown").Int64()
	eq(t, "reaped", n, 0)
	eq(t, "err", err, nil)
	eq(t, "holds", x.state().Holds, 1)
}

func exerciseTombstoneTrim(t *testing.T, env Env) {
	t.Parallel()
	// No sleep: "old" is aged by moving its score (Redis server ms) two TTLs into the past, and
	// the TTL is a minute, so "new" is younger than it at any machine speed.
	const ttl = time.Minute
	x := fixture(t, env, balance.Config{TombstoneTTL: ttl}, 1000, true)
	x.mustReserve("old", 10)
	if _, err := x.s.Release(x.ctx, x.org, "old"); err != nil {
		t.Fatal(err)
	}
	eq(t, "tombstone", x.inGone("old"), true)
	pttl, err := x.env.Client.PTTL(x.ctx, x.keys().Gone).Result()
	if err != nil || pttl <= 0 || pttl > ttl {
		t.Fatalf("gone ttl %v %v, want (0, %v]", pttl, err, ttl)
	}
	now, err := x.env.Client.Time(x.ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	aged := float64(now.Add(-2 * ttl).UnixMilli())
	if err := x.env.Client.ZAddXX(x.ctx, x.keys().Gone, redis.Z{Score: aged, Member: "old"}).Err(); err != nil {
		t.Fatal(err)
	}
	x.mustReserve("new", 10)
	if _, err := x.s.Release(x.ctx, x.org, "new"); err != nil {
		t.Fatal(err)
	}
	// A write trims what is older than the TTL; "new" is younger.
	if _, err := x.s.Release(x.ctx, x.org, "third"); err != nil {
		t.Fatal(err)
	}
	eq(t, "old trimmed", x.inGone("old"), false)
	eq(t, "new kept", x.inGone("new"), true)
}
