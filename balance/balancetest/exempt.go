package balancetest

import (
	"errors"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

// exerciseReserveExempt: an exempt org's hold is a zero hold on any balance (0 here): nothing is
// debited, the in-flight count and the invariant see it like any hold; finish moves the cost into
// it and settle charges it, so the balance goes negative by exactly the costs and the invariant
// bal + Σ holds = B(wm) holds after every step. A non-zero exempt amount, and a zero amount
// that is not exempt, are refused.
func exerciseReserveExempt(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 0, true)
	exempt := func(id string, amount int64) (balance.Reservation, error) {
		return x.s.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: id, Amount: amount, Exempt: true})
	}
	if _, err := exempt("bad", 5); !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("exempt amount 5: %v, want ErrInvalidAmount", err)
	}
	x.mustRefuse("zero, not exempt", "bad", 0, balance.ErrInvalidAmount)
	if _, err := x.reserve("paid", 1); !errors.As(err, new(*balance.InsufficientError)) {
		t.Fatalf("a paid hold on a zero balance: %v", err)
	}
	for _, id := range []string{"a", "b", "c"} {
		r, err := exempt(id, 0)
		if err != nil || r.Balance != 0 {
			t.Fatalf("exempt reserve %s: %+v %v", id, r, err)
		}
		x.invariant()
	}
	st := x.state()
	eq(t, "holds", st.Holds, 3)
	eq(t, "held", st.Held, 0)
	if !x.finish("a", 40) {
		t.Fatal("finish a")
	}
	x.invariant()
	eq(t, "balance after finish", x.state().Balance, -40)
	x.charge("a", 40)
	x.charge("b", 25) // settled without a finish: the cost comes straight from the entry
	x.mustRelease("c")
	x.invariant()
	st = x.state()
	eq(t, "balance", st.Balance, -65)
	eq(t, "holds", st.Holds, 0)
	if r, err := exempt("d", 0); err != nil || r.Balance != -65 {
		t.Fatalf("exempt reserve on a negative balance: %+v %v", r, err)
	}
}
