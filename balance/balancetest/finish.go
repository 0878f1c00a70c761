package balancetest

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/lua"
)

// finish finishes one hold and asserts the invariant after it.
func (x *h) finish(id string, cost int64) bool {
	x.t.Helper()
	ok, err := x.s.Finish(x.ctx, x.org, id, cost)
	if err != nil {
		x.t.Fatalf("finish %s %d: %v", id, cost, err)
	}
	x.invariant()
	return ok
}

// score is id's score in the zset key (one of the org's: hexp, hfin, gone).
func (x *h) score(key, id string) (float64, bool) {
	x.t.Helper()
	v, err := x.env.Client.ZScore(x.ctx, key, id).Result()
	if errors.Is(err, redis.Nil) {
		return 0, false
	}
	if err != nil {
		x.t.Fatalf("zscore %s: %v", key, err)
	}
	return v, true
}

// holdAmount is the hold's stored amount ("" when there is none).
func (x *h) holdAmount(id string) string {
	x.t.Helper()
	v, err := x.env.Client.HGet(x.ctx, x.keys().Holds, id).Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	if err != nil {
		x.t.Fatalf("hget: %v", err)
	}
	a, _, _ := strings.Cut(v, "|") // '<amount>' or '<amount>|<reserve ms>|…' (lua/lib/limits.lua)
	return a
}

// exists reports whether the key exists.
func (x *h) exists(key string) bool {
	x.t.Helper()
	n, err := x.env.Client.Exists(x.ctx, key).Result()
	if err != nil {
		x.t.Fatal(err)
	}
	return n == 1
}

// fromNow is how far ms (a Redis-clock expiry) is from now.
func fromNow(ms float64) time.Duration {
	return time.Duration(ms)*time.Millisecond - time.Duration(time.Now().UnixMilli())*time.Millisecond
}

func near(t *testing.T, what string, got, want time.Duration) {
	t.Helper()
	if got < want-20*time.Second || got > want+20*time.Second {
		t.Fatalf("%s: %v from now, want ≈ %v", what, got, want)
	}
}

// runFinish is the conformance suite of finish (DESIGN.md "The invariant", finish): one test per
// sentence of the rule, the invariant asserted after every step.
func runFinish(t *testing.T, env Env) {
	t.Run("FinishGivesBackUnused", func(t *testing.T) { exerciseFinishGivesBackUnused(t, env) })
	t.Run("FinishEachBalance", func(t *testing.T) { exerciseFinishEachBalance(t, env) })
	t.Run("FinishOnlyExistingUnfinished", func(t *testing.T) { exerciseFinishOnlyExistingUnfinished(t, env) })
	t.Run("FinishCostAboveHold", func(t *testing.T) { exerciseFinishCostAboveHold(t, env) })
	t.Run("FinishZeroCost", func(t *testing.T) { exerciseFinishZeroCost(t, env) })
	t.Run("FinishLeavesInFlightCount", func(t *testing.T) { exerciseFinishLeavesInFlightCount(t, env) })
	t.Run("FinishExpiry", func(t *testing.T) { exerciseFinishExpiry(t, env) })
	t.Run("FinishNoAcct", func(t *testing.T) { exerciseFinishNoAcct(t, env) })
	t.Run("FinishedExtendUntouched", func(t *testing.T) { exerciseFinishedExtendUntouched(t, env) })
	t.Run("FinishedPinUnpin", func(t *testing.T) { exerciseFinishedPinUnpin(t, env) })
	t.Run("FinishedReapRules", func(t *testing.T) { exerciseFinishedReapRules(t, env) })
	t.Run("FinishedRelease", func(t *testing.T) { exerciseFinishedRelease(t, env) })
	t.Run("ScanOrgsFindsFinished", func(t *testing.T) { exerciseScanOrgsFindsFinished(t, env) })
	t.Run("FinishValidation", func(t *testing.T) { exerciseFinishValidation(t, env) })
	t.Run("FinishBatchManyOrgs", func(t *testing.T) { exerciseFinishBatchManyOrgs(t, env) })
	t.Run("RefusalTellsHeld", func(t *testing.T) { exerciseRefusalTellsHeld(t, env) })
}

