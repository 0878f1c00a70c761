package balancetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"log/slog"
	"testing"

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
	// NoCoalesce runs every store of the suite with Config.NoCoalesce (each reserve its own
	// round trip; by default reserves may go in pipelines).
	NoCoalesce bool
	// Data and Admin, when set, are the clients of the two planes' Redis users (balance.ACLRules):
	// every store of the suite reserves, settles and seeds as Data and writes the admin keys as
	// Admin (Config.Admin); Client, which inspects and sets up, stays a user with every right.
	Data, Admin redis.UniversalClient
}

// newStore is balance.New on the suite's Redis: on Data with Admin for the admin plane when the
// suite runs as the two planes' users, else on Client.
func (env Env) newStore(ctx context.Context, cfg *balance.Config) (*balance.Store, error) {
	c := env.Client
	if env.Data != nil {
		c = env.Data
		if cfg.Admin == nil && !cfg.DataOnly {
			cfg.Admin = env.Admin
		}
	}
	return balance.New(ctx, c, cfg)
}

// h is one subtest's fixture: a store, its ledger double, an org of its own.
type h struct {
	t   *testing.T
	ctx context.Context
	env Env
	s   *balance.Store
	cfg balance.Config // s's configuration, as given to New
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
	cfg.NoCoalesce = cfg.NoCoalesce || env.NoCoalesce
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s, err := env.newStore(ctx, &cfg)
	if err != nil {
		t.Fatalf("balance.New: %v", err)
	}
	x := &h{t: t, ctx: ctx, env: env, s: s, cfg: cfg, l: l, org: randomID("org")}
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

// keys are the names of the fixture org's Redis keys.
func (x *h) keys() balance.OrgKeys { return balance.KeysOf(x.env.Prefix, x.org) }

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
	if want := x.l.B(x.org, st.Watermark); st.Balance+st.Held+st.Expired != want {
		x.t.Fatalf("invariant broken: bal %d + held %d + expired %d = %d, B(wm=%d) = %d",
			st.Balance, st.Held, st.Expired, st.Balance+st.Held+st.Expired, st.Watermark, want)
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
	return x.mustSettle(x.l.Add(x.org, -cost, id))
}

// expiry is the hold's expiry in hexp (false: not an unfinished hold).
func (x *h) expiry(id string) (float64, bool) { return x.score(x.keys().Hexp, id) }

// inGone reports whether the hold id is tombstoned.
func (x *h) inGone(id string) bool {
	_, ok := x.score(x.keys().Gone, id)
	return ok
}

func eq[T comparable](t *testing.T, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %v, want %v", what, got, want)
	}
}

