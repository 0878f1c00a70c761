package balancetest

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

func exerciseState(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	ra := x.mustReserve("a", 100)
	x.mustReserve("b", 23)
	st := x.state()
	// Oldest (grants: an expire entry waits for older holds) is the earliest reserve time
	if !st.Oldest.Equal(ra.ReservedAt) {
		t.Fatalf("oldest hold %v, want the first reserve's %v", st.Oldest, ra.ReservedAt)
	}
	st.Oldest = time.Time{}
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
		v, err := x.s.RaiseModelMax(x.ctx, m, c.cost, 0, c.ceiling)
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
	other, err := x.env.newStore(x.ctx, &balance.Config{Prefix: x.env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.s.RaiseModelMax(x.ctx, m, 20, 0, 1000); err != nil {
		t.Fatal(err)
	}
	v, _ = other.ModelMax(x.ctx, m)
	eq(t, "seen by another store", v, 20)
	if _, err := x.s.RaiseModelMax(x.ctx, m, 0, 0, 10); !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("cost 0: %v", err)
	}
	if _, err := x.s.RaiseModelMax(x.ctx, m, 10, 0, 0); !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("ceiling 0: %v", err)
	}
}

// exerciseLearnedMaxSurvivesRedisLoss: the raise takes the ledger's max cost as a floor, so a
// learned max lost with Redis (here: its key deleted, as a flush would) is rebuilt at the
// ledger's value by the next cheap cost, never at that cost; a floor above the ceiling stands
// (it is the ledger's), and every value written is exact near the 10^14 bound.
func exerciseLearnedMaxSurvivesRedisLoss(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{ModelMaxCacheTTL: time.Nanosecond}, 0, false)
	m := randomID("model-")
	const ledgerMax, ceiling = 65, 1000
	for _, c := range []struct{ cost, want int64 }{
		{20, ledgerMax}, // missing key: rebuilt at the floor
		{30, ledgerMax}, // below what is stored
		{80, 80},        // a real raise
		{5000, ceiling}, // capped
	} {
		v, err := x.s.RaiseModelMax(x.ctx, m, c.cost, ledgerMax, ceiling)
		eq(t, fmt.Sprintf("raise %d", c.cost), v, c.want)
		eq(t, "err", err, nil)
	}
	// Redis loses the key; the next pass raises with a cheap cost.
	if err := x.s.SetModelMax(x.ctx, m, 0); err != nil {
		t.Fatal(err)
	}
	v, err := x.s.ModelMax(x.ctx, m)
	eq(t, "lost", v, 0)
	eq(t, "err", err, nil)
	v, err = x.s.RaiseModelMax(x.ctx, m, 20, ledgerMax, ceiling)
	eq(t, "raise after the loss", v, ledgerMax)
	eq(t, "err", err, nil)
	v, _ = x.s.ModelMax(x.ctx, m)
	eq(t, "read after the loss", v, ledgerMax)
	// Another store reads the key itself, not a cache.
	other, err := x.env.newStore(x.ctx, &balance.Config{Prefix: x.env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	v, _ = other.ModelMax(x.ctx, m)
	eq(t, "read by another store", v, ledgerMax)

	// The ledger's max above the bound (an admin set it so): it stands.
	m2 := randomID("model-")
	v, _ = x.s.RaiseModelMax(x.ctx, m2, 20, 1500, ceiling)
	eq(t, "floor above the ceiling", v, 1500)
	// Exact at the bound: the floor is written as given.
	m3 := randomID("model-")
	v, _ = x.s.RaiseModelMax(x.ctx, m3, 1, balance.MaxAmount-1, balance.MaxAmount)
	eq(t, "floor near 10^14", v, balance.MaxAmount-1)
	v, _ = other.ModelMax(x.ctx, m3)
	eq(t, "floor near 10^14 read back", v, balance.MaxAmount-1)
	if _, err := x.s.RaiseModelMax(x.ctx, m, 10, -1, 10); !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("floor -1: %v", err)
	}
}

// exerciseModelVersions: a model's version changes with every TouchModel and shows on another
// store at once past its cache TTL; a delete under way shows until the next TouchModel; a
// request of the model in flight on one store shows on every store.
func exerciseModelVersions(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{ModelMaxCacheTTL: time.Hour}, 0, false)
	other, err := x.env.newStore(x.ctx, &balance.Config{Prefix: x.env.Prefix, ModelMaxCacheTTL: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	m := randomID("model-")
	st, err := other.ModelState(x.ctx, m)
	eq(t, "err", err, nil)
	eq(t, "version before any change", st.Version, "")
	eq(t, "deleting", st.Deleting, false)
	if err := x.s.SetModelMax(x.ctx, m, 30); err != nil {
		t.Fatal(err)
	}
	var seen []string
	for i, step := range []func() error{
		func() error { return x.s.TouchModel(x.ctx, m) },
		func() error { return x.s.MarkModelDeleting(x.ctx, m) },
		func() error { return x.s.TouchModel(x.ctx, m) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
		for _, s := range []*balance.Store{x.s, other} { // the writer's own cache is dropped
			st, err := s.ModelState(x.ctx, m)
			// other's cache holds the last step's state: a read slower than the store's wait
			// (100 ms: a loaded machine) is answered with it, and the fresh state lands when
			// the read ends. Read until it has (a bound, not a measure).
			for deadline := time.Now().Add(time.Minute); s == other && err == nil && (st.Version == "" || slices.Contains(seen, st.Version)) &&
				time.Now().Before(deadline); st, err = s.ModelState(x.ctx, m) {
				time.Sleep(5 * time.Millisecond)
			}
			eq(t, "err", err, nil)
			eq(t, fmt.Sprintf("step %d: max", i), st.Max, 30)
			eq(t, fmt.Sprintf("step %d: deleting", i), st.Deleting, i == 1)
			if st.Version == "" || slices.Contains(seen, st.Version) {
				t.Fatalf("step %d: version %q after %q", i, st.Version, seen)
			}
		}
		st, _ := other.ModelState(x.ctx, m)
		seen = append(seen, st.Version)
	}
	if w := x.s.ModelChangeWait(); w <= time.Hour {
		t.Fatalf("ModelChangeWait %v not beyond the cache TTL", w)
	}

	busy, err := other.ModelInFlight(x.ctx, m)
	eq(t, "in flight before any request", busy, false)
	eq(t, "err", err, nil)
	done, err := x.s.UseModel(x.ctx, m)
	eq(t, "err", err, nil)
	busy, err = other.ModelInFlight(x.ctx, m)
	eq(t, "in flight, seen by another store", busy, true)
	eq(t, "err", err, nil)
	done()
	done() // once only
	busy, _ = other.ModelInFlight(x.ctx, randomID("model-"))
	eq(t, "another model", busy, false)
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
