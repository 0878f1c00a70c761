package payment_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
	"github.com/llmescrow/escrow/payment"
)

// clock is an injected clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// topUpRig is a rig with n workers on its ledger and hot balance (n processes), each with its
// own auto top-up runner hooked to its account passes, all against one fake Stripe.
type topUpRig struct {
	*rig
	fake    *fakeStripe
	clock   *clock
	workers []*accounting.Worker
	topups  []*payment.TopUps
}

func newTopUpRig(t *testing.T, l ledger.Ledger, n int) *topUpRig {
	t.Helper()
	c := &clock{t: time.Date(2026, 3, 10, 0, 0, 0, 0, time.UTC)}
	tr := &topUpRig{fake: newFakeStripe(t), clock: c}
	hooks := make([]atomic.Pointer[payment.TopUps], n)
	tr.rig = newRig(t, l, &payment.Config{Now: c.Now}, &accounting.WorkerConfig{Charged: func(orgs []string) {
		if tu := hooks[0].Load(); tu != nil {
			tu.Charged(orgs)
		}
	}})
	for i := range n {
		w := tr.worker
		if i > 0 {
			var err error
			w, err = accounting.NewWorker(l, tr.store, &accounting.WorkerConfig{Logger: quiet, Charged: func(orgs []string) {
				if tu := hooks[i].Load(); tu != nil {
					tu.Charged(orgs)
				}
			}})
			must(t, err)
		}
		tu, err := payment.NewTopUps(accounting.NewOps(w), &payment.TopUpConfig{Stripe: tr.fake.client(), Now: c.Now, Logger: quiet})
		must(t, err)
		hooks[i].Store(tu)
		tr.workers, tr.topups = append(tr.workers, w), append(tr.topups, tu)
	}
	return tr
}

func (tr *topUpRig) settings(t *testing.T, s topup.Settings) {
	t.Helper()
	if _, err := tr.ops.PutTopUp(ctxT(t), s); err != nil {
		t.Fatal(err)
	}
}

// pass: usage of cost recorded, worker i's account pass, runner i's checks.
func (tr *topUpRig) pass(t *testing.T, i int, org string, cost int64) {
	tr.spendWith(t, tr.workers[i], org, cost)
	if err := tr.topups[i].Drain(ctxT(t)); err != nil {
		t.Errorf("drain: %v", err)
	}
}

// confirm delivers the payment_intent.succeeded webhook of a created PaymentIntent.
func (tr *topUpRig) confirm(t *testing.T, pi fakeIntent) payment.Decision {
	t.Helper()
	st, d := tr.send(t, intentSucceeded("evt_"+pi.ID, pi.ID, pi.Org, pi.Amount, map[string]string{payment.MetadataTopUp: pi.TopUp}))
	wantDecision(t, "top-up webhook", st, d, http.StatusOK, payment.Credited)
	return d
}

func acmeTopUp(pm string) topup.Settings {
	return topup.Settings{Org: "acme", Threshold: 5_000_000, Amount: 1000, Currency: "usd", Customer: "cus_acme",
		PaymentMethod: pm, DailyCap: 3000, MonthlyCap: 100_000}
}

// newAcmeTopUpRig is newTopUpRig with the org acme created and its top-up set up to charge pm.
func newAcmeTopUpRig(t *testing.T, l ledger.Ledger, n int, pm string) *topUpRig {
	t.Helper()
	tr := newTopUpRig(t, l, n)
	tr.createOrg(t, "acme")
	tr.settings(t, acmeTopUp(pm))
	return tr
}