// Run is the conformance suite of package balance: every rule of every script, on env.
func Run(t *testing.T, env Env) {
	t.Run("ReserveOK", func(t *testing.T) { exerciseReserveOK(t, env) })
	t.Run("ReserveInvalid", func(t *testing.T) { exerciseReserveInvalid(t, env) })
	t.Run("ScriptRefusesNonPositiveAmount", func(t *testing.T) { exerciseScriptRefusesNonPositiveAmount(t, env) })
	t.Run("ReserveExempt", func(t *testing.T) { exerciseReserveExempt(t, env) })
	t.Run("ReserveColdNoLedger", func(t *testing.T) { exerciseReserveColdNoLedger(t, env) })
	t.Run("ReserveColdWarmsOnce", func(t *testing.T) { exerciseReserveColdWarmsOnce(t, env) })
	t.Run("ReserveOtherEpochIsCold", func(t *testing.T) { exerciseReserveOtherEpochIsCold(t, env) })
	t.Run("Duplicate", func(t *testing.T) { exerciseDuplicate(t, env) })
	t.Run("GoneAfterRelease", func(t *testing.T) { exerciseGoneAfterRelease(t, env) })
	t.Run("GoneAfterSettle", func(t *testing.T) { exerciseGoneAfterSettle(t, env) })
	t.Run("TooManyCountsOnlyUnpinned", func(t *testing.T) { exerciseTooManyCountsOnlyUnpinned(t, env) })
	t.Run("Insufficient", func(t *testing.T) { exerciseInsufficient(t, env) })
	t.Run("SeedSubtractsHolds", func(t *testing.T) { exerciseSeedSubtractsHolds(t, env) })
	runGrants(t, env) // grants that expire (grants.go)
	t.Run("SeedNoOpSameEpoch", func(t *testing.T) { exerciseSeedNoOpSameEpoch(t, env) })
	t.Run("LowerGenerationNeverReplacesHigher", func(t *testing.T) { exerciseLowerGenerationNeverReplacesHigher(t, env) })
	t.Run("SettleInOrder", func(t *testing.T) { exerciseSettleInOrder(t, env) })
	t.Run("SettleAlreadyGivesBackHold", func(t *testing.T) { exerciseSettleAlreadyGivesBackHold(t, env) })
	t.Run("SettleGap", func(t *testing.T) { exerciseSettleGap(t, env) })
	t.Run("SettleCold", func(t *testing.T) { exerciseSettleCold(t, env) })
	t.Run("SettleValidation", func(t *testing.T) { exerciseSettleValidation(t, env) })
	t.Run("SettleMany", func(t *testing.T) { exerciseSettleMany(t, env) })
	t.Run("StaleSnapshotHealedByCatchUp", func(t *testing.T) { exerciseStaleSnapshotHealedByCatchUp(t, env) })
	t.Run("ReleaseWithoutAcct", func(t *testing.T) { exerciseReleaseWithoutAcct(t, env) })
	t.Run("ReleaseRacesReaper", func(t *testing.T) { exerciseReleaseRacesReaper(t, env) })
	t.Run("ExtendNeverLowers", func(t *testing.T) { exerciseExtendNeverLowers(t, env) })
	t.Run("PinUnpin", func(t *testing.T) { exercisePinUnpin(t, env) })
	t.Run("ReapRules", func(t *testing.T) { exerciseReapRules(t, env) })
	t.Run("ReapScriptRechecksExpiry", func(t *testing.T) { exerciseReapScriptRechecksExpiry(t, env) })
	t.Run("TombstoneTrim", func(t *testing.T) { exerciseTombstoneTrim(t, env) })
	t.Run("InvalidateKeepsHolds", func(t *testing.T) { exerciseInvalidateKeepsHolds(t, env) })
	t.Run("State", func(t *testing.T) { exerciseState(t, env) })
	t.Run("ModelMax", func(t *testing.T) { exerciseModelMax(t, env) })
	t.Run("LearnedMaxSurvivesRedisLoss", func(t *testing.T) { exerciseLearnedMaxSurvivesRedisLoss(t, env) })
	t.Run("ModelVersions", func(t *testing.T) { exerciseModelVersions(t, env) })
	t.Run("ScanOrgs", func(t *testing.T) { exerciseScanOrgs(t, env) })
	t.Run("ExactNear1e14", func(t *testing.T) { exerciseExactNear1e14(t, env) })
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
	exactHoldsAtBound(x, top)
	exactFinishAtBound(x, top)
	exactDebtAtBound(x, top)
	exactReseedAtBound(x, top)
	v, err := x.s.RaiseModelMax(x.ctx, randomID("m"), top, top, top)
	eq(t, "model max", v, top)
	eq(t, "err", err, nil)
}

// exactHoldsAtBound: holds that take the whole balance, refusals that report it, a release and
// settles that bring it back to top.
func exactHoldsAtBound(x *h, top int64) {
	t := x.t
	r := x.mustReserve("a", 1)
	eq(t, "after a hold of 1", r.Balance, top-1)
	x.mustReserve("b", 1)
	x.mustReserve("c", top-2) // the whole rest
	x.mustRefuseWith("d", 1, 0)
	x.mustRelease("c")
	eq(t, "after release", x.state().Balance, top-2)
	x.mustRefuseWith("e", top, top-2)
	// Charge 1 for a (its hold of 1 comes back), credit 1: bal = top-1 while b holds 1.
	x.mustSettle(x.l.Add(x.org, -1, "a"), x.l.Add(x.org, 1, ""))
	eq(t, "after settles", x.state().Balance, top-1)
	x.mustRelease("b")
	eq(t, "back at the bound", x.state().Balance, top)
}