// A refusal for the balance tells what it was and what the org's unfinished holds keep (DESIGN
// "Held is not gone"): counted until they cover what is missing, else all of them; a finished
// hold keeps nothing that will come back.
func exerciseRefusalTellsHeld(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 400)
	x.mustReserve("b", 300)
	refusal := func(amount int64) *balance.InsufficientError {
		x.t.Helper()
		_, err := x.reserve("c", amount)
		var ins *balance.InsufficientError
		if !errors.As(err, &ins) {
			x.t.Fatalf("reserve %d: %v, want *InsufficientError", amount, err)
		}
		return ins
	}
	// 300 available; 500 needed: the holds cover the 200 missing (the scan may stop there).
	if e := refusal(500); e.Balance != 300 || e.Held < 200 || e.Held > 700 || e.Amount != 500 {
		t.Fatalf("refusal of 500: %+v", e)
	}
	// 1,001 needed: 701 missing, more than all 700 held: the whole sum.
	if e := refusal(1001); e.Balance != 300 || e.Held != 700 {
		t.Fatalf("refusal of 1001: %+v, want held 700", e)
	}
	// a finishes at its whole hold: only b's 300 may come back.
	x.finish("a", 400)
	if e := refusal(1001); e.Balance != 300 || e.Held != 300 {
		t.Fatalf("refusal of 1001 after a finished: %+v, want held 300", e)
	}
	x.invariant()
}

// bal += hold − cost; the hold becomes cost and is marked finished; bal + Σ holds unchanged;
// the settle later applies the entry against the finished hold as for any other.
func exerciseFinishGivesBackUnused(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("h1", 300)
	x.mustReserve("h2", 100)
	eq(t, "finished", x.finish("h1", 120), true)
	st := x.state()
	eq(t, "balance", st.Balance, 1000-100-120)
	eq(t, "held", st.Held, 220)
	eq(t, "holds", st.Holds, 2)
	eq(t, "finished holds", st.Finished, 1)
	eq(t, "in flight", st.InFlight(), 1)
	eq(t, "hold amount", x.holdAmount("h1"), "120")
	if _, ok := x.score(x.keys().Hexp, "h1"); ok {
		t.Fatal("finished hold still in hexp (the in-flight count)")
	}
	if _, ok := x.score(x.keys().Hfin, "h1"); !ok {
		t.Fatal("finished hold not in hfin")
	}
	eq(t, "settle", x.charge("h1", 120)[0], balance.Applied)
	x.invariant()
	st = x.state()
	eq(t, "balance after settle", st.Balance, 1000-100-120)
	eq(t, "holds after settle", st.Holds, 1)
	eq(t, "finished after settle", st.Finished, 0)
	eq(t, "tombstone", x.inGone("h1"), true)
	if _, ok := x.score(x.keys().Hfin, "h1"); ok {
		t.Fatal("settle left the hold in hfin")
	}
}

