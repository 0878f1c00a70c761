package balancetest

import (
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Grants that expire (docs/grants.md): the hot balance keeps each expiry's unspent rest and rolls
// it over on the script clock; the tests move that clock with a second store's ClockOffset, never
// with a sleep.

func runGrants(t *testing.T, env Env) {
	t.Run("GrantRollsOverAtReserve", func(t *testing.T) { exerciseGrantRollsOverAtReserve(t, env) })
	t.Run("GrantHoldSpansExpiry", func(t *testing.T) { exerciseGrantHoldSpansExpiry(t, env) })
	t.Run("GrantCreditMarker", func(t *testing.T) { exerciseGrantCreditMarker(t, env) })
	t.Run("GrantBlockOnlyAtItsSeq", func(t *testing.T) { exerciseGrantBlockOnlyAtItsSeq(t, env) })
	t.Run("GrantExpireBeforeRollover", func(t *testing.T) { exerciseGrantExpireBeforeRollover(t, env) })
	t.Run("GrantSeedAfterExpiry", func(t *testing.T) { exerciseGrantSeedAfterExpiry(t, env) })
}

// grantFixture: an org whose ledger has one credit of paid (seq 1, never expires) and one of
// promo (seq 2) expiring an hour from the Redis clock, seeded with that rest; later is a store
// whose script clock is two hours on (after the expiry).
func grantFixture(t *testing.T, env Env, paid, promo int64) (x *h, later *balance.Store, at time.Time) {
	t.Helper()
	x = fixture(t, env, balance.Config{}, 0, false)
	now, err := x.s.Now(x.ctx)
	if err != nil {
		t.Fatal(err)
	}
	at = now.Add(time.Hour).Truncate(time.Millisecond)
	x.l.Add(x.org, paid, "")
	x.l.Add(x.org, promo, "")
	snap := balance.Snapshot{Epoch: x.l.CurrentEpoch(), Balance: paid + promo, Seq: 2,
		Expiries: &map[int64]int64{at.UnixMilli(): promo}}
	if _, err := x.pushLimits(0); err != nil { // the admin plane's lim first: a seed never writes it
		t.Fatalf("push limits: %v", err)
	}
	if ok, err := x.s.Seed(x.ctx, x.org, snap); err != nil || !ok {
		t.Fatalf("seed: %v %v", ok, err)
	}
	cfg := x.cfg
	cfg.ClockOffset = 2 * time.Hour
	later, err = balance.New(x.ctx, env.Client, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return x, later, at
}

func exerciseGrantRollsOverAtReserve(t *testing.T, env Env) {
	t.Parallel()
	x, later, at := grantFixture(t, env, 100, 300)
	x.mustReserve("before", 350) // spends the promotional credit while it is live
	x.invariant()
	eq(t, "balance before", x.state().Balance, 50)
	// After the expiry the rest leaves at the next call: 50 − 300 < 0, nothing more is held.
	_, err := later.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: "after", Amount: 1})
	if !errors.Is(err, balance.ErrInsufficient) {
		t.Fatalf("reserve after the expiry: %v, want insufficient", err)
	}
	st := x.state()
	eq(t, "balance after rollover", st.Balance, -250)
	eq(t, "expired", st.Expired, 300)
	x.invariant()
	// The hold taken before spent the grant (the ledger charges its 350 to the promo first): the
	// charge settles with the ledger's rests read with it (0 left), and the rollover's 300 comes back.
	c := x.l.Add(x.org, -350, "before")
	c.Expiries = &map[int64]int64{at.UnixMilli(): 0}
	x.mustSettle(c)
	x.invariant()
	eq(t, "balance after the charge", x.state().Balance, 50)
	eq(t, "expired after the charge", x.state().Expired, 0)
	// The expire entry of the grant (its rest: 0) closes the expiry.
	e := x.l.Add(x.org, 0, "")
	e.Expired, e.LastOfExpiry = at, true
	x.mustSettle(e)
	x.invariant()
	st = x.state()
	eq(t, "balance at rest", st.Balance, 50)
	eq(t, "expired at rest", st.Expired, 0)
	if _, err := later.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: "paid", Amount: 50}); err != nil {
		t.Fatalf("reserve of the paid rest: %v", err)
	}
}

func exerciseGrantHoldSpansExpiry(t *testing.T, env Env) {
	t.Parallel()
	x, later, at := grantFixture(t, env, 100, 300)
	x.mustReserve("span", 200) // taken before the expiry, settles after it with cost 120
	if _, err := later.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: "p", Amount: 100}); !errors.Is(err, balance.ErrInsufficient) {
		t.Fatalf("after the expiry only paid credit may be held, and it is held conservatively: %v", err)
	}
	x.invariant()
	// The ledger charges 120 to the promo (live at the reserve time): its rest is 180.
	c := x.l.Add(x.org, -120, "span")
	c.Expiries = &map[int64]int64{at.UnixMilli(): 180}
	x.mustSettle(c)
	x.invariant()
	eq(t, "balance: the paid 100 only", x.state().Balance, 100)
	e := x.l.Add(x.org, -180, "")
	e.Expired, e.LastOfExpiry = at, true
	x.mustSettle(e)
	x.invariant()
	eq(t, "balance at rest", x.state().Balance, 100)
	eq(t, "ledger", x.l.B(x.org, x.l.Seq(x.org)), int64(100))
}

