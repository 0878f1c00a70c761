package balancetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/lua"
)

func reserveSrc() string { return lua.Reserve }
func reapSrc() string    { return lua.Reap }

// Env is the Redis a suite runs on.
type Env struct {
	Client redis.UniversalClient
	Prefix string // a key namespace no other test uses
	Real   bool   // a real Redis server (not miniredis)
	// Coalesce runs every store of the suite with Config.Coalesce (reserves may go in pipelines).
	Coalesce bool
}

// h is one subtest's fixture: a store, its ledger double, an org of its own.
type h struct {
	t   *testing.T
	ctx context.Context
	env Env
	s   *balance.Store
	l   *FakeLedger
	org string
}

func randomID(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// fixture makes a store with cfg (Prefix and Ledger filled in unless set) and an org whose
// ledger starts with one credit of start (no credit when start is 0), warmed when warm is set.
func fixture(t *testing.T, env Env, cfg balance.Config, start int64, warm bool) *h {
	t.Helper()
	ctx := context.Background()
	l := NewFakeLedger(1)
	if cfg.Ledger == nil {
		cfg.Ledger = l
	}
	cfg.Prefix = env.Prefix
	cfg.Coalesce = cfg.Coalesce || env.Coalesce
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s, err := balance.New(ctx, env.Client, cfg)
	if err != nil {
		t.Fatalf("balance.New: %v", err)
	}
	x := &h{t: t, ctx: ctx, env: env, s: s, l: l, org: randomID("org")}
	if start != 0 {
		l.Add(x.org, start, "")
	}
	if warm {
		if err := s.Warm(ctx, x.org); err != nil {
			t.Fatalf("warm: %v", err)
		}
	}
	t.Cleanup(func() {
		if !t.Failed() {
			x.invariant()
		}
	})
	return x
}

func (x *h) key(kind string) string { return x.env.Prefix + ":{" + x.org + "}:" + kind }

// invariant asserts bal + Σ holds = B(wm) while acct exists.
func (x *h) invariant() {
	x.t.Helper()
	st, err := x.s.State(x.ctx, x.org)
	if err != nil {
		x.t.Fatalf("state: %v", err)
	}
	if !st.Exists {
		return
	}
	if want := x.l.B(x.org, st.Watermark); st.Balance+st.Held != want {
		x.t.Fatalf("invariant broken: bal %d + held %d = %d, B(wm=%d) = %d",
			st.Balance, st.Held, st.Balance+st.Held, st.Watermark, want)
	}
}

func (x *h) state() balance.State {
	x.t.Helper()
	st, err := x.s.State(x.ctx, x.org)
	if err != nil {
		x.t.Fatalf("state: %v", err)
	}
	return st
}

func (x *h) reserve(id string, amount int64) (balance.Reservation, error) {
	return x.s.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: id, Amount: amount})
}

func (x *h) mustReserve(id string, amount int64) balance.Reservation {
	x.t.Helper()
	r, err := x.reserve(id, amount)
	if err != nil {
		x.t.Fatalf("reserve %s %d: %v", id, amount, err)
	}
	return r
}

// charge records usage of hold id costing cost in the ledger and settles it.
func (x *h) charge(id string, cost int64) []balance.SettleStatus {
	x.t.Helper()
	e := x.l.Add(x.org, -cost, id)
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
	if err != nil {
		x.t.Fatalf("settle: %v", err)
	}
	return st
}

func (x *h) expiry(id string) (float64, bool) {
	x.t.Helper()
	v, err := x.env.Client.ZScore(x.ctx, x.key("hexp"), id).Result()
	if errors.Is(err, redis.Nil) {
		return 0, false
	}
	if err != nil {
		x.t.Fatalf("zscore: %v", err)
	}
	return v, true
}

func (x *h) inGone(id string) bool {
	x.t.Helper()
	_, err := x.env.Client.ZScore(x.ctx, x.key("gone"), id).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		x.t.Fatalf("zscore gone: %v", err)
	}
	return err == nil
}

func eq[T comparable](t *testing.T, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %v, want %v", what, got, want)
	}
}