// FinishEach answers, per hold in the caller's order, whether this call finished it and the
// org's available balance right after it (what the proxy reports as x-escrow-balance): the
// balance only while acct exists and reflects the cost (finished now or before, or already
// settled); a missing hold, or a cold org, has none.
func exerciseFinishEachBalance(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	x.mustReserve("b", 50)
	x.mustReserve("c", 10)
	other := randomID("org")
	x.l.Add(other, 500, "")
	if _, err := x.s.Reserve(x.ctx, balance.ReserveRequest{Org: other, HoldID: "o", Amount: 40}); err != nil {
		t.Fatal(err)
	}
	res, err := x.s.FinishEach(x.ctx, []balance.Finish{
		{Org: x.org, HoldID: "a", Cost: 30}, {Org: other, HoldID: "o", Cost: 45}, {Org: x.org, HoldID: "b", Cost: 0},
		{Org: x.org, HoldID: "a", Cost: 30}, {Org: x.org, HoldID: "missing", Cost: 1},
	})
	eq(t, "err", err, nil)
	x.invariant()
	eq(t, "results", len(res), 5)
	eq(t, "a", res[0], balance.Finished{Done: true, Balance: 1000 - 160 + 100 - 30, HaveBalance: true})
	eq(t, "other org", res[1], balance.Finished{Done: true, Balance: 500 - 45, HaveBalance: true})
	eq(t, "b after a", res[2], balance.Finished{Done: true, Balance: 1000 - 160 + 100 - 30 + 50, HaveBalance: true})
	eq(t, "a re-sent: already finished, the balance reflects it", res[3], balance.Finished{Balance: res[2].Balance, HaveBalance: true})
	eq(t, "missing", res[4], balance.Finished{})
	eq(t, "store balance", x.state().Balance, res[2].Balance)

	// Settled before its finish (the worker can be first): not finished by this call, the
	// balance already reflects the cost.
	x.mustReserve("d", 100)
	held := x.state().Balance
	eq(t, "settle", x.charge("d", 60)[0], balance.Applied)
	res, err = x.s.FinishEach(x.ctx, []balance.Finish{{Org: x.org, HoldID: "d", Cost: 60}})
	eq(t, "err", err, nil)
	x.invariant()
	eq(t, "settled first", res[0], balance.Finished{Balance: res[0].Balance, HaveBalance: true})
	eq(t, "settled first: the store's balance", res[0].Balance, x.state().Balance)
	eq(t, "settled first: charged", res[0].Balance, held+100-60)

	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	res, err = x.s.FinishEach(x.ctx, []balance.Finish{{Org: x.org, HoldID: "c", Cost: 7}})
	eq(t, "err", err, nil)
	eq(t, "cold org: done, balance unknown", res[0], balance.Finished{Done: true})
	if res, err := x.s.FinishEach(x.ctx, nil); res != nil || err != nil {
		t.Fatalf("empty: %v %v", res, err)
	}
}

// Acts only on an existing, unfinished hold: a re-sent finish changes nothing.
func exerciseFinishOnlyExistingUnfinished(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	eq(t, "finish of an unknown hold", x.finish("never", 5), false)
	eq(t, "no hold written", x.holdAmount("never"), "")
	eq(t, "no hfin written", x.exists(x.keys().Hfin), false)
	eq(t, "balance", x.state().Balance, 1000)

	x.mustReserve("a", 100)
	eq(t, "first finish", x.finish("a", 40), true)
	exp, _ := x.score(x.keys().Hfin, "a")
	time.Sleep(5 * time.Millisecond)
	eq(t, "re-sent finish", x.finish("a", 40), false)
	eq(t, "re-sent finish, other cost", x.finish("a", 10), false)
	st := x.state()
	eq(t, "balance", st.Balance, 960)
	eq(t, "held", st.Held, 40)
	again, _ := x.score(x.keys().Hfin, "a")
	eq(t, "expiry unchanged", again, exp)

	x.mustReserve("b", 100)
	if ok, err := x.s.Release(x.ctx, x.org, "b"); !ok || err != nil {
		t.Fatalf("release: %v %v", ok, err)
	}
	eq(t, "finish after release", x.finish("b", 10), false)
	eq(t, "no hold re-created", x.holdAmount("b"), "")

	x.mustReserve("c", 100)
	eq(t, "settle", x.charge("c", 30)[0], balance.Applied)
	eq(t, "finish after settle", x.finish("c", 30), false)
	eq(t, "no hold re-created", x.holdAmount("c"), "")
	eq(t, "balance at the end", x.state().Balance, 1000-40-30)
}

// cost may exceed the hold (debt is allowed up to what the hold missed).
func exerciseFinishCostAboveHold(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 100, true)
	x.mustReserve("a", 100)
	eq(t, "finished", x.finish("a", 150), true)
	st := x.state()
	eq(t, "balance in debt", st.Balance, -50)
	eq(t, "held", st.Held, 150)
	x.mustRefuse("reserve in debt", "b", 1, balance.ErrInsufficient)
	eq(t, "settle", x.charge("a", 150)[0], balance.Applied)
	x.invariant()
	eq(t, "balance after settle", x.state().Balance, -50)
}

