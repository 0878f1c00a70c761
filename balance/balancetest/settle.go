package balancetest

import (
	"errors"
	"fmt"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

func exerciseSettleInOrder(t *testing.T, env Env) {
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
}

func exerciseSettleAlreadyGivesBackHold(t *testing.T, env Env) {
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
}

func exerciseSettleGap(t *testing.T, env Env) {
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
}

func exerciseSettleCold(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, false)
	x.l.Add(x.org, -5, "")
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), x.l.Entries(x.org, 0))
	if !errors.Is(err, balance.ErrCold) {
		t.Fatalf("got %v, want ErrCold", err)
	}
	eq(t, "statuses", fmt.Sprint(st), fmt.Sprint([]balance.SettleStatus{balance.Cold, balance.Cold}))
	eq(t, "still cold", x.state().Exists, false)
	n, err := x.env.Client.Exists(x.ctx, x.keys().Acct, x.keys().Gone).Result()
	eq(t, "no key written", n, 0)
	eq(t, "err", err, nil)
}

func exerciseSettleValidation(t *testing.T, env Env) {
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
}