// Run is the conformance suite of package balance: every rule of every script, on env.
func Run(t *testing.T, env Env) {
	t.Run("ReserveOK", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		r := x.mustReserve("h1", 300)
		eq(t, "balance", r.Balance, 700)
		eq(t, "duplicate", r.Duplicate, false)
		st := x.state()
		eq(t, "held", st.Held, 300)
		eq(t, "holds", st.Holds, 1)
		if _, ok := x.expiry("h1"); !ok {
			t.Fatal("hold has no expiry")
		}
		eq(t, "held orgs", fmt.Sprint(x.s.HeldOrgs()), fmt.Sprint([]string{x.org}))
	})

	t.Run("ReserveInvalid", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		for _, a := range []int64{0, -1, balance.MaxAmount + 1} {
			if _, err := x.reserve("h", a); !errors.Is(err, balance.ErrInvalidAmount) {
				t.Fatalf("amount %d: got %v, want ErrInvalidAmount", a, err)
			}
		}
		for _, org := range []string{"", "a{b}", "a:b", "a b", "tab\t", strings.Repeat("a", 129)} {
			_, err := x.s.Reserve(x.ctx, balance.ReserveRequest{Org: org, HoldID: "h", Amount: 1})
			if !errors.Is(err, balance.ErrInvalidOrg) {
				t.Fatalf("org %q: got %v, want ErrInvalidOrg", org, err)
			}
		}
		if _, err := x.reserve("", 1); !errors.Is(err, balance.ErrInvalidHoldID) {
			t.Fatalf("empty hold id: %v", err)
		}
		eq(t, "balance", x.state().Balance, 1000)
	})

	t.Run("ScriptRefusesNonPositiveAmount", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		keys := []string{x.key("acct"), x.key("holds"), x.key("hexp"), x.key("gone"), x.key("lim"), x.key("u")}
		for _, a := range []string{"0", "-5", "1.5", "abc"} {
			err := x.env.Client.Eval(x.ctx, reserveSrc(), keys, x.s.Epoch().String(), "h", a, "1000", "10", "1000", "1000", "", "0").Err()
			if err == nil {
				t.Fatalf("script accepted amount %q", a)
			}
		}
		eq(t, "balance", x.state().Balance, 1000)
		eq(t, "holds", x.state().Holds, 0)
	})

	t.Run("ReserveColdNoLedger", func(t *testing.T) {
		t.Parallel()
		s, err := balance.New(context.Background(), env.Client, balance.Config{Prefix: env.Prefix})
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.Reserve(context.Background(), balance.ReserveRequest{Org: randomID("org"), HoldID: "h", Amount: 1})
		if !errors.Is(err, balance.ErrCold) {
			t.Fatalf("got %v, want ErrCold", err)
		}
	})

	t.Run("ReserveColdWarmsOnce", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 500, false)
		x.l.SnapshotDelay = 20 * time.Millisecond
		var wg sync.WaitGroup
		var ok atomic.Int64
		for i := range 20 {
			wg.Go(func() {
				if _, err := x.reserve(fmt.Sprint("h", i), 10); err == nil {
					ok.Add(1)
				} else {
					t.Errorf("reserve: %v", err)
				}
			})
		}
		wg.Wait()
		eq(t, "granted", ok.Load(), 20)
		eq(t, "balance", x.state().Balance, 300)
		// Concurrent warm-ups of one org are collapsed into one snapshot at a time.
		if n, m := x.l.Snapshots.Load(), x.l.MaxConcurrentSnapshots(); n < 1 || n >= 20 || m != 1 {
			t.Fatalf("%d snapshots, %d at once, for 20 reserves on one cold org", n, m)
		}
	})

	t.Run("ReserveOtherEpochIsCold", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 500, true)
		other := balance.Epoch{Gen: x.l.CurrentEpoch().Gen, ID: "other"}
		keys := []string{x.key("acct"), x.key("holds"), x.key("hexp"), x.key("gone"), x.key("lim"), x.key("u")}
		res, err := x.env.Client.Eval(x.ctx, reserveSrc(), keys, other.String(), "h", "10", "1000", "10", "1000", "1000", "", "0").Slice()
		if err != nil {
			t.Fatal(err)
		}
		eq(t, "reply", res[0].(string), "COLD")
		eq(t, "balance", x.state().Balance, 500)
		eq(t, "holds", x.state().Holds, 0)
	})

	t.Run("Duplicate", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("h1", 100)
		r := x.mustReserve("h1", 100)
		eq(t, "duplicate", r.Duplicate, true)
		eq(t, "balance reported", r.Balance, 900)
		eq(t, "balance", x.state().Balance, 900)
		eq(t, "held", x.state().Held, 100)
	})

	t.Run("GoneAfterRelease", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("h1", 100)
		ok, err := x.s.Release(x.ctx, x.org, "h1")
		eq(t, "released", ok, true)
		eq(t, "err", err, nil)
		if _, err := x.reserve("h1", 100); !errors.Is(err, balance.ErrGone) {
			t.Fatalf("re-sent reserve: %v, want ErrGone", err)
		}
		eq(t, "balance", x.state().Balance, 1000)
	})

	t.Run("GoneAfterSettle", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("h1", 100)
		eq(t, "status", x.charge("h1", 40)[0], balance.Applied)
		if _, err := x.reserve("h1", 100); !errors.Is(err, balance.ErrGone) {
			t.Fatalf("re-sent reserve: %v, want ErrGone", err)
		}
		eq(t, "balance", x.state().Balance, 960)
	})

	t.Run("TooManyCountsOnlyUnpinned", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{MaxInFlight: 3}, 1000, true)
		for i := range 3 {
			x.mustReserve(fmt.Sprint("h", i), 10)
		}
		if _, err := x.reserve("h3", 10); !errors.Is(err, balance.ErrTooManyHolds) {
			t.Fatalf("4th hold: %v, want ErrTooManyHolds", err)
		}
		if ok, err := x.s.Pin(x.ctx, x.org, "h0"); !ok || err != nil {
			t.Fatalf("pin: %v %v", ok, err)
		}
		x.mustReserve("h3", 10)
		if _, err := x.reserve("h4", 10); !errors.Is(err, balance.ErrTooManyHolds) {
			t.Fatalf("5th hold: %v, want ErrTooManyHolds", err)
		}
		st := x.state()
		eq(t, "holds", st.Holds, 4)
		eq(t, "pinned", st.Pinned, 1)
		eq(t, "balance", st.Balance, 960)
	})

	t.Run("Insufficient", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 100, true)
		x.mustReserve("h1", 60)
		_, err := x.reserve("h2", 41)
		var ie *balance.InsufficientError
		if !errors.As(err, &ie) || !errors.Is(err, balance.ErrInsufficient) {
			t.Fatalf("got %v, want *InsufficientError", err)
		}
		eq(t, "reported balance", ie.Balance, 40)
		eq(t, "reported amount", ie.Amount, 41)
		x.mustReserve("h2", 40) // exactly the balance is fine
		eq(t, "balance", x.state().Balance, 0)
	})

	t.Run("SeedSubtractsHolds", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("h1", 100)
		x.mustReserve("h2", 50)
		if err := x.s.Invalidate(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		eq(t, "exists after invalidate", x.state().Exists, false)
		eq(t, "holds after invalidate", x.state().Holds, 2)
		x.l.Add(x.org, 500, "") // a recharge
		if err := x.s.Warm(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		st := x.state()
		eq(t, "balance", st.Balance, 1500-150)
		eq(t, "watermark", st.Watermark, 2)
		ok, err := x.s.Release(x.ctx, x.org, "h1")
		eq(t, "released", ok, true)
		eq(t, "err", err, nil)
		eq(t, "balance after release", x.state().Balance, 1450)
	})

	t.Run("SeedNoOpSameEpoch", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		seeded, err := x.s.Seed(x.ctx, x.org, balance.Snapshot{Epoch: x.l.CurrentEpoch(), Balance: 5, Seq: 9})
		eq(t, "seeded", seeded, false)
		eq(t, "err", err, nil)
		st := x.state()
		eq(t, "balance", st.Balance, 1000)
		eq(t, "watermark", st.Watermark, 1)
	})

	t.Run("LowerGenerationNeverReplacesHigher", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 0, false)
		hi := balance.Epoch{Gen: 5, ID: "hi"}
		lo := balance.Epoch{Gen: 4, ID: "lo"}
		x.l.SetEpoch(hi)
		x.l.Add(x.org, 1000, "")
		if err := x.s.Warm(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		seeded, err := x.s.Seed(x.ctx, x.org, balance.Snapshot{Epoch: lo, Balance: 7, Seq: 0})
		eq(t, "older seed", seeded, false)
		eq(t, "err", err, nil)
		st, err := x.s.Settle(x.ctx, x.org, lo, []balance.Entry{{Seq: 2, Delta: -10}})
		if !errors.Is(err, balance.ErrCold) || st[0] != balance.Cold {
			t.Fatalf("older settle: %v %v, want cold", st, err)
		}
		got := x.state()
		eq(t, "acct kept", got.Exists, true)
		eq(t, "epoch kept", got.Epoch, hi)
		eq(t, "balance", got.Balance, 1000)
		// The process cache never goes back either.
		x.s.ObserveEpoch(lo)
		eq(t, "cached epoch", x.s.Epoch(), hi)
		// A newer epoch drops acct.
		newer := balance.Epoch{Gen: 6, ID: "new"}
		st, err = x.s.Settle(x.ctx, x.org, newer, []balance.Entry{{Seq: 2, Delta: -10}})
		if !errors.Is(err, balance.ErrCold) || st[0] != balance.Cold {
			t.Fatalf("newer settle: %v %v, want cold", st, err)
		}
		eq(t, "acct dropped by a newer epoch", x.state().Exists, false)
		x.l.SetEpoch(newer)
	})

	t.Run("SettleInOrder", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("a", 100)
		x.mustReserve("b", 100)
		ea := x.l.Add(x.org, -30, "a")
		eb := x.l.Add(x.org, -150, "b") // cost more than its hold: debt is allowed
		ec := x.l.Add(x.org, 20, "")    // a credit
		st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{ea, eb, ec})
		eq(t, "err", err, nil)
		eq(t, "statuses", fmt.Sprint(st), fmt.Sprint([]balance.SettleStatus{balance.Applied, balance.Applied, balance.Applied}))
		s := x.state()
		eq(t, "balance", s.Balance, 1000-30-150+20)
		eq(t, "watermark", s.Watermark, 4)
		eq(t, "holds", s.Holds, 0)
		eq(t, "tombstone a", x.inGone("a"), true)
		eq(t, "tombstone b", x.inGone("b"), true)
	})

	t.Run("SettleAlreadyGivesBackHold", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("a", 100)
		// The usage is accounted and the org reseeded from a snapshot that already has it.
		e := x.l.Add(x.org, -30, "a")
		if err := x.s.Invalidate(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		if _, err := x.s.Seed(x.ctx, x.org, mustSnap(t, x.l, x.org)); err != nil {
			t.Fatal(err)
		}
		eq(t, "balance after seed", x.state().Balance, 970-100)
		st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
		eq(t, "err", err, nil)
		eq(t, "status", st[0], balance.Already)
		eq(t, "balance", x.state().Balance, 970)
		eq(t, "holds", x.state().Holds, 0)
		// Again: nothing changes.
		st, err = x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e})
		eq(t, "err", err, nil)
		eq(t, "status again", st[0], balance.Already)
		eq(t, "balance again", x.state().Balance, 970)
	})

	t.Run("SettleGap", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		e2 := x.l.Add(x.org, -10, "")
		e3 := x.l.Add(x.org, -20, "")
		e4 := x.l.Add(x.org, -40, "")
		st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e3, e4})
		var ge *balance.GapError
		if !errors.As(err, &ge) || !errors.Is(err, balance.ErrGap) {
			t.Fatalf("got %v, want *GapError", err)
		}
		eq(t, "gap watermark", ge.Watermark, 1)
		eq(t, "gap seq", ge.Seq, 3)
		eq(t, "statuses", fmt.Sprint(st), fmt.Sprint([]balance.SettleStatus{balance.Gap, balance.NotReached}))
		eq(t, "balance unchanged", x.state().Balance, 1000)
		// Applied up to the gap, then stop.
		st, err = x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e2, e4})
		if !errors.As(err, &ge) || ge.Watermark != 2 {
			t.Fatalf("got %v, want gap at watermark 2", err)
		}
		eq(t, "statuses", fmt.Sprint(st), fmt.Sprint([]balance.SettleStatus{balance.Applied, balance.Gap}))
		if err := x.s.CatchUp(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		s := x.state()
		eq(t, "balance healed", s.Balance, 1000-70)
		eq(t, "watermark healed", s.Watermark, 4)
	})

	t.Run("SettleCold", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, false)
		x.l.Add(x.org, -5, "")
		st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), x.l.Entries(x.org, 0))
		if !errors.Is(err, balance.ErrCold) {
			t.Fatalf("got %v, want ErrCold", err)
		}
		eq(t, "statuses", fmt.Sprint(st), fmt.Sprint([]balance.SettleStatus{balance.Cold, balance.Cold}))
		eq(t, "still cold", x.state().Exists, false)
		n, err := x.env.Client.Exists(x.ctx, x.key("acct"), x.key("gone")).Result()
		eq(t, "no key written", n, 0)
		eq(t, "err", err, nil)
	})

	t.Run("SettleValidation", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		ep := x.l.CurrentEpoch()
		for _, es := range [][]balance.Entry{
			{{Seq: 0, Delta: 1}},
			{{Seq: 3, Delta: 1}, {Seq: 2, Delta: 1}},
			{{Seq: 2, Delta: balance.MaxAmount + 1}},
			{{Seq: 2, Delta: 1, HoldID: "a b"}},
		} {
			if _, err := x.s.Settle(x.ctx, x.org, ep, es); !errors.Is(err, balance.ErrInvalidEntry) {
				t.Fatalf("%v: got %v, want ErrInvalidEntry", es, err)
			}
		}
	})

	t.Run("StaleSnapshotHealedByCatchUp", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, false)
		x.l.Add(x.org, -100, "u1")
		x.l.Add(x.org, 300, "")
		x.l.SetStale(2) // the snapshot misses the last two entries
		if err := x.s.Warm(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		st := x.state()
		eq(t, "balance", st.Balance, 1200)
		eq(t, "watermark", st.Watermark, 3)
	})

	t.Run("ReleaseWithoutAcct", func(t *testing.T) {
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
	})

	t.Run("ReleaseRacesReaper", func(t *testing.T) {
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
	})

	t.Run("ExtendNeverLowers", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{HoldTTL: time.Minute}, 1000, true)
		x.mustReserve("a", 10)
		e0, _ := x.expiry("a")
		time.Sleep(5 * time.Millisecond)
		ok, err := x.s.Extend(x.ctx, x.org, "a")
		eq(t, "extended", ok, true)
		eq(t, "err", err, nil)
		e1, _ := x.expiry("a")
		if e1 <= e0 {
			t.Fatalf("extend did not raise the expiry: %v → %v", e0, e1)
		}
		// A later expiry (pinned) is never lowered by extend.
		if ok, err := x.s.Pin(x.ctx, x.org, "a"); !ok || err != nil {
			t.Fatalf("pin: %v %v", ok, err)
		}
		p, _ := x.expiry("a")
		ok, err = x.s.Extend(x.ctx, x.org, "a")
		eq(t, "extend pinned", ok, true)
		eq(t, "err", err, nil)
		e2, _ := x.expiry("a")
		eq(t, "pinned expiry kept", e2, p)
		ok, err = x.s.Extend(x.ctx, x.org, "missing")
		eq(t, "extend missing", ok, false)
		eq(t, "err", err, nil)
		if _, found := x.expiry("missing"); found {
			t.Fatal("extend created a hold expiry")
		}
	})

	t.Run("PinUnpin", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{HoldTTL: time.Minute, PinTTL: time.Hour}, 1000, true)
		x.mustReserve("a", 10)
		ok, err := x.s.Pin(x.ctx, x.org, "a")
		eq(t, "pinned", ok, true)
		eq(t, "err", err, nil)
		eq(t, "pinned count", x.state().Pinned, 1)
		p, _ := x.expiry("a")
		if d := time.Duration(p)*time.Millisecond - time.Duration(time.Now().UnixMilli())*time.Millisecond; d < 50*time.Minute || d > 70*time.Minute {
			t.Fatalf("pinned expiry %v from now, want ≈ 1h", d)
		}
		ok, err = x.s.Unpin(x.ctx, x.org, "a")
		eq(t, "unpinned", ok, true)
		eq(t, "err", err, nil)
		eq(t, "pinned count", x.state().Pinned, 0)
		u, _ := x.expiry("a")
		if d := time.Duration(u)*time.Millisecond - time.Duration(time.Now().UnixMilli())*time.Millisecond; d < 50*time.Second || d > 70*time.Second {
			t.Fatalf("unpinned expiry %v from now, want ≈ 1m", d)
		}
		for _, f := range []func(context.Context, string, string) (bool, error){x.s.Pin, x.s.Unpin} {
			ok, err := f(x.ctx, x.org, "missing")
			eq(t, "missing hold", ok, false)
			eq(t, "err", err, nil)
		}
		if _, found := x.expiry("missing"); found {
			t.Fatal("pin/unpin created a hold expiry")
		}
	})

	t.Run("ReapRules", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{HoldTTL: 300 * time.Millisecond, PinTTL: time.Hour, ReapGrace: 50 * time.Millisecond}, 1000, true)
		x.mustReserve("usage", 100)   // usage recorded, not settled: never reaped
		x.mustReserve("pinned", 100)  // journaled: pinned
		x.mustReserve("phantom", 100) // a late re-send whose usage is settled: released
		x.mustReserve("dead", 100)    // owner died, no usage: released
		x.l.SetUnsettled(true, "usage")
		if ok, err := x.s.Pin(x.ctx, x.org, "pinned"); !ok || err != nil {
			t.Fatalf("pin: %v %v", ok, err)
		}
		// Not yet expired past the grace: nothing.
		if n, err := x.s.Reap(x.ctx, x.org); n != 0 || err != nil {
			t.Fatalf("early reap: %d %v", n, err)
		}
		time.Sleep(450 * time.Millisecond)
		// Ledger down: nothing.
		x.l.SetErr(errors.New("ledger down"))
		if n, err := x.s.Reap(x.ctx, x.org); n != 0 || err == nil {
			t.Fatalf("reap with the ledger down: %d %v, want 0 and an error", n, err)
		}
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
		x.l.SetUnsettled(false, "usage")
		if _, err := x.s.Unpin(x.ctx, x.org, "pinned"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(450 * time.Millisecond)
		n, err = x.s.Reap(x.ctx, x.org)
		eq(t, "reaped", n, 2)
		eq(t, "err", err, nil)
		eq(t, "balance", x.state().Balance, 1000)
		if _, err := x.s.Reap(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		eq(t, "held orgs after all reaped", len(x.s.HeldOrgs()), 0)
	})

	t.Run("ReapScriptRechecksExpiry", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{HoldTTL: time.Minute}, 1000, true)
		x.mustReserve("live", 100)
		keys := []string{x.key("acct"), x.key("holds"), x.key("hexp"), x.key("gone"), x.key("hfin"), x.key("u")}
		n, err := x.env.Client.Eval(x.ctx, reapSrc(), keys, "30000", "0", "live", "unknown").Int64()
		eq(t, "reaped", n, 0)
		eq(t, "err", err, nil)
		eq(t, "holds", x.state().Holds, 1)
	})

	t.Run("TombstoneTrim", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{TombstoneTTL: 400 * time.Millisecond}, 1000, true)
		x.mustReserve("old", 10)
		if _, err := x.s.Release(x.ctx, x.org, "old"); err != nil {
			t.Fatal(err)
		}
		eq(t, "tombstone", x.inGone("old"), true)
		ttl, err := x.env.Client.PTTL(x.ctx, x.key("gone")).Result()
		if err != nil || ttl <= 0 || ttl > 400*time.Millisecond {
			t.Fatalf("gone ttl %v %v, want (0, 400ms]", ttl, err)
		}
		time.Sleep(200 * time.Millisecond)
		x.mustReserve("new", 10)
		if _, err := x.s.Release(x.ctx, x.org, "new"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(250 * time.Millisecond)
		// A write trims what is older than the TTL; "new" is younger.
		if _, err := x.s.Release(x.ctx, x.org, "third"); err != nil {
			t.Fatal(err)
		}
		eq(t, "old trimmed", x.inGone("old"), false)
		eq(t, "new kept", x.inGone("new"), true)
	})

	t.Run("InvalidateKeepsHolds", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("a", 100)
		if err := x.s.Invalidate(x.ctx, x.org); err != nil {
			t.Fatal(err)
		}
		st := x.state()
		eq(t, "acct", st.Exists, false)
		eq(t, "held", st.Held, 100)
		// The next reserve reseeds (subtracting the live hold) and goes through.
		r := x.mustReserve("b", 100)
		eq(t, "balance", r.Balance, 800)
	})

	t.Run("State", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{}, 1000, true)
		x.mustReserve("a", 100)
		x.mustReserve("b", 23)
		st := x.state()
		want := balance.State{Exists: true, Balance: 877, Watermark: 1, Epoch: x.l.CurrentEpoch(), Held: 123, Holds: 2}
		eq(t, "state", st, want)
		empty, err := x.s.State(x.ctx, randomID("none"))
		eq(t, "empty", empty, balance.State{})
		eq(t, "err", err, nil)
	})

	t.Run("ModelMax", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{ModelMaxCacheTTL: time.Hour}, 0, false)
		m := randomID("model-")
		v, err := x.s.ModelMax(x.ctx, m)
		eq(t, "unknown", v, 0)
		eq(t, "err", err, nil)
		for _, c := range []struct{ cost, ceiling, want int64 }{
			{100, 1000, 100}, {50, 1000, 100}, {700, 1000, 700}, {5000, 1000, 1000}, {900, 1000, 1000},
		} {
			v, err := x.s.RaiseModelMax(x.ctx, m, c.cost, c.ceiling)
			eq(t, fmt.Sprintf("raise %d ceiling %d", c.cost, c.ceiling), v, c.want)
			eq(t, "err", err, nil)
		}
		v, _ = x.s.ModelMax(x.ctx, m)
		eq(t, "cached", v, 1000)
		if err := x.s.SetModelMax(x.ctx, m, 10); err != nil {
			t.Fatal(err)
		}
		v, _ = x.s.ModelMax(x.ctx, m)
		eq(t, "lowered by admin", v, 10)
		// Another process's raise shows after the cache TTL (here: a store with a tiny TTL).
		other, err := balance.New(x.ctx, x.env.Client, balance.Config{Prefix: x.env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.s.RaiseModelMax(x.ctx, m, 20, 1000); err != nil {
			t.Fatal(err)
		}
		v, _ = other.ModelMax(x.ctx, m)
		eq(t, "seen by another store", v, 20)
		if _, err := x.s.RaiseModelMax(x.ctx, m, 0, 10); !errors.Is(err, balance.ErrInvalidAmount) {
			t.Fatalf("cost 0: %v", err)
		}
		if _, err := x.s.RaiseModelMax(x.ctx, m, 10, 0); !errors.Is(err, balance.ErrInvalidAmount) {
			t.Fatalf("ceiling 0: %v", err)
		}
	})

	t.Run("ScanOrgs", func(t *testing.T) {
		t.Parallel()
		x := fixture(t, env, balance.Config{ScanPause: time.Microsecond}, 1000, true)
		x.mustReserve("a", 1)
		found := false
		err := x.s.ScanOrgs(x.ctx, func(org string) error {
			if org == x.org {
				found = true
			}
			return nil
		})
		eq(t, "err", err, nil)
		eq(t, "found", found, true)
		stop := errors.New("stop")
		if err := x.s.ScanOrgs(x.ctx, func(string) error { return stop }); !errors.Is(err, stop) {
			t.Fatalf("fn error not returned: %v", err)
		}
	})

	t.Run("ExactNear1e14", func(t *testing.T) {
		t.Parallel()
		exactNear1e14(t, env)
	})

	runFinish(t, env)
	runLimits(t, env)
}