// A zero cost leaves a zero hold, so that settle still tombstones it (and a seed over it,
// which subtracts every hold, still works: '-0' is not an integer to Redis).
func exerciseFinishZeroCost(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	eq(t, "finished", x.finish("a", 0), true)
	st := x.state()
	eq(t, "balance", st.Balance, 1000)
	eq(t, "held", st.Held, 0)
	eq(t, "holds", st.Holds, 1)
	eq(t, "hold amount", x.holdAmount("a"), "0")
	x.reseed() // over a zero hold
	x.invariant()
	eq(t, "balance after reseed", x.state().Balance, 1000)
	eq(t, "settle", x.charge("a", 0)[0], balance.Applied)
	x.invariant()
	eq(t, "tombstone", x.inGone("a"), true)
	eq(t, "holds after settle", x.state().Holds, 0)
	x.mustRefuse("re-sent reserve after a zero-cost settle", "a", 10, balance.ErrGone)
}

// The per-org cap counts only unfinished, unpinned holds.
func exerciseFinishLeavesInFlightCount(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{MaxInFlight: 3}, 1000, true)
	for i := range 3 {
		x.mustReserve(fmt.Sprint("h", i), 10)
	}
	x.mustRefuse("4th hold", "h3", 10, balance.ErrTooManyHolds)
	eq(t, "finished", x.finish("h0", 4), true)
	x.mustReserve("h3", 10)
	x.mustRefuse("5th hold", "h4", 10, balance.ErrTooManyHolds)
	n, err := x.s.FinishBatch(x.ctx, []balance.Finish{
		{Org: x.org, HoldID: "h1", Cost: 1}, {Org: x.org, HoldID: "h2", Cost: 2}, {Org: x.org, HoldID: "h1", Cost: 1},
	})
	eq(t, "finished in a batch", n, 2)
	eq(t, "err", err, nil)
	x.invariant()
	x.mustReserve("h4", 10)
	x.mustReserve("h5", 10)
	x.mustRefuse("7th hold", "h6", 10, balance.ErrTooManyHolds)
	st := x.state()
	eq(t, "holds", st.Holds, 6)
	eq(t, "finished", st.Finished, 3)
	eq(t, "in flight", st.InFlight(), 3)
	eq(t, "balance", st.Balance, 1000-7-30)
}

// Its expiry becomes max(current, now + the settle deadline).
func exerciseFinishExpiry(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute, SettleDeadline: 5 * time.Minute, PinTTL: time.Hour}, 1000, true)
	x.mustReserve("a", 10)
	x.finish("a", 5)
	e, _ := x.score(x.keys().Hfin, "a")
	near(t, "finished expiry", fromNow(e), 5*time.Minute)
	x.mustReserve("pinned", 10)
	if ok, err := x.s.Pin(x.ctx, x.org, "pinned"); !ok || err != nil {
		t.Fatalf("pin: %v %v", ok, err)
	}
	p, _ := x.score(x.keys().Hexp, "pinned")
	x.finish("pinned", 5)
	pf, _ := x.score(x.keys().Hfin, "pinned")
	eq(t, "a pinned expiry kept", pf, p)
	eq(t, "still pinned", x.state().Pinned, 1)

	y := fixture(t, env, balance.Config{HoldTTL: time.Minute, SettleDeadline: time.Second}, 1000, true)
	y.mustReserve("b", 10)
	cur, _ := y.score("hexp", "b")
	y.finish("b", 5)
	got, _ := y.score("hfin", "b")
	eq(t, "a later current expiry kept", got, cur)
}

