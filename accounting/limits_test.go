package accounting_test

import (
	"context"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// limitRig is an org with a large balance, one key, a worker and Ops over a real balance.Store
// whose limit clock is set to noon of a fixed day (ClockOffset), so no window rolls over while
// the test runs.
type limitRig struct {
	t     *testing.T
	ctx   context.Context
	env   *testutil.RedisEnv
	l     ledger.Ledger
	store *balance.Store
	w     *accounting.Worker
	ops   *accounting.Ops
	key   string
	noon  time.Time
}

const rigOrg = "acme"

func newLimitRig(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) *limitRig {
	t.Helper()
	noon := time.Date(2030, 6, 14, 12, 0, 0, 0, time.UTC) // a Friday
	store := newStore(t, env, l, balance.Config{ClockOffset: time.Until(noon)})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	r := &limitRig{t: t, ctx: context.Background(), env: env, l: l, store: store, w: w, ops: accounting.NewOps(w), noon: noon}
	if err := l.CreateOrg(r.ctx, rigOrg); err != nil {
		t.Fatal(err)
	}
	k, _, err := l.CreateKey(r.ctx, rigOrg)
	if err != nil {
		t.Fatal(err)
	}
	r.key = k.ID
	if _, _, err := r.ops.Credit(r.ctx, rigOrg, 1_000_000_000, "pay-rig"); err != nil {
		t.Fatal(err)
	}
	return r
}

// reserve puts a hold of amount with the rig's key.
func (r *limitRig) reserve(amount int64) (string, balance.Reservation, error) {
	id := newID()
	res, err := r.store.Reserve(r.ctx, balance.ReserveRequest{Org: rigOrg, HoldID: id, Amount: amount, KeyID: r.key})
	return id, res, err
}

// serve reserves, records the usage with its attribution, accounts and settles it.
func (r *limitRig) serve(amount, cost int64) {
	r.t.Helper()
	id, res, err := r.reserve(amount)
	if err != nil {
		r.t.Fatalf("reserve %d: %v", amount, err)
	}
	ev := ledger.UsageEvent{ID: id, Org: rigOrg, KeyID: r.key, Project: res.Project, ReservedAt: res.ReservedAt,
		Model: "m", Cost: cost, HoldAmount: amount}
	if err := r.l.RecordUsage(r.ctx, []ledger.UsageEvent{ev}); err != nil {
		r.t.Fatal(err)
	}
	r.settle()
}

func (r *limitRig) settle() {
	r.t.Helper()
	if _, err := r.w.AccountAll(r.ctx); err != nil {
		r.t.Fatal(err)
	}
	if err := r.w.SettleOrg(r.ctx, rigOrg); err != nil {
		r.t.Fatal(err)
	}
}

func (r *limitRig) counters() map[balance.Counter]int64 {
	r.t.Helper()
	cs, err := r.store.Counters(r.ctx, rigOrg)
	if err != nil {
		r.t.Fatal(err)
	}
	return cs
}

func (r *limitRig) balance() accounting.Balance {
	r.t.Helper()
	b, err := r.ops.Balance(r.ctx, rigOrg)
	if err != nil {
		r.t.Fatal(err)
	}
	return b
}

func wantLimit(t *testing.T, err error, id string, used int64) *balance.LimitError {
	t.Helper()
	var le *balance.LimitError
	if !errors.As(err, &le) || le.Limit.ID != id || le.Used != used {
		t.Fatalf("reserve: %v, want limit %s refusing at used %d", err, id, used)
	}
	return le
}

// TestLimitsEndToEnd: limits and freezes made through Ops reach the hot balance before the call
// returns: a daily key cap refuses the reserve past it, real costs replace holds in its
// counter, a freeze refuses at once, a cap lowered below what is used refuses and moves no
// money, and after the hot state is lost a reseed rebuilds the counters from the ledger exactly.
func TestLimitsEndToEnd(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		r := newLimitRig(t, env, l)
		ctx := r.ctx
		day, err := r.ops.CreateLimit(ctx, rigOrg, balance.Scope{Kind: balance.ScopeKey, ID: r.key}, balance.Day, 300)
		if err != nil {
			t.Fatal(err)
		}
		// Three holds of 100 fill the day; the fourth is refused with the limit and its reset.
		var held []string
		for range 3 {
			id, _, err := r.reserve(100)
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, id)
		}
		_, _, err = r.reserve(1)
		le := wantLimit(t, err, day.ID, 300)
		if want := time.Date(2030, 6, 15, 0, 0, 0, 0, time.UTC); !le.ResetsAt.Equal(want) || le.Limit.Cap != 300 {
			t.Fatalf("refusal %+v, want cap 300 and a reset at %v", le, want)
		}
		views, err := r.ops.ListLimits(ctx, rigOrg)
		if err != nil || len(views) != 1 || views[0].Used != 300 || views[0].Held != 300 || views[0].ID != day.ID {
			t.Fatalf("ListLimits with three holds: %+v %v", views, err)
		}
		// Their real costs (80 each) replace the holds in the counter.
		for _, id := range held {
			ev := ledger.UsageEvent{ID: id, Org: rigOrg, KeyID: r.key, ReservedAt: r.noon, Model: "m", Cost: 80, HoldAmount: 100}
			if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
				t.Fatal(err)
			}
		}
		r.settle()
		dayField := balance.Counter{LimitID: day.ID, Start: balance.Day.StartMS(r.noon)}
		if got := r.counters()[dayField]; got != 240 {
			t.Fatalf("day counter after settling 3×80: %d, want 240", got)
		}
		views, _ = r.ops.ListLimits(ctx, rigOrg)
		if views[0].Used != 240 || views[0].Held != 0 || views[0].ResetsAt == nil || !views[0].ResetsAt.Equal(le.ResetsAt) {
			t.Fatalf("ListLimits at rest: %+v", views[0])
		}
		r.serve(60, 60) // exactly to the cap
		_, _, err = r.reserve(1)
		wantLimit(t, err, day.ID, 300)

		// A freeze of the key refuses at once; unfreezing lets the next request through.
		if err := r.ops.SetKeyProject(ctx, r.key, ""); err != nil { // a no-op change, pushed all the same
			t.Fatal(err)
		}
		if err := r.ops.DeleteLimit(ctx, rigOrg, day.ID); err != nil {
			t.Fatal(err)
		}
		if err := r.ops.Freeze(ctx, "", balance.Scope{Kind: balance.ScopeKey, ID: r.key}); err != nil {
			t.Fatal(err)
		}
		_, _, err = r.reserve(1)
		var fe *balance.FrozenError
		if !errors.As(err, &fe) || fe.Scope != (balance.Scope{Kind: balance.ScopeKey, ID: r.key}) {
			t.Fatalf("reserve on a frozen key: %v", err)
		}
		if err := r.ops.Unfreeze(ctx, rigOrg, balance.Scope{Kind: balance.ScopeKey, ID: r.key}); err != nil {
			t.Fatal(err)
		}
		if err := r.ops.Freeze(ctx, rigOrg, balance.Scope{Kind: balance.ScopeOrg}); err != nil {
			t.Fatal(err)
		}
		_, _, err = r.reserve(1)
		if !errors.As(err, &fe) || fe.Scope.Kind != balance.ScopeOrg {
			t.Fatalf("reserve on a frozen org: %v", err)
		}
		if err := r.ops.Unfreeze(ctx, rigOrg, balance.Scope{Kind: balance.ScopeOrg}); err != nil {
			t.Fatal(err)
		}

		// A monthly org cap and a project cap: the spend so far counts at once (the push
		// reseeds from the ledger), and lowering a cap below it refuses without moving money.
		if err := r.ops.CreateProject(ctx, rigOrg, "staging"); err != nil {
			t.Fatal(err)
		}
		if err := r.ops.SetKeyProject(ctx, r.key, "staging"); err != nil {
			t.Fatal(err)
		}
		month, err := r.ops.CreateLimit(ctx, rigOrg, balance.Scope{Kind: balance.ScopeOrg}, balance.Month, 10_000)
		if err != nil {
			t.Fatal(err)
		}
		proj, err := r.ops.CreateLimit(ctx, rigOrg, balance.Scope{Kind: balance.ScopeProject, ID: "staging"}, balance.Week, 5_000)
		if err != nil {
			t.Fatal(err)
		}
		r.serve(50, 45) // now in project staging
		monthField := balance.Counter{LimitID: month.ID, Start: balance.Month.StartMS(r.noon)}
		projField := balance.Counter{LimitID: proj.ID, Start: balance.Week.StartMS(r.noon)}
		if cs := r.counters(); cs[monthField] != 345 || cs[projField] != 45 {
			t.Fatalf("counters %v: want month 345 (all the key's spend), project 45 (since it joined)", cs)
		}
		before := r.balance()
		if _, err := r.ops.SetLimitCap(ctx, rigOrg, month.ID, 100); err != nil {
			t.Fatal(err)
		}
		_, _, err = r.reserve(1)
		wantLimit(t, err, month.ID, 345)
		if after := r.balance(); after.LedgerBalance != before.LedgerBalance || after.Available != before.Available || after.LedgerSeq != before.LedgerSeq {
			t.Fatalf("lowering a cap moved money: %+v → %+v", before, after)
		}
		if _, err := r.ops.SetLimitCap(ctx, rigOrg, month.ID, 10_000); err != nil {
			t.Fatal(err)
		}

		// Redis loses the org (its keys are deleted, as a FLUSH would): the next request
		// reseeds the counters from the ledger, exactly.
		if err := r.store.Warm(ctx, rigOrg); err != nil { // the cap's push dropped the hot state
			t.Fatal(err)
		}
		rest := r.counters()
		if len(rest) != 2 || rest[monthField] != 345 || rest[projField] != 45 {
			t.Fatalf("counters at rest %v", rest)
		}
		testutil.DeletePrefix(ctx, env.Client, env.Prefix)
		if st, _ := r.store.State(ctx, rigOrg); st.Exists {
			t.Fatal("the hot state survived its deletion")
		}
		if err := r.store.Warm(ctx, rigOrg); err != nil {
			t.Fatal(err)
		}
		if got := r.counters(); !maps.Equal(got, rest) {
			t.Fatalf("counters after the reseed %v, want %v", got, rest)
		}
		if b := r.balance(); b.Available != before.Available || b.Held != 0 {
			t.Fatalf("balance after the reseed %+v, want %+v", b, before)
		}
		r.serve(10, 10)
		if cs := r.counters(); cs[monthField] != 355 || cs[projField] != 55 {
			t.Fatalf("counters after one more request %v", cs)
		}
	})
}