func exerciseGrantCreditMarker(t *testing.T, env Env) {
	t.Parallel()
	x, later, at := grantFixture(t, env, 100, 300)
	// A second grant of the same expiry, credited after the seed: its marker adds it to the rest
	// even without a block.
	c := x.l.Add(x.org, 50, "")
	c.GrantExpiry = at
	x.mustSettle(c)
	eq(t, "balance", x.state().Balance, 450)
	_, _ = later.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: "r", Amount: 101})
	st := x.state()
	eq(t, "balance after rollover", st.Balance, 100)
	eq(t, "expired", st.Expired, 350)
	x.invariant()
	// A grant credited after its expiry has come rolls over in the same call.
	d := x.l.Add(x.org, 70, "")
	d.GrantExpiry = at
	if _, err := later.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{d}); err != nil {
		t.Fatal(err)
	}
	eq(t, "balance after a late grant", x.state().Balance, 100)
	x.invariant()
}

func exerciseGrantBlockOnlyAtItsSeq(t *testing.T, env Env) {
	t.Parallel()
	x, _, at := grantFixture(t, env, 100, 300)
	a := x.l.Add(x.org, -10, "")
	b := x.l.Add(x.org, -10, "")
	// A block on the last entry of a batch whose watermark does not end there (a gap before it)
	// is not applied.
	gap := balance.Entry{Seq: b.Seq + 5, Delta: -1, Expiries: &map[int64]int64{at.UnixMilli(): 1}}
	if _, err := x.s.Settle(x.ctx, x.org, x.l.CurrentEpoch(), []balance.Entry{a, gap}); !errors.Is(err, balance.ErrGap) {
		t.Fatalf("settle across a gap: %v", err)
	}
	x.invariant()
	if v := x.field("x:" + ms(at)); v != "300" {
		t.Fatalf("x after a block past a gap: %q, want 300", v)
	}
	b.Expiries = &map[int64]int64{at.UnixMilli(): 280}
	x.mustSettle(b)
	if v := x.field("x:" + ms(at)); v != "280" {
		t.Fatalf("x after its block: %q, want 280", v)
	}
	x.invariant()
}

func exerciseGrantExpireBeforeRollover(t *testing.T, env Env) {
	t.Parallel()
	// The ledger's expire entry may reach settle before the script clock reaches the expiry
	// (clocks apart): it closes the expiry, and no rollover takes the rest out a second time.
	x, later, at := grantFixture(t, env, 100, 300)
	e := x.l.Add(x.org, -300, "")
	e.Expired, e.LastOfExpiry = at, true
	x.mustSettle(e)
	x.invariant()
	if _, err := later.Reserve(x.ctx, balance.ReserveRequest{Org: x.org, HoldID: "r", Amount: 100}); err != nil {
		t.Fatalf("reserve of the paid 100 after the expiry: %v", err)
	}
	eq(t, "balance", x.state().Balance, 0)
	x.invariant()
}

func exerciseGrantSeedAfterExpiry(t *testing.T, env Env) {
	t.Parallel()
	// A seed whose snapshot still has the rest of an expiry that has come (the expire entry is
	// not written yet) rolls it over at once.
	x := fixture(t, env, balance.Config{}, 0, false)
	now, err := x.s.Now(x.ctx)
	if err != nil {
		t.Fatal(err)
	}
	x.l.Add(x.org, 500, "")
	snap := balance.Snapshot{Epoch: x.l.CurrentEpoch(), Balance: 500, Seq: 1,
		Expiries: &map[int64]int64{now.Add(-time.Minute).UnixMilli(): 200}}
	if _, err := x.pushLimits(0); err != nil { // the admin plane's lim first: a seed never writes it
		t.Fatalf("push limits: %v", err)
	}
	if ok, err := x.s.Seed(x.ctx, x.org, snap); err != nil || !ok {
		t.Fatalf("seed: %v %v", ok, err)
	}
	st := x.state()
	eq(t, "balance", st.Balance, 300)
	eq(t, "expired", st.Expired, 200)
	x.invariant()
}

func ms(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// field reads one field of the org's acct.
func (x *h) field(f string) string {
	x.t.Helper()
	v, err := x.env.Client.HGet(x.ctx, x.keys().Acct, f).Result()
	if err != nil {
		return ""
	}
	return v
}