// With no acct, finish touches no balance (the next seed subtracts the finished hold).
func exerciseFinishNoAcct(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "finished", x.finish("a", 30), true)
	eq(t, "acct not re-created", x.exists(x.keys().Acct), false)
	st := x.state()
	eq(t, "held", st.Held, 30)
	eq(t, "finished holds", st.Finished, 1)
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	x.invariant()
	eq(t, "balance after seed", x.state().Balance, 970)
	eq(t, "settle", x.charge("a", 30)[0], balance.Applied)
	x.invariant()
	eq(t, "balance after settle", x.state().Balance, 970)

	// The entry already in the snapshot: settle answers already and gives the hold back.
	x.mustReserve("b", 100)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "finished", x.finish("b", 20), true)
	e := x.l.Add(x.org, -20, "b")
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	x.invariant()
	eq(t, "balance after seed", x.state().Balance, 950-20)
	st2, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
	eq(t, "err", err, nil)
	eq(t, "status", st2[0], balance.Already)
	x.invariant()
	eq(t, "balance after settle", x.state().Balance, 950)
	eq(t, "holds", x.state().Holds, 0)
}

// Extend never touches a finished hold.
func exerciseFinishedExtendUntouched(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute, SettleDeadline: time.Second}, 1000, true)
	x.mustReserve("a", 10)
	x.finish("a", 3)
	e0, _ := x.score(x.keys().Hfin, "a")
	time.Sleep(5 * time.Millisecond)
	ok, err := x.s.Extend(x.ctx, x.org, "a")
	eq(t, "extend reports the hold", ok, true)
	eq(t, "err", err, nil)
	e1, _ := x.score(x.keys().Hfin, "a")
	eq(t, "expiry untouched", e1, e0)
	if _, ok := x.score(x.keys().Hexp, "a"); ok {
		t.Fatal("extend moved a finished hold back in flight")
	}
}

// Pin and unpin act on finished holds without counting them as in flight.
func exerciseFinishedPinUnpin(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{MaxInFlight: 1, HoldTTL: time.Minute, SettleDeadline: 2 * time.Minute, PinTTL: time.Hour}, 1000, true)
	x.mustReserve("a", 10)
	x.finish("a", 3)
	ok, err := x.s.Pin(x.ctx, x.org, "a")
	eq(t, "pinned", ok, true)
	eq(t, "err", err, nil)
	p, _ := x.score(x.keys().Hfin, "a")
	near(t, "pinned finished expiry", fromNow(p), time.Hour)
	st := x.state()
	eq(t, "pinned count", st.Pinned, 1)
	eq(t, "in flight", st.InFlight(), 0)
	x.mustReserve("b", 10) // the cap of 1 sees no request in flight
	x.mustRefuse("2nd request in flight", "c", 10, balance.ErrTooManyHolds)
	ok, err = x.s.Unpin(x.ctx, x.org, "a")
	eq(t, "unpinned", ok, true)
	eq(t, "err", err, nil)
	u, _ := x.score(x.keys().Hfin, "a")
	near(t, "unpinned finished expiry", fromNow(u), 2*time.Minute)
	if _, ok := x.score(x.keys().Hexp, "a"); ok {
		t.Fatal("unpin moved a finished hold back in flight")
	}
	st = x.state()
	eq(t, "pinned count after unpin", st.Pinned, 0)
	eq(t, "finished", st.Finished, 1)
	x.invariant()
}

// Finished holds are not exempt from reaping: an expired one is released only when the
// ledger has no unsettled usage for it, never while pinned.
func exerciseFinishedReapRules(t *testing.T, env Env) {
	t.Parallel()
	// Expiries of a minute, which the test passes with age, not a sleep: the early reap runs
	// before them however slow the machine (a short TTL raced the setup).
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute, SettleDeadline: 90 * time.Second, PinTTL: time.Hour, ReapGrace: 50 * time.Millisecond}, 1000, true)
	for _, id := range []string{"usage", "pinned", "phantom", "dead"} {
		x.mustReserve(id, 100)
		x.finish(id, 40)
	}
	eq(t, "balance after finishes", x.state().Balance, 1000-4*40)
	x.reapNothingYet()
	x.l.SetErr(nil)
	n, err := x.s.Reap(x.ctx, x.org)
	eq(t, "reaped", n, 2)
	eq(t, "err", err, nil)
	x.invariant()
	st := x.state()
	eq(t, "holds", st.Holds, 2)
	eq(t, "finished", st.Finished, 2)
	eq(t, "balance", st.Balance, 1000-2*40)
	eq(t, "phantom tombstoned", x.inGone("phantom"), true)
	eq(t, "dead tombstoned", x.inGone("dead"), true)
	for _, id := range []string{"usage", "pinned"} {
		if x.holdAmount(id) == "" {
			t.Fatalf("finished hold %s reaped", id)
		}
	}
	x.reapUsageAndPinned()
	x.invariant()
	st = x.state()
	eq(t, "balance", st.Balance, 1000)
	eq(t, "holds", st.Holds, 0)
}