// TestReconcilePushesLimits: a limit change whose push did not happen (the hot limits are
// older than the ledger's) is pushed by the reconciler.
func TestReconcilePushesLimits(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		r := newLimitRig(t, env, l)
		if _, _, err := r.reserve(10); err != nil { // warm, limits version 0
			t.Fatal(err)
		}
		// Written to the ledger only, as if the push had failed.
		if _, err := l.SetFrozen(r.ctx, rigOrg, balance.Scope{Kind: balance.ScopeOrg}, true); err != nil {
			t.Fatal(err)
		}
		if _, _, err := r.reserve(10); err != nil {
			t.Fatalf("before the reconciler the hot state does not know of the freeze: %v", err)
		}
		d, err := r.w.Reconcile(r.ctx, rigOrg)
		if err != nil || !d.LimitsPushed || !d.Repaired {
			t.Fatalf("Reconcile = %+v, %v: want the limits pushed", d, err)
		}
		_, _, err = r.reserve(10)
		if !errors.Is(err, balance.ErrFrozen) {
			t.Fatalf("reserve after the reconciler: %v, want frozen", err)
		}
		if d, err := r.w.Reconcile(r.ctx, rigOrg); err != nil || d.LimitsPushed {
			t.Fatalf("a second Reconcile = %+v, %v: nothing to push", d, err)
		}
	})
}

