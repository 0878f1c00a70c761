package accounting_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

// grantBackends runs fn on real Redis with the memory ledger and with the Postgres ledger.
func grantBackends(t *testing.T, fn func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger)) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		fn(t, testutil.RealRedis(t), memledger.New())
	})
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		fn(t, testutil.RealRedis(t), openTestPostgres(t))
	})
}

// ledgerB is B(k): the org's ledger balance after its entries with seq ≤ k.
func ledgerB(l ledger.Ledger, org string, k int64) (int64, error) {
	es, _, err := l.EntriesAfter(context.Background(), org, 0, 100_000)
	var b int64
	for _, e := range es {
		if e.Seq <= k {
			b += e.Delta
		}
	}
	return b, err
}

// TestGrantExpiryBurst: an org with paid credit P and promotional credit G that expires at T.
// 2,000 requests: 1,000 reserved at once on a store whose script clock is before T, then, while
// those are charged, 1,000 at once on a store whose clock is past it (the rollover comes in the
// middle of the burst, on the Redis clock; holds taken before T settle after it), each charged
// while the worker settles: a random cost up to its hold before T, its whole hold after T. The invariant
// bal + Σ holds + expired = B(wm) holds at every read during the burst; no hold reserved after T
// spends G (the ledger ends at or above zero: had the hot balance let holds after T spend G's
// rest, the expire entry would leave the org in debt); the ledger has one expire entry, of
// exactly G's unspent rest (G less what the requests reserved before T were charged, G being
// spent first); and at rest the hot balance equals the ledger.
func TestGrantExpiryBurst(t *testing.T) {
	t.Parallel()
	grantBackends(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		const org, paid, promo, n = "burst", 8_000, 30_000, 2000
		before := newStore(t, env, l, balance.Config{MaxInFlight: n + 10})
		after := newStore(t, env, l, balance.Config{MaxInFlight: n + 10, ClockOffset: time.Hour})
		w := newWorker(t, l, before, &accounting.WorkerConfig{Logger: quiet, SweepInterval: 50 * time.Millisecond})
		ops := accounting.NewOps(w)
		if err := l.CreateOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
		now, err := before.Now(ctx)
		if err != nil {
			t.Fatal(err)
		}
		at := now.Add(30 * time.Minute).Truncate(time.Millisecond)
		if _, _, err := ops.CreditGrant(ctx, org, paid, "paid-1", grant.Paid); err != nil {
			t.Fatal(err)
		}
		if _, _, err := ops.CreditGrant(ctx, org, promo, "promo-1", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}); err != nil {
			t.Fatal(err)
		}
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = w.Stop(context.Background()) })

		// check: bal + Σ holds + expired = B(wm), read until a state and the ledger agree or the
		// state stayed the same across the ledger read (a settle may land in between).
		check := func(where string) error {
			for range 20 {
				st, err := before.State(ctx, org)
				if err != nil {
					return err
				}
				if !st.Exists {
					return nil
				}
				b, err := ledgerB(l, org, st.Watermark)
				if err != nil {
					return err
				}
				if st.Balance+st.Held+st.Expired == b {
					return nil
				}
				if st2, _ := before.State(ctx, org); st2.Watermark == st.Watermark && st2.Balance == st.Balance && st2.Held == st.Held {
					return fmt.Errorf("%s: invariant: bal %d + held %d + expired %d != B(%d) %d", where, st.Balance, st.Held, st.Expired, st.Watermark, b)
				}
			}
			return nil
		}
		mustCheck := func(where string) {
			t.Helper()
			if err := check(where); err != nil {
				t.Fatal(err)
			}
		}

		var (
			wg                             sync.WaitGroup
			beforeCost, okAfter, afterCost atomic.Int64
			okBefore                       atomic.Int64
			stop                           = make(chan struct{})
			checked                        = make(chan error, 1)
			checks                         atomic.Int64
		)
		go func() { // the invariant, read again and again while the burst runs
			for {
				select {
				case <-stop:
					checked <- nil
					return
				default:
				}
				if err := check("during the burst"); err != nil {
					checked <- err
					return
				}
				checks.Add(1)
			}
		}()
		// The burst: n/2 requests reserve before T, all at once; while they are in flight, n/2
		// reserve on the store past T, all at once, and the first half is charged meanwhile (so
		// their holds, taken before T, settle after the rollover). A request after T that is
		// refused tries once more after every request before T has settled (the rollover's
		// conservative share has come back by then), so both halves always have granted holds.
		var (
			reservedBefore, chargedBefore sync.WaitGroup
			startBefore, startAfter       = make(chan struct{}), make(chan struct{})
			beforeSettled                 = make(chan struct{})
			beforeIDs                     = make([]string, n/2)
		)
		charge := func(id string, amount, cost int64, res balance.Reservation) {
			ev := ledger.UsageEvent{ID: id, Org: org, Model: "m", Usage: pricing.Usage{Prompt: 1}, Cost: cost,
				HoldAmount: amount, ReservedAt: res.ReservedAt, CreatedAt: time.Now()}
			if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
				t.Error(err)
				return
			}
			w.Notify(org)
		}
		for i := range n / 2 {
			reservedBefore.Add(1)
			chargedBefore.Add(1)
			beforeIDs[i] = newID()
			go func() {
				defer chargedBefore.Done()
				r := rand.New(rand.NewPCG(uint64(i), 7))
				amount, id := 1+r.Int64N(50), beforeIDs[i]
				<-startBefore
				res, err := before.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: amount})
				reservedBefore.Done()
				if errors.Is(err, balance.ErrInsufficient) {
					return
				}
				if err != nil || !res.ReservedAt.Before(at) {
					t.Errorf("reserve before the expiry: %+v %v", res, err)
					return
				}
				okBefore.Add(1)
				cost := r.Int64N(amount + 1)
				beforeCost.Add(cost)
				<-startAfter // charged while the second half reserves past T
				charge(id, amount, cost, res)
			}()
		}
		for i := range n / 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(i), 11))
				amount := 1 + r.Int64N(50)
				<-startAfter
				for try := 0; try < 2; try++ {
					id := newID()
					res, err := after.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: id, Amount: amount})
					if errors.Is(err, balance.ErrInsufficient) && try == 0 {
						<-beforeSettled
						continue
					}
					if errors.Is(err, balance.ErrInsufficient) {
						return
					}
					if err != nil || res.ReservedAt.Before(at) {
						t.Errorf("reserve after the expiry: %+v %v", res, err)
						return
					}
					okAfter.Add(1)
					afterCost.Add(amount)
					charge(id, amount, amount, res) // its whole hold: a hold that spent expired credit shows in the ledger
					return
				}
			}()
		}
		close(startBefore)
		reservedBefore.Wait()
		close(startAfter)
		chargedBefore.Wait()
		deadline := time.Now().Add(waitLimit)
		for { // every request before T settled (its usage accounted and in the hot balance)
			busy, err := l.UnsettledUsage(ctx, org, beforeIDs)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Contains(slices.Collect(maps.Values(busy)), true) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the requests before the expiry did not settle")
			}
			time.Sleep(5 * time.Millisecond)
		}
		close(beforeSettled)
		wg.Wait()
		// Every request has been charged: wait until the hot balance has settled them all.
		for {
			acct, err := l.Account(ctx, org)
			st, err2 := before.State(ctx, org)
			if err == nil && err2 == nil && acct.Pending == 0 && st.Holds == 0 && st.Watermark == acct.LedgerSeq && acct.SettledSeq == acct.LedgerSeq {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("not settled: %+v %+v", acct, st)
			}
			time.Sleep(10 * time.Millisecond)
		}
		close(stop)
		if err := <-checked; err != nil {
			t.Fatal(err)
		}
		mustCheck("settled")
		if okBefore.Load() == 0 || okAfter.Load() == 0 {
			t.Fatalf("the burst did not straddle the expiry: %d holds before, %d after", okBefore.Load(), okAfter.Load())
		}
		// The expiry's entry, written once the ledger's clock is past it (twice: exactly once).
		for range 2 {
			g, _ := l.(grant.Store)
			if _, err := g.ExpireGrants(ctx, org, at); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.SettleOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
		mustCheck("after the expire entry")
		es, _, err := l.EntriesAfter(ctx, org, 0, 100_000)
		if err != nil {
			t.Fatal(err)
		}
		wantRest := max(0, promo-beforeCost.Load())
		var expires []balance.Entry
		for _, e := range es {
			if !e.Expired.IsZero() {
				expires = append(expires, e)
			}
		}
		if len(expires) != 1 || expires[0].Delta != -wantRest || !expires[0].LastOfExpiry {
			t.Fatalf("expire entries %+v, want one of %d", expires, -wantRest)
		}
		acct, err := l.Account(ctx, org)
		if err != nil {
			t.Fatal(err)
		}
		st, err := before.State(ctx, org)
		if err != nil {
			t.Fatal(err)
		}
		if st.Balance != acct.Balance || st.Expired != 0 || st.Held != 0 {
			t.Fatalf("at rest: hot %+v, ledger balance %d", st, acct.Balance)
		}
		// What the requests after T spent is paid credit only: P less what the charges before T
		// took from it once G was spent.
		if room := paid - max(0, beforeCost.Load()-promo); afterCost.Load() > room {
			t.Fatalf("requests after the expiry spent %d, more than the paid credit left to them (%d)", afterCost.Load(), room)
		}
		if acct.Balance < 0 {
			t.Fatalf("ledger balance %d < 0: holds after the expiry spent the expired grant", acct.Balance)
		}
		gs, err := ops.Grants(ctx, org)
		if err != nil {
			t.Fatal(err)
		}
		var paidRest int64
		for _, g := range gs {
			if g.ExpiresAt.IsZero() {
				paidRest += g.Rest
			} else if !g.Expired || g.ExpiredAmount != wantRest || g.Rest != 0 {
				t.Fatalf("promo grant after expiry: %+v", g)
			}
		}
		if paidRest != acct.Balance {
			t.Fatalf("paid grant's rest %d, ledger balance %d", paidRest, acct.Balance)
		}
		t.Logf("holds before T %d (charged %d), after T %d (charged %d); expired %d; balance %d; invariant read %d times",
			okBefore.Load(), beforeCost.Load(), okAfter.Load(), afterCost.Load(), wantRest, acct.Balance, checks.Load())
	})
}