// Release gives a finished hold (its cost) back, once, and tombstones it.
func exerciseFinishedRelease(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	x.finish("a", 30)
	ok, err := x.s.Release(x.ctx, x.org, "a")
	eq(t, "released", ok, true)
	eq(t, "err", err, nil)
	x.invariant()
	st := x.state()
	eq(t, "balance", st.Balance, 1000)
	eq(t, "holds", st.Holds, 0)
	eq(t, "hfin emptied", x.exists(x.keys().Hfin), false)
	ok, _ = x.s.Release(x.ctx, x.org, "a")
	eq(t, "released twice", ok, false)
	x.mustRefuse("re-sent reserve", "a", 100, balance.ErrGone)
	eq(t, "finish after release", x.finish("a", 30), false)
	eq(t, "balance at the end", x.state().Balance, 1000)
}

// The reaper's SCAN backstop finds an org whose only holds are finished.
func exerciseScanOrgsFindsFinished(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{ScanPause: time.Microsecond}, 1000, true)
	x.mustReserve("a", 10)
	x.finish("a", 1)
	eq(t, "hexp gone with its last member", x.exists(x.keys().Hexp), false)
	var found atomic.Bool // fn runs on every master at once in a Cluster
	err := x.s.ScanOrgs(x.ctx, func(org string) error {
		if org == x.org {
			found.Store(true)
		}
		return nil
	})
	eq(t, "err", err, nil)
	eq(t, "found", found.Load(), true)
}

func exerciseFinishValidation(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("a", 100)
	for _, c := range []int64{-1, balance.MaxAmount + 1} {
		if _, err := x.s.Finish(x.ctx, x.org, "a", c); !errors.Is(err, balance.ErrInvalidAmount) {
			t.Fatalf("cost %d: %v, want ErrInvalidAmount", c, err)
		}
	}
	if _, err := x.s.Finish(x.ctx, "a{b}", "a", 1); !errors.Is(err, balance.ErrInvalidOrg) {
		t.Fatalf("bad org: %v", err)
	}
	if _, err := x.s.Finish(x.ctx, x.org, "", 1); !errors.Is(err, balance.ErrInvalidHoldID) {
		t.Fatalf("bad hold id: %v", err)
	}
	// A bad entry anywhere in a batch refuses the whole batch before anything is sent.
	if _, err := x.s.FinishBatch(x.ctx, []balance.Finish{{Org: x.org, HoldID: "a", Cost: 1}, {Org: x.org, HoldID: "a", Cost: -1}}); !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("batch with a bad cost: %v", err)
	}
	// The script refuses a malformed cost anywhere in its arguments before writing anything.
	keys := []string{x.keys().Acct, x.keys().Holds, x.keys().Hexp, x.keys().Hfin, x.keys().U}
	for _, c := range []string{"-5", "1.5", "abc", "", "1e3"} {
		if err := x.env.Client.Eval(x.ctx, lua.Finish, keys, "1000", "a", "1", "a", c).Err(); err == nil {
			t.Fatalf("script accepted cost %q", c)
		}
	}
	st := x.state()
	eq(t, "balance", st.Balance, 900)
	eq(t, "finished", st.Finished, 0)
	eq(t, "hold amount", x.holdAmount("a"), "100")
}

