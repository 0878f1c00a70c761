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
}
