package balancetest

import (
	"context"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

func exerciseExtendNeverLowers(t *testing.T, env Env) {
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
}

func exercisePinUnpin(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{HoldTTL: time.Minute, PinTTL: time.Hour}, 1000, true)
	x.mustReserve("a", 10)
	ok, err := x.s.Pin(x.ctx, x.org, "a")
	eq(t, "pinned", ok, true)
	eq(t, "err", err, nil)
	eq(t, "pinned count", x.state().Pinned, 1)
	x.expiresIn("pinned", "a", time.Hour, 10*time.Minute)
	ok, err = x.s.Unpin(x.ctx, x.org, "a")
	eq(t, "unpinned", ok, true)
	eq(t, "err", err, nil)
	eq(t, "pinned count", x.state().Pinned, 0)
	x.expiresIn("unpinned", "a", time.Minute, 10*time.Second)
	for _, f := range []func(context.Context, string, string) (bool, error){x.s.Pin, x.s.Unpin} {
		ok, err := f(x.ctx, x.org, "missing")
		eq(t, "missing hold", ok, false)
		eq(t, "err", err, nil)
	}
	if _, found := x.expiry("missing"); found {
		t.Fatal("pin/unpin created a hold expiry")
	}
}

// expiresIn fails the test unless the hold's expiry in hexp is want from now, give or take tol.
func (x *h) expiresIn(what, id string, want, tol time.Duration) {
	x.t.Helper()
	ms, _ := x.expiry(id)
	if d := fromNow(ms); d < want-tol || d > want+tol {
		x.t.Fatalf("%s expiry %v from now, want ≈ %v", what, d, want)
	}
}
