package balancetest

import (
	"errors"
	"fmt"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

// SettleMany settles several orgs in one pipeline, each exactly as Settle would: a warm org's
// entries in order (more than one script call's worth), a cold org answers ErrCold and is left
// alone, a gap stops its org at the gap without touching the others.
func exerciseSettleMany(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{MaxInFlight: 1000}, 100_000, true)
	var warm []balance.Entry
	for i := range 300 {
		id := fmt.Sprint("h", i)
		x.mustReserve(id, 100)
		warm = append(warm, x.l.Add(x.org, -7, id))
	}
	gappy := randomID("gap")
	x.l.Add(gappy, 1000, "")
	if err := x.s.Warm(x.ctx, gappy); err != nil {
		t.Fatal(err)
	}
	g2 := x.l.Add(gappy, -10, "")
	g3 := x.l.Add(gappy, -20, "")
	g4 := x.l.Add(gappy, -40, "")
	cold := randomID("cold")
	c1 := x.l.Add(cold, 500, "")

	got := x.s.SettleMany(x.ctx, x.l.CurrentEpoch(), map[string][]balance.Entry{
		x.org: warm,
		gappy: {g2, g4}, // g4 after g2 leaves a gap at 3
		cold:  {c1},
	})
	r := got[x.org]
	eq(t, "warm err", r.Err, nil)
	eq(t, "warm statuses", len(r.Statuses), 300)
	for i, s := range r.Statuses {
		if s != balance.Applied {
			t.Fatalf("warm entry %d: %v", i, s)
		}
	}
	st := x.state()
	eq(t, "warm balance", st.Balance, 100_000-300*7)
	eq(t, "warm watermark", st.Watermark, 301)
	eq(t, "warm holds", st.Holds, 0)

	r = got[gappy]
	var ge *balance.GapError
	if !errors.As(r.Err, &ge) || ge.Watermark != 2 || ge.Seq != 4 {
		t.Fatalf("gappy: %v, want a gap at watermark 2 for seq 4", r.Err)
	}
	eq(t, "gappy statuses", fmt.Sprint(r.Statuses), fmt.Sprint([]balance.SettleStatus{balance.Applied, balance.Gap}))
	gst, err := x.s.State(x.ctx, gappy)
	eq(t, "err", err, nil)
	eq(t, "gappy balance", gst.Balance, 990)

	r = got[cold]
	if !errors.Is(r.Err, balance.ErrCold) {
		t.Fatalf("cold: %v, want ErrCold", r.Err)
	}
	eq(t, "cold statuses", fmt.Sprint(r.Statuses), fmt.Sprint([]balance.SettleStatus{balance.Cold}))
	cst, err := x.s.State(x.ctx, cold)
	eq(t, "err", err, nil)
	eq(t, "cold stays cold", cst.Exists, false)

	// Again, with the same entries: already there (nothing moves), and the gap healed in order.
	got = x.s.SettleMany(x.ctx, x.l.CurrentEpoch(), map[string][]balance.Entry{x.org: warm[:3], gappy: {g3, g4}})
	eq(t, "warm again", fmt.Sprint(got[x.org].Statuses), fmt.Sprint([]balance.SettleStatus{balance.Already, balance.Already, balance.Already}))
	eq(t, "gappy healed", got[gappy].Err, nil)
	eq(t, "warm balance again", x.state().Balance, 100_000-300*7)
	gst, _ = x.s.State(x.ctx, gappy)
	eq(t, "gappy balance healed", gst.Balance, 930)

	// An invalid batch fails its org alone, before anything is sent.
	got = x.s.SettleMany(x.ctx, x.l.CurrentEpoch(), map[string][]balance.Entry{"bad{org}": {c1}, x.org: {warm[0]}})
	if !errors.Is(got["bad{org}"].Err, balance.ErrInvalidOrg) || got[x.org].Err != nil {
		t.Fatalf("invalid org: %v; valid org: %v", got["bad{org}"].Err, got[x.org].Err)
	}
}