// newExpiryRig is a worker over a memory ledger and miniredis with the org acme, the Redis
// clock set to now, and at an hour later (the expiry the tests give their grants).
func newExpiryRig(t *testing.T) (*testutil.RedisEnv, *memledger.Ledger, *balance.Store, *accounting.Worker, *accounting.Ops, time.Time) {
	t.Helper()
	env := testutil.MiniRedis(t)
	l := memledger.New()
	store := newStore(t, env, l, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	if err := l.CreateOrg(context.Background(), "acme"); err != nil {
		t.Fatal(err)
	}
	now := time.Now().Truncate(time.Millisecond)
	env.Mini.SetTime(now)
	return env, l, store, w, accounting.NewOps(w), now.Add(time.Hour)
}

// TestGrantViewAcrossExpiry: between an expiry's rollover and its expire entry, the customer
// view's totals stay consistent (credited − charged − held = available): the rolled-over rest is
// out of both, and the grant is listed until its expire entry.
func TestGrantViewAcrossExpiry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, l, store, w, ops, at := newExpiryRig(t)
	if _, _, err := ops.CreditGrant(ctx, "acme", 700, "paid", grant.Paid); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ops.CreditGrant(ctx, "acme", 300, "promo", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}); err != nil {
		t.Fatal(err)
	}
	consistent := func(where string, wantAvail, wantExpired int64, wantGrants int) {
		t.Helper()
		v, err := ops.CustomerView(ctx, "acme", "")
		if err != nil {
			t.Fatal(err)
		}
		if v.Credited-v.Charged-v.Held != v.Available || v.Available != wantAvail || v.Expired != wantExpired || len(v.Grants) != wantGrants {
			t.Fatalf("%s: view %+v, want available %d, expired %d, %d grants", where, v, wantAvail, wantExpired, wantGrants)
		}
	}
	consistent("before", 1000, 0, 2)
	env.Mini.SetTime(at.Add(time.Second)) // the Redis clock passes the expiry: the next reserve rolls it over
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 701}); !errors.Is(err, balance.ErrInsufficient) {
		t.Fatalf("reserve of more than the paid credit after the expiry: %v", err)
	}
	consistent("rolled over", 700, 300, 2)
	if _, err := l.ExpireGrants(ctx, "acme", at); err != nil {
		t.Fatal(err)
	}
	if err := w.SettleOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	consistent("expire entry settled", 700, 0, 1)
}

