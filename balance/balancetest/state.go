package balancetest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

func exerciseState(t *testing.T, env Env) {
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
}

func exerciseModelMax(t *testing.T, env Env) {
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
	other, err := balance.New(x.ctx, x.env.Client, &balance.Config{Prefix: x.env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
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
}

func exerciseScanOrgs(t *testing.T, env Env) {
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
}

func exerciseExactNear1e14(t *testing.T, env Env) {
	t.Parallel()
	exactNear1e14(t, env)
}