// TestLimitsReservedBeforeMidnight: a request reserved just before midnight and settled after
// it is charged to the day it started, in Redis (while that day's counter is kept) and in the
// ledger; the new day starts empty, and its first hold drops the past day's counter.
func TestLimitsReservedBeforeMidnight(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		r := newLimitRig(t, env, l)
		ctx := r.ctx
		day, err := r.ops.CreateLimit(ctx, rigOrg, balance.Scope{Kind: balance.ScopeKey, ID: r.key}, balance.Day, 100)
		if err != nil {
			t.Fatal(err)
		}
		d := time.Date(2030, 6, 14, 0, 0, 0, 0, time.UTC)
		midnight := d.Add(24 * time.Hour)
		prev, cur := balance.Counter{LimitID: day.ID, Start: d.UnixMilli()}, balance.Counter{LimitID: day.ID, Start: midnight.UnixMilli()}
		before := newStore(t, env, l, balance.Config{ClockOffset: time.Until(midnight.Add(-5 * time.Second))})
		id := newID()
		res, err := before.Reserve(ctx, balance.ReserveRequest{Org: rigOrg, HoldID: id, Amount: 100, KeyID: r.key})
		if err != nil {
			t.Fatal(err)
		}
		if !res.ReservedAt.Before(midnight) || res.ReservedAt.Before(midnight.Add(-time.Minute)) {
			t.Fatalf("reserved at %v, want just before %v", res.ReservedAt, midnight)
		}
		// Recorded, accounted and settled after midnight (a store whose clock is past it).
		after := newStore(t, env, l, balance.Config{ClockOffset: time.Until(midnight.Add(30 * time.Second))})
		ev := ledger.UsageEvent{ID: id, Org: rigOrg, KeyID: r.key, Project: res.Project, ReservedAt: res.ReservedAt,
			Model: "m", Cost: 70, HoldAmount: 100, CreatedAt: midnight.Add(20 * time.Second)}
		if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
		w := newWorker(t, l, after, &accounting.WorkerConfig{Logger: quiet})
		if _, err := w.AccountAll(ctx); err != nil {
			t.Fatal(err)
		}
		if err := w.SettleOrg(ctx, rigOrg); err != nil {
			t.Fatal(err)
		}
		counters := func() map[balance.Counter]int64 {
			cs, err := after.Counters(ctx, rigOrg)
			if err != nil {
				t.Fatal(err)
			}
			return cs
		}
		if cs := counters(); cs[prev] != 70 || cs[cur] != 0 {
			t.Fatalf("counters %v: want the 14th at 70 (the cost, in place of the hold), nothing on the 15th", cs)
		}
		used, err := l.LimitUsage(ctx, rigOrg, d, -1)
		if err != nil {
			t.Fatal(err)
		}
		if want := (balance.WindowUsed{LimitID: day.ID, Start: d.UnixMilli(), Used: 70}); len(used) != 1 || used[0] != want {
			t.Fatalf("the ledger's spend %v, want %v", used, want)
		}
		// The new day's cap is whole: its first hold passes, and the past day's counter goes.
		if _, err := after.Reserve(ctx, balance.ReserveRequest{Org: rigOrg, HoldID: newID(), Amount: 100, KeyID: r.key}); err != nil {
			t.Fatalf("the first reserve of the new day: %v", err)
		}
		if cs := counters(); cs[cur] != 100 || len(cs) != 1 {
			t.Fatalf("counters after the new day's first hold %v, want only the 15th at 100", cs)
		}
		// A reseed after midnight counts the new day only: its hold, not the 14th's cost.
		if err := after.Invalidate(ctx, rigOrg); err != nil {
			t.Fatal(err)
		}
		if err := after.Warm(ctx, rigOrg); err != nil {
			t.Fatal(err)
		}
		if cs := counters(); cs[cur] != 100 || len(cs) != 1 {
			t.Fatalf("counters after a reseed past midnight %v, want only the 15th at 100", cs)
		}
	})
}

