package balancetest

import (
	"errors"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

func exerciseSeedSubtractsHolds(t *testing.T, env Env) {
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
}

func exerciseSeedNoOpSameEpoch(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	seeded, err := x.s.Seed(x.ctx, x.org, balance.Snapshot{Epoch: x.l.CurrentEpoch(), Balance: 5, Seq: 9})
	eq(t, "seeded", seeded, false)
	eq(t, "err", err, nil)
	st := x.state()
	eq(t, "balance", st.Balance, 1000)
	eq(t, "watermark", st.Watermark, 1)
}

func exerciseLowerGenerationNeverReplacesHigher(t *testing.T, env Env) {
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
}

func exerciseStaleSnapshotHealedByCatchUp(t *testing.T, env Env) {
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
}

func exerciseInvalidateKeepsHolds(t *testing.T, env Env) {
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
}