// exactFinishAtBound: finish moves hold − cost back at the bound (the whole balance held, a cost
// of 1), and the settle of the finished hold.
func exactFinishAtBound(x *h, top int64) {
	t := x.t
	x.mustReserve("fa", top)
	if ok, err := x.s.Finish(x.ctx, x.org, "fa", 1); !ok || err != nil {
		t.Fatalf("finish fa: %v %v", ok, err)
	}
	eq(t, "after finish", x.state().Balance, top-1)
	x.mustSettle(x.l.Add(x.org, -1, "fa"), x.l.Add(x.org, 1, ""))
	eq(t, "finished hold settled", x.state().Balance, top)
}

// exactDebtAtBound: down to a debt of exactly -10^14, and a reseed there.
func exactDebtAtBound(x *h, top int64) {
	t := x.t
	x.mustSettle(x.l.Add(x.org, -top, ""), x.l.Add(x.org, -top, ""))
	eq(t, "debt at the bound", x.state().Balance, -top)
	x.reseed()
	eq(t, "reseeded in debt", x.state().Balance, -top)
	x.mustRefuseWith("f", 1, -top)
}

// exactReseedAtBound: back up to the bound by catch-up, a hold of all of it, and a reseed that
// subtracts it.
func exactReseedAtBound(x *h, top int64) {
	t := x.t
	x.l.Add(x.org, top, "")
	x.l.Add(x.org, top, "")
	if err := x.s.CatchUp(x.ctx, x.org); err != nil {
		t.Fatal(err)
	}
	eq(t, "recharged to the bound", x.state().Balance, top)
	x.mustReserve("g", top)
	x.reseed()
	st := x.state()
	eq(t, "reseeded minus the hold", st.Balance, 0)
	eq(t, "held", st.Held, top)
	x.mustRelease("g")
	eq(t, "released to the bound", x.state().Balance, top)
}

// mustRefuse fails the test unless reserving amount under id fails with want (what names the
// attempt in the failure).
func (x *h) mustRefuse(what, id string, amount int64, want error) {
	x.t.Helper()
	if _, err := x.reserve(id, amount); !errors.Is(err, want) {
		x.t.Fatalf("%s: %v, want %v", what, err, want)
	}
}

// mustRefuseWith fails the test unless reserving amount under id is refused as insufficient,
// reporting balance bal.
func (x *h) mustRefuseWith(id string, amount, bal int64) {
	x.t.Helper()
	_, err := x.reserve(id, amount)
	var ie *balance.InsufficientError
	if !errors.As(err, &ie) || ie.Balance != bal {
		x.t.Fatalf("reserve %s of %d: got %v, want insufficient with %d", id, amount, err, bal)
	}
}

// mustRelease releases the hold and fails the test unless this call gave it back.
func (x *h) mustRelease(id string) {
	x.t.Helper()
	if ok, err := x.s.Release(x.ctx, x.org, id); !ok || err != nil {
		x.t.Fatalf("release %s: %v %v", id, ok, err)
	}
}

// mustSettle settles the org's ledger entries and fails the test on an error.
func (x *h) mustSettle(entries ...balance.Entry) []balance.SettleStatus {
	x.t.Helper()
	st, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), entries)
	if err != nil {
		x.t.Fatalf("settle: %v", err)
	}
	return st
}

// reseed drops the org's hot balance and warms it again from the ledger.
func (x *h) reseed() {
	x.t.Helper()
	if err := x.s.Invalidate(x.ctx, x.org); err != nil {
		x.t.Fatal(err)
	}
	if err := x.s.Warm(x.ctx, x.org); err != nil {
		x.t.Fatal(err)
	}
}