func mustSnap(t *testing.T, l *FakeLedger, org string) balance.Snapshot {
	t.Helper()
	s, err := l.Snapshot(context.Background(), org)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// exactNear1e14 moves amounts at the ±10^14 bound through every money script. Redis formats a
// Lua number with %.14g, which is exact below 10^14 and turns 10^14 itself into "1e+14": a
// script that passed a computed balance back to Redis would fail here (on a real Redis;
// miniredis formats numbers its own way).
func exactNear1e14(t *testing.T, env Env) {
	const top = balance.MaxAmount // 100000000000000: 15 digits
	x := fixture(t, env, balance.Config{}, top, true)
	eq(t, "seeded at the bound", x.state().Balance, top)
	r := x.mustReserve("a", 1)
	eq(t, "after a hold of 1", r.Balance, top-1)
	x.mustReserve("b", 1)
	x.mustReserve("c", top-2) // the whole rest
	_, err := x.reserve("d", 1)
	var ie *balance.InsufficientError
	if !errors.As(err, &ie) || ie.Balance != 0 {
		t.Fatalf("got %v, want insufficient with 0", err)
	}
	if ok, _ := x.s.Release(x.ctx, x.org, "c"); !ok {
		t.Fatal("release c")
	}
	eq(t, "after release", x.state().Balance, top-2)
	if _, err = x.reserve("e", top); !errors.As(err, &ie) || ie.Balance != top-2 {
		t.Fatalf("got %v, want insufficient with %d", err, top-2)
	}
	// Charge 1 for a (its hold of 1 comes back), credit 1: bal = top-1 while b holds 1.
	e1 := x.l.Add(x.org, -1, "a")
	e2 := x.l.Add(x.org, 1, "")
	if _, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e1, e2}); err != nil {
		t.Fatal(err)
	}
	eq(t, "after settles", x.state().Balance, top-1)
	if ok, _ := x.s.Release(x.ctx, x.org, "b"); !ok {
		t.Fatal("release b")
	}
	eq(t, "back at the bound", x.state().Balance, top)
	// Finish moves hold − cost back at the bound: the whole balance held, a cost of 1.
	x.mustReserve("fa", top)
	if ok, err := x.s.Finish(x.ctx, x.org, "fa", 1); !ok || err != nil {
		t.Fatalf("finish fa: %v %v", ok, err)
	}
	eq(t, "after finish", x.state().Balance, top-1)
	e5 := x.l.Add(x.org, -1, "fa")
	e6 := x.l.Add(x.org, 1, "")
	if _, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e5, e6}); err != nil {
		t.Fatal(err)
	}
	eq(t, "finished hold settled", x.state().Balance, top)
	// Down to a debt of exactly -10^14.
	e3 := x.l.Add(x.org, -top, "")
	e4 := x.l.Add(x.org, -top, "")
	if _, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{e3, e4}); err != nil {
		t.Fatal(err)
	}
	eq(t, "debt at the bound", x.state().Balance, -top)
	// Reseed at -10^14.
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "reseeded in debt", x.state().Balance, -top)
	if _, err = x.reserve("f", 1); !errors.As(err, &ie) || ie.Balance != -top {
		t.Fatalf("got %v, want insufficient with %d", err, -top)
	}
	// Back up to the bound, a live hold, and a reseed that subtracts it.
	x.l.Add(x.org, top, "")
	x.l.Add(x.org, top, "")
	if err := x.s.CatchUp(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "recharged to the bound", x.state().Balance, top)
	x.mustReserve("g", top)
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	st := x.state()
	eq(t, "reseeded minus the hold", st.Balance, 0)
	eq(t, "held", st.Held, top)
	if ok, _ := x.s.Release(x.ctx, x.org, "g"); !ok {
		t.Fatal("release g")
	}
	eq(t, "released to the bound", x.state().Balance, top)
	v, err := x.s.RaiseModelMax(x.ctx, randomID("m"), top, top)
	eq(t, "model max", v, top)
	eq(t, "err", err, nil)
}