// One batch, several orgs and more holds than one script call takes.
func exerciseFinishBatchManyOrgs(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{MaxInFlight: 1000}, 100_000, true)
	other := randomID("org")
	x.l.Add(other, 1000, "")
	var fs []balance.Finish
	for i := range 300 {
		id := fmt.Sprint("h", i)
		x.mustReserve(id, 100)
		fs = append(fs, balance.Finish{Org: x.org, HoldID: id, Cost: 10})
	}
	for i := range 5 {
		id := fmt.Sprint("o", i)
		if _, err := x.s.Reserve(x.ctx, balance.ReserveRequest{Org: other, HoldID: id, Amount: 100}); err != nil {
			t.Fatal(err)
		}
		fs = append(fs, balance.Finish{Org: other, HoldID: id, Cost: 1})
	}
	fs = append(fs, balance.Finish{Org: randomID("cold"), HoldID: "x", Cost: 1}, fs[0])
	n, err := x.s.FinishBatch(x.ctx, fs)
	eq(t, "finished", n, 305)
	eq(t, "err", err, nil)
	x.invariant()
	st := x.state()
	eq(t, "balance", st.Balance, 100_000-300*10)
	eq(t, "finished holds", st.Finished, 300)
	ost, err := x.s.State(x.ctx, other)
	eq(t, "err", err, nil)
	ost.Oldest = time.Time{} // a reserve time (State's grants field)
	eq(t, "other org", ost, balance.State{Exists: true, Balance: 1000 - 5, Watermark: 1, Epoch: x.l.CurrentEpoch(), Held: 5, Holds: 5, Finished: 5})
}

// pastExpiry is how far age moves the holds of reapNothingYet and reapUsageAndPinned: past
// their expiry (a HoldTTL or SettleDeadline of a minute or two) and the grace, short of a pin's
// hour.
const pastExpiry = 5 * time.Minute

// age moves the expiry of every hold of the org d into the past (their scores in hexp and hfin,
// the only place a hold's expiry is kept): for those holds, as if d had passed on the Redis
// clock. An expiry is reached without a sleep, and a short TTL never races a slow setup.
func (x *h) age(d time.Duration) {
	x.t.Helper()
	k := x.keys()
	for _, key := range []string{k.Hexp, k.Hfin} {
		zs, err := x.env.Client.ZRangeWithScores(x.ctx, key, 0, -1).Result()
		if err != nil {
			x.t.Fatalf("zrange %s: %v", key, err)
		}
		for _, z := range zs {
			if err := x.env.Client.ZIncrBy(x.ctx, key, -float64(d.Milliseconds()), z.Member.(string)).Err(); err != nil {
				x.t.Fatalf("zincrby %s: %v", key, err)
			}
		}
	}
}

// reapNothingYet marks hold "usage" as having unsettled usage in the ledger and pins hold
// "pinned", then checks that a reap releases nothing before the holds have expired past the
// grace, nor after (age: pastExpiry) while the ledger is down. It leaves the ledger down.
func (x *h) reapNothingYet() {
	x.t.Helper()
	x.l.SetUnsettled(true, "usage")
	if ok, err := x.s.Pin(x.ctx, x.org, "pinned"); !ok || err != nil {
		x.t.Fatalf("pin: %v %v", ok, err)
	}
	if n, err := x.s.Reap(x.ctx, x.org); n != 0 || err != nil {
		x.t.Fatalf("early reap: %d %v", n, err)
	}
	x.age(pastExpiry)
	x.l.SetErr(errors.New("ledger down"))
	if n, err := x.s.Reap(x.ctx, x.org); n != 0 || err == nil {
		x.t.Fatalf("reap with the ledger down: %d %v, want 0 and an error", n, err)
	}
}

// reapUsageAndPinned settles the usage of hold "usage" and unpins hold "pinned" (the two holds
// a reaper had to keep), ages them past their expiry, and checks that a reap now releases both.
func (x *h) reapUsageAndPinned() {
	x.t.Helper()
	x.l.SetUnsettled(false, "usage")
	if _, err := x.s.Unpin(x.ctx, x.org, "pinned"); err != nil {
		x.t.Fatal(err)
	}
	x.age(pastExpiry)
	n, err := x.s.Reap(x.ctx, x.org)
	eq(x.t, "reaped", n, 2)
	eq(x.t, "err", err, nil)
}