// TestTopUpOneInFlight: 100 concurrent usage records and account passes, on 4 workers (4
// processes) each with its own runner, take the org below its threshold: exactly one
// PaymentIntent is created (off-session, confirmed, its idempotency key the attempt's id), and
// it is credited only by its webhook, once.
func TestTopUpOneInFlight(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		tr := newAcmeTopUpRig(t, l, 4, "pm_card_visa")
		_, _, err := tr.ops.Credit(ctxT(t), "acme", 10_000_000, "seed")
		must(t, err)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range 100 {
			wg.Go(func() {
				<-start
				tr.pass(t, i%4, "acme", 100_000)
			})
		}
		close(start)
		wg.Wait()
		for i := range tr.workers {
			tr.pass(t, i, "acme", 1)
		}
		pis := tr.fake.intents()
		if len(pis) != 1 {
			t.Fatalf("%d PaymentIntents created, want 1: %+v", len(pis), pis)
		}
		pi := pis[0]
		if pi.Key == "" || pi.Key != pi.TopUp || pi.Org != "acme" || pi.Amount != 1000 || pi.Currency != "usd" ||
			!pi.OffSession || !pi.Confirm || pi.Customer != "cus_acme" || pi.PaymentMethod != "pm_card_visa" {
			t.Fatalf("PaymentIntent %+v", pi)
		}
		before, _ := tr.balances(t, "acme")
		if before != 10_000_000-100*100_000-4 {
			t.Fatalf("ledger balance %d before the webhook: the top-up was credited without it", before)
		}
		d := tr.confirm(t, pi)
		if d.Amount != 1000*usdRate {
			t.Fatalf("top-up credit %+v", d)
		}
		st, d2 := tr.send(t, intentSucceeded("evt_"+pi.ID, pi.ID, pi.Org, pi.Amount, map[string]string{payment.MetadataTopUp: pi.TopUp}))
		wantDecision(t, "top-up webhook again", st, d2, http.StatusOK, payment.Duplicate)
		if lb, hot := tr.balances(t, "acme"); lb != before+1000*usdRate || hot != lb {
			t.Fatalf("balances %d / %d after the top-up, want %d", lb, hot, before+1000*usdRate)
		}
		top, err := tr.ops.TopUp(ctxT(t), "acme")
		must(t, err)
		if len(top.Attempts) != 1 || top.Attempts[0].Status != topup.Succeeded || top.Attempts[0].Payment != pi.ID {
			t.Fatalf("attempts %+v", top.Attempts)
		}
	})
}

// TestTopUpDeclinedStops: a declined card ends the attempt and stops the org's top-ups: the
// passes after it create no PaymentIntent, until the settings are updated.
func TestTopUpDeclinedStops(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		tr := newAcmeTopUpRig(t, l, 1, declinedCard)
		for range 10 {
			tr.pass(t, 0, "acme", 1_000_000)
		}
		if pis := tr.fake.intents(); len(pis) != 1 {
			t.Fatalf("%d PaymentIntents after a decline, want 1", len(pis))
		}
		top, err := tr.ops.TopUp(ctxT(t), "acme")
		must(t, err)
		if top.Stopped == "" || len(top.Attempts) != 1 || top.Attempts[0].Status != topup.Failed ||
			!strings.Contains(top.Attempts[0].Reason, "card_declined") || top.Attempts[0].Payment == "" {
			t.Fatalf("after a decline: %+v", top)
		}
		_, err = tr.topups[0].Check(ctxT(t), "acme")
		if !errors.Is(err, topup.ErrStopped) {
			t.Fatalf("Check after a decline: %v, want ErrTopUpStopped", err)
		}
		var failed bool
		for _, a := range tr.auditOf(t, "escrow.topup") {
			failed = failed || (a.Action == "topup.failed" && a.Target == "acme")
		}
		if !failed {
			t.Fatal("no topup.failed in the audit trail")
		}
		// Updated settings (a new card): top-ups run again.
		tr.settings(t, acmeTopUp("pm_card_visa"))
		tr.pass(t, 0, "acme", 1)
		if pis := tr.fake.intents(); len(pis) != 2 || pis[1].PaymentMethod != "pm_card_visa" {
			t.Fatalf("after the update: %+v", pis)
		}
	})
}

// TestTopUpDailyCap: every half hour for 26 simulated hours a charge takes the org below its
// threshold and each top-up's webhook credits it; the daily cap (3 top-ups' worth) holds for
// the first UTC day and the next day starts afresh. The clock is injected; nothing sleeps.
func TestTopUpDailyCap(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		tr := newAcmeTopUpRig(t, l, 1, "pm_card_visa")
		perDay := map[int]int{}
		seen := 0
		var capped int
		for range 52 {
			tr.pass(t, 0, "acme", 2_000_000)
			pis := tr.fake.intents()
			for _, pi := range pis[seen:] {
				perDay[tr.clock.Now().Day()]++
				tr.confirm(t, pi)
			}
			if len(pis) == seen {
				_, err := tr.topups[0].Check(ctxT(t), "acme")
				if errors.Is(err, topup.ErrCap) {
					capped++
				}
			}
			seen = len(pis)
			tr.clock.Advance(30 * time.Minute)
		}
		if perDay[10] != 3 || perDay[11] < 1 || perDay[11] > 3 || capped == 0 {
			t.Fatalf("top-ups per day %v (want 3 on the 10th, some on the 11th), %d checks capped", perDay, capped)
		}
		var sum int64
		top, err := tr.ops.TopUp(context.Background(), "acme")
		must(t, err)
		for _, a := range top.Attempts {
			if a.CreatedAt.Day() == 10 && a.Status == topup.Succeeded {
				sum += a.Amount
			}
		}
		if sum != 3000 {
			t.Fatalf("topped up %d on the 10th, want the cap 3000", sum)
		}
	})
}