// TestGrantExpiryWaitsForHolds: the worker writes no expire entry while a hold reserved before
// the expiry is in flight (its usage would come too late to spend the grant); once that request
// is charged, the entry takes exactly what it left.
func TestGrantExpiryWaitsForHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env, l, store, w, ops, at := newExpiryRig(t)
	if _, _, err := ops.CreditGrant(ctx, "acme", 300, "promo", grant.Options{Priority: grant.PriorityPromotional, ExpiresAt: at}); err != nil {
		t.Fatal(err)
	}
	id := newID()
	res, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 200})
	if err != nil {
		t.Fatal(err)
	}
	env.Mini.SetTime(at.Add(time.Minute))
	if n, err := w.ExpireDue(ctx, at); err != nil || n != 1 { // one org visited
		t.Fatalf("expiry pass: %d %v", n, err)
	}
	if due, err := l.DueGrants(ctx, at, 10); err != nil || len(due) != 1 {
		t.Fatalf("the grant was expired under a hold reserved before its expiry: %v %v", due, err)
	}
	if w.Stats().GrantsWaiting != 1 {
		t.Fatalf("stats %+v", w.Stats())
	}
	ev := ledger.UsageEvent{ID: id, Org: "acme", Model: "m", Usage: pricing.Usage{Prompt: 1}, Cost: 120, HoldAmount: 200, ReservedAt: res.ReservedAt, CreatedAt: time.Now()}
	if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
		t.Fatal(err)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := w.ExpireDue(ctx, at); err != nil {
		t.Fatal(err)
	}
	es, _, err := l.EntriesAfter(ctx, "acme", 0, 100)
	if err != nil {
		t.Fatal(err)
	}
	if last := es[len(es)-1]; last.Expired.IsZero() || last.Delta != -180 {
		t.Fatalf("expire entry %+v, want −180 (300 less the 120 the request reserved before it spent)", last)
	}
	st, err := store.State(ctx, "acme")
	if err != nil || st.Balance != 0 || st.Expired != 0 || st.Holds != 0 {
		t.Fatalf("hot balance after the expiry: %+v %v", st, err)
	}
}