// TestListLimitsRedisDown: with Redis gone, ListLimits answers from the ledger (the settled
// spend of each current window, nothing held) instead of failing.
func TestListLimitsRedisDown(t *testing.T) {
	t.Parallel()
	env := testutil.MiniRedis(t)
	r := newLimitRig(t, env, memledger.New())
	lim, err := r.ops.CreateLimit(r.ctx, rigOrg, balance.Scope{Kind: balance.ScopeOrg}, balance.Lifetime, 1_000)
	if err != nil {
		t.Fatal(err)
	}
	r.serve(100, 30)
	if _, _, err := r.reserve(50); err != nil { // held while Redis is up
		t.Fatal(err)
	}
	views, err := r.ops.ListLimits(r.ctx, rigOrg)
	if err != nil || len(views) != 1 || views[0].Used != 80 || views[0].Held != 50 || views[0].ResetsAt != nil {
		t.Fatalf("ListLimits with Redis up: %+v %v", views, err)
	}
	env.Mini.Close()
	views, err = r.ops.ListLimits(r.ctx, rigOrg)
	if err != nil || len(views) != 1 || views[0].ID != lim.ID || views[0].Used != 30 || views[0].Held != 0 {
		t.Fatalf("ListLimits with Redis down: %+v %v, want the ledger's 30", views, err)
	}
}
