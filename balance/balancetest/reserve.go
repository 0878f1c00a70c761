package balancetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

func exerciseReserveOK(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	r := x.mustReserve("h1", 300)
	eq(t, "balance", r.Balance, 700)
	eq(t, "duplicate", r.Duplicate, false)
	st := x.state()
	eq(t, "held", st.Held, 300)
	eq(t, "holds", st.Holds, 1)
	if _, ok := x.expiry("h1"); !ok {
		t.Fatal("hold has no expiry")
	}
	eq(t, "held orgs", fmt.Sprint(x.s.HeldOrgs()), fmt.Sprint([]string{x.org}))
}

func exerciseReserveInvalid(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	for _, a := range []int64{0, -1, balance.MaxAmount + 1} {
		if _, err := x.reserve("h", a); !errors.Is(err, balance.ErrInvalidAmount) {
			t.Fatalf("amount %d: got %v, want ErrInvalidAmount", a, err)
		}
	}
	for _, org := range []string{"", "a{b}", "a:b", "a b", "tab\t", strings.Repeat("a", 129)} {
		_, err := x.s.Reserve(x.ctx, balance.ReserveRequest{Org: org, HoldID: "h", Amount: 1})
		if !errors.Is(err, balance.ErrInvalidOrg) {
			t.Fatalf("org %q: got %v, want ErrInvalidOrg", org, err)
		}
	}
	x.mustRefuse("empty hold id", "", 1, balance.ErrInvalidHoldID)
	eq(t, "balance", x.state().Balance, 1000)
}

func exerciseScriptRefusesNonPositiveAmount(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	keys := x.keys().ReserveKeys()
	for _, a := range []string{"0", "-5", "1.5", "abc"} {
		err := x.env.Client.Eval(x.ctx, reserveSrc(), keys, x.s.Epoch().String(), "h", a, "1000", "10", "1000", "1000", "", "0").Err()
		if err == nil {
			t.Fatalf("script accepted amount %q", a)
		}
	}
	eq(t, "balance", x.state().Balance, 1000)
	eq(t, "holds", x.state().Holds, 0)
}

func exerciseReserveColdNoLedger(t *testing.T, env Env) {
	t.Parallel()
	s, err := env.newStore(context.Background(), &balance.Config{Prefix: env.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Reserve(context.Background(), balance.ReserveRequest{Org: randomID("org"), HoldID: "h", Amount: 1})
	if !errors.Is(err, balance.ErrCold) {
		t.Fatalf("got %v, want ErrCold", err)
	}
}

func exerciseReserveColdWarmsOnce(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 500, false)
	x.l.SnapshotDelay = 20 * time.Millisecond
	var wg sync.WaitGroup
	var ok atomic.Int64
	for i := range 20 {
		wg.Go(func() {
			if _, err := x.reserve(fmt.Sprint("h", i), 10); err == nil {
				ok.Add(1)
			} else {
				t.Errorf("reserve: %v", err)
			}
		})
	}
	wg.Wait()
	eq(t, "granted", ok.Load(), 20)
	eq(t, "balance", x.state().Balance, 300)
	// Concurrent warm-ups of one org are collapsed into one snapshot at a time.
	if n, m := x.l.Snapshots.Load(), x.l.MaxConcurrentSnapshots(); n < 1 || n >= 20 || m != 1 {
		t.Fatalf("%d snapshots, %d at once, for 20 reserves on one cold org", n, m)
	}
}

func exerciseReserveOtherEpochIsCold(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 500, true)
	other := balance.Epoch{Gen: x.l.CurrentEpoch().Gen, ID: "other"}
	keys := x.keys().ReserveKeys()
	res, err := x.env.Client.Eval(x.ctx, reserveSrc(), keys, other.String(), "h", "10", "1000", "10", "1000", "1000", "", "0").Slice()
	if err != nil {
		t.Fatal(err)
	}
	eq(t, "reply", res[0].(string), "COLD")
	eq(t, "balance", x.state().Balance, 500)
	eq(t, "holds", x.state().Holds, 0)
}

func exerciseDuplicate(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("h1", 100)
	r := x.mustReserve("h1", 100)
	eq(t, "duplicate", r.Duplicate, true)
	eq(t, "balance reported", r.Balance, 900)
	eq(t, "balance", x.state().Balance, 900)
	eq(t, "held", x.state().Held, 100)
}

func exerciseGoneAfterRelease(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("h1", 100)
	ok, err := x.s.Release(x.ctx, x.org, "h1")
	eq(t, "released", ok, true)
	eq(t, "err", err, nil)
	x.mustRefuse("re-sent reserve", "h1", 100, balance.ErrGone)
	eq(t, "balance", x.state().Balance, 1000)
}

func exerciseGoneAfterSettle(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 1000, true)
	x.mustReserve("h1", 100)
	eq(t, "status", x.charge("h1", 40)[0], balance.Applied)
	x.mustRefuse("re-sent reserve", "h1", 100, balance.ErrGone)
	eq(t, "balance", x.state().Balance, 960)
}

func exerciseTooManyCountsOnlyUnpinned(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{MaxInFlight: 3}, 1000, true)
	for i := range 3 {
		x.mustReserve(fmt.Sprint("h", i), 10)
	}
	x.mustRefuse("4th hold", "h3", 10, balance.ErrTooManyHolds)
	if ok, err := x.s.Pin(x.ctx, x.org, "h0"); !ok || err != nil {
		t.Fatalf("pin: %v %v", ok, err)
	}
	x.mustReserve("h3", 10)
	x.mustRefuse("5th hold", "h4", 10, balance.ErrTooManyHolds)
	st := x.state()
	eq(t, "holds", st.Holds, 4)
	eq(t, "pinned", st.Pinned, 1)
	eq(t, "balance", st.Balance, 960)
}

func exerciseInsufficient(t *testing.T, env Env) {
	t.Parallel()
	x := fixture(t, env, balance.Config{}, 100, true)
	x.mustReserve("h1", 60)
	_, err := x.reserve("h2", 41)
	var ie *balance.InsufficientError
	if !errors.As(err, &ie) || !errors.Is(err, balance.ErrInsufficient) {
		t.Fatalf("got %v, want *InsufficientError", err)
	}
	eq(t, "reported balance", ie.Balance, 40)
	eq(t, "reported amount", ie.Amount, 41)
	x.mustReserve("h2", 40) // exactly the balance is fine
	eq(t, "balance", x.state().Balance, 0)
}