// TestTopUpFailedWebhook: an attempt whose PaymentIntent fails later (payment_intent.payment_failed
// naming it) ends as failed and stops the org's top-ups, like a decline at creation; the same
// event again changes nothing.
func TestTopUpFailedWebhook(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		tr := newAcmeTopUpRig(t, l, 1, "pm_card_visa")
		tr.pass(t, 0, "acme", 1)
		pis := tr.fake.intents()
		if len(pis) != 1 {
			t.Fatalf("%d PaymentIntents, want 1", len(pis))
		}
		failed := eventJSON("evt_fail", "payment_intent.payment_failed", map[string]any{
			"id": pis[0].ID, "object": "payment_intent", "amount": 1000, "currency": "usd", "status": "requires_payment_method",
			"metadata":           map[string]string{payment.MetadataOrg: "acme", payment.MetadataTopUp: pis[0].TopUp},
			"last_payment_error": map[string]string{"code": "card_declined", "decline_code": "insufficient_funds"},
		}, nil)
		st, d := tr.send(t, failed)
		wantDecision(t, "payment_failed", st, d, http.StatusOK, payment.TopUpFailed)
		st, d = tr.send(t, failed)
		wantDecision(t, "payment_failed again", st, d, http.StatusOK, payment.TopUpFailed)
		top, err := tr.ops.TopUp(ctxT(t), "acme")
		must(t, err)
		if top.Stopped == "" || top.Attempts[0].Status != topup.Failed || top.Attempts[0].Reason != "card_declined insufficient_funds" {
			t.Fatalf("after payment_failed: %+v", top)
		}
		for range 3 {
			tr.pass(t, 0, "acme", 1)
		}
		if n := len(tr.fake.intents()); n != 1 {
			t.Fatalf("%d PaymentIntents after the failure, want 1", n)
		}
		if a, _ := tr.balances(t, "acme"); a != -4 {
			t.Fatalf("ledger balance %d: the failed top-up was credited", a)
		}
	})
}

// TestTopUpRetrySameKey: when Stripe fails (500), the attempt stays pending without a payment
// and the next check sends the same Idempotency-Key: one PaymentIntent in the end.
func TestTopUpRetrySameKey(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		tr := newAcmeTopUpRig(t, l, 1, "pm_card_visa")
		tr.fake.mu.Lock()
		tr.fake.failNext = 1
		tr.fake.mu.Unlock()
		tr.spend(t, "acme", 1)
		a, err := tr.topups[0].Check(ctxT(t), "acme")
		if err == nil || payment.Quiet(err) || a.ID == "" {
			t.Fatalf("Check while Stripe fails: %+v %v, want the error", a, err)
		}
		b, err := tr.topups[0].Check(ctxT(t), "acme")
		must(t, err)
		if b.ID != a.ID || b.Payment == "" {
			t.Fatalf("retry: attempt %+v, want %s with its payment", b, a.ID)
		}
		tr.fake.mu.Lock()
		keys := append([]string(nil), tr.fake.keys...)
		tr.fake.mu.Unlock()
		if len(keys) != 2 || keys[0] != a.ID || keys[1] != a.ID || len(tr.fake.intents()) != 1 {
			t.Fatalf("idempotency keys %v, %d intents", keys, len(tr.fake.intents()))
		}
		if _, err := tr.topups[0].Check(ctxT(t), "acme"); !errors.Is(err, topup.ErrInFlight) {
			t.Fatalf("third check: %v, want ErrTopUpInFlight", err)
		}
	})
}
