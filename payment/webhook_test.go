package payment_test

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/payment"
)

// TestWebhookCreditsOnce: a signed payment_intent.succeeded credits the paid amount at the
// currency's rate, in the hot balance when answered; the same event again, the Checkout
// Session's event for the same payment, and an event signed with the previous secret of a
// rotation for it change nothing; every decision is in the audit trail.
func TestWebhookCreditsOnce(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, nil, nil)
		r.createOrg(t, "acme")
		ev := intentSucceeded("evt_pay1", "pi_1", "acme", 2500, nil)
		st, d := r.send(t, ev)
		wantDecision(t, "first delivery", st, d, http.StatusOK, payment.Credited)
		if d.Amount != 2500*usdRate || d.Org != "acme" || d.Ref != "stripe:pi_1" || d.Seq != 1 {
			t.Fatalf("decision %+v", d)
		}
		st2, err := r.store.State(ctxT(t), "acme")
		if err != nil || st2.Balance != 2500*usdRate {
			t.Fatalf("hot balance right after the webhook: %+v %v", st2, err)
		}
		st, d = r.send(t, ev)
		wantDecision(t, "redelivery", st, d, http.StatusOK, payment.Duplicate)
		st, d = r.send(t, sessionCompleted("evt_cs1", "cs_1", "pi_1", "acme", 2500))
		wantDecision(t, "the checkout session's event of the same payment", st, d, http.StatusOK, payment.Duplicate)
		st, d = r.deliver(t, oldSecret, time.Now(), intentSucceeded("evt_pay2", "pi_2", "acme", 100, nil))
		wantDecision(t, "signed with the previous secret (rotation)", st, d, http.StatusOK, payment.Credited)
		if lb, hot := r.balances(t, "acme"); lb != 2600*usdRate || hot != lb {
			t.Fatalf("balances %d / %d, want %d", lb, hot, 2600*usdRate)
		}
		audit := r.auditOf(t, "stripe")
		if len(audit) != 4 || !strings.Contains(audit[0].Detail, "evt_pay1") || !strings.Contains(audit[0].Detail, "credited") ||
			audit[0].Target != "acme" || audit[0].Status != 200 || !strings.Contains(audit[1].Detail, "duplicate") {
			t.Fatalf("audit trail %+v", audit)
		}
	})
}

// TestWebhookConcurrentDeliveries: 50 deliveries of one event at once credit once.
func TestWebhookConcurrentDeliveries(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, nil, nil)
		r.createOrg(t, "acme")
		ev := intentSucceeded("evt_burst", "pi_burst", "acme", 999, nil)
		var wg sync.WaitGroup
		var mu sync.Mutex
		outcomes := map[payment.Outcome]int{}
		start := make(chan struct{})
		for range 50 {
			wg.Go(func() {
				<-start
				st, d := r.send(t, ev)
				mu.Lock()
				defer mu.Unlock()
				if st != http.StatusOK {
					t.Errorf("status %d %+v", st, d)
				}
				outcomes[d.Outcome]++
			})
		}
		close(start)
		wg.Wait()
		if outcomes[payment.Credited] != 1 || outcomes[payment.Duplicate] != 49 {
			t.Fatalf("outcomes %v, want 1 credited and 49 duplicates", outcomes)
		}
		a, err := l.Account(ctxT(t), "acme")
		must(t, err)
		if a.Balance != 999*usdRate || a.LedgerSeq != 1 {
			t.Fatalf("account %+v: want one credit of %d", a, 999*usdRate)
		}
		if _, hot := r.balances(t, "acme"); hot != 999*usdRate {
			t.Fatalf("hot balance %d", hot)
		}
	})
}

// TestWebhookRefused: a forged signature, a secret not configured, a stale timestamp, a
// tampered body and no signature are answered 400 and credit nothing; an unknown event type is
// answered 200 and credits nothing; a payment in a currency without a rate, or for no known
// org, is answered 422 (Stripe retries) and credits nothing. Each is in the audit trail.
func TestWebhookRefused(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, nil, nil)
		r.createOrg(t, "acme")
		ev := intentSucceeded("evt_x", "pi_x", "acme", 500, nil)

		forged := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: ev, Secret: secret})
		sig := []byte(forged.Header)
		sig[len(sig)-1] ^= 1 // one hex digit changed
		if sig[len(sig)-1] > 'f' || (sig[len(sig)-1] > '9' && sig[len(sig)-1] < 'a') {
			sig[len(sig)-1] = '0'
		}
		st, d := r.post(t, string(sig), ev)
		wantDecision(t, "forged signature", st, d, http.StatusBadRequest, payment.Rejected)

		st, d = r.deliver(t, "whsec_attacker", time.Now(), ev)
		wantDecision(t, "wrong secret", st, d, http.StatusBadRequest, payment.Rejected)

		st, d = r.deliver(t, secret, time.Now().Add(-webhook.DefaultTolerance-time.Minute), ev)
		wantDecision(t, "stale timestamp", st, d, http.StatusBadRequest, payment.Rejected)
		if !strings.Contains(d.Detail, "tolerance") {
			t.Fatalf("stale: %+v", d)
		}

		signed := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: ev, Secret: secret})
		tampered := []byte(strings.Replace(string(ev), `"amount_received":500`, `"amount_received":500000`, 1))
		st, d = r.post(t, signed.Header, tampered)
		wantDecision(t, "tampered body", st, d, http.StatusBadRequest, payment.Rejected)

		st, d = r.post(t, "", ev)
		wantDecision(t, "no signature", st, d, http.StatusBadRequest, payment.Rejected)

		st, d = r.send(t, eventJSON("evt_cust", "customer.created", map[string]any{"id": "cus_1", "object": "customer"}, nil))
		wantDecision(t, "unknown type", st, d, http.StatusOK, payment.Ignored)

		eur := []byte(strings.Replace(string(intentSucceeded("evt_eur", "pi_eur", "acme", 500, nil)), `"currency":"usd"`, `"currency":"eur"`, 1))
		st, d = r.send(t, eur)
		wantDecision(t, "currency without a rate", st, d, http.StatusUnprocessableEntity, payment.Unresolved)

		st, d = r.send(t, intentSucceeded("evt_anon", "pi_anon", "", 500, nil))
		wantDecision(t, "no org", st, d, http.StatusUnprocessableEntity, payment.Unresolved)
		st, d = r.send(t, intentSucceeded("evt_ghost", "pi_ghost", "ghost", 500, nil))
		wantDecision(t, "an org that does not exist", st, d, http.StatusUnprocessableEntity, payment.Unresolved)

		a, err := l.Account(ctxT(t), "acme")
		must(t, err)
		if a.Balance != 0 || a.LedgerSeq != 0 {
			t.Fatalf("account after refused events: %+v", a)
		}
		audit := r.auditOf(t, "stripe")
		if len(audit) != 9 {
			t.Fatalf("audit trail has %d records, want 9: %+v", len(audit), audit)
		}
		for i, want := range []int{400, 400, 400, 400, 400, 200, 422, 422, 422} {
			if audit[i].Status != want {
				t.Fatalf("audit record %d: %+v, want status %d", i, audit[i], want)
			}
		}
	})
}

// TestWebhookRefundAfterSpent: a refund of a credit already spent debits it all the same,
// leaving the org in debt, and the decision is flagged; a redelivery debits nothing more.
// Partial refunds debit each its own part.
func TestWebhookRefundAfterSpent(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, nil, nil)
		r.createOrg(t, "acme")
		st, d := r.send(t, intentSucceeded("evt_p", "pi_p", "acme", 1000, nil))
		wantDecision(t, "payment", st, d, http.StatusOK, payment.Credited)
		r.spend(t, "acme", 500*usdRate)

		st, d = r.send(t, chargeRefunded("evt_r1", "ch_p", "pi_p", "", 300, 0)) // org found by its payment's credit
		wantDecision(t, "partial refund", st, d, http.StatusOK, payment.Debited)
		if d.Amount != -300*usdRate || d.Debt || d.Org != "acme" {
			t.Fatalf("partial refund %+v", d)
		}
		ev := chargeRefunded("evt_r2", "ch_p", "pi_p", "", 1000, 300)
		st, d = r.send(t, ev)
		wantDecision(t, "rest refunded", st, d, http.StatusOK, payment.Debited)
		if d.Amount != -700*usdRate || !d.Debt || d.Balance == nil || *d.Balance != -500*usdRate {
			t.Fatalf("refund of spent credit %+v: want a flagged debt of %d", d, -500*usdRate)
		}
		st, d = r.send(t, ev)
		wantDecision(t, "refund redelivered", st, d, http.StatusOK, payment.Duplicate)
		if lb, hot := r.balances(t, "acme"); lb != -500*usdRate || hot != lb {
			t.Fatalf("balances %d / %d, want %d", lb, hot, -500*usdRate)
		}
		audit := r.auditOf(t, "stripe")
		if !strings.Contains(audit[2].Detail, "[debt]") {
			t.Fatalf("the debt is not flagged in the audit trail: %+v", audit[2])
		}
	})
}

// TestWebhookRefundBeforePayment: a refund that arrives before its payment is a debit of its
// own (the org in debt meanwhile) that the payment's credit covers when it arrives: the net is
// the payment less the refund, never a double effect, whatever is redelivered. A refund whose
// org cannot be told yet (no metadata, payment not credited) is answered 422, and Stripe's
// retry after the payment's credit debits it.
func TestWebhookRefundBeforePayment(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, nil, nil)
		r.createOrg(t, "acme")
		refund := chargeRefunded("evt_r", "ch_q", "pi_q", "acme", 400, 0)
		st, d := r.send(t, refund)
		wantDecision(t, "refund first", st, d, http.StatusOK, payment.Debited)
		if !d.Debt {
			t.Fatalf("refund before payment not flagged as debt: %+v", d)
		}
		st, d = r.send(t, intentSucceeded("evt_p", "pi_q", "acme", 1000, nil))
		wantDecision(t, "payment after its refund", st, d, http.StatusOK, payment.Credited)
		for _, ev := range [][]byte{refund, intentSucceeded("evt_p", "pi_q", "acme", 1000, nil)} {
			st, d = r.send(t, ev)
			wantDecision(t, "redelivery", st, d, http.StatusOK, payment.Duplicate)
		}
		if lb, hot := r.balances(t, "acme"); lb != 600*usdRate || hot != lb {
			t.Fatalf("balances %d / %d, want %d", lb, hot, 600*usdRate)
		}

		// No org on the refund and no credit yet: retried until the payment is credited.
		orphan := chargeRefunded("evt_r3", "ch_z", "pi_z", "", 200, 0)
		st, d = r.send(t, orphan)
		wantDecision(t, "refund of an unknown payment", st, d, http.StatusUnprocessableEntity, payment.Unresolved)
		st, d = r.send(t, intentSucceeded("evt_z", "pi_z", "acme", 500, nil))
		wantDecision(t, "its payment", st, d, http.StatusOK, payment.Credited)
		st, d = r.send(t, orphan)
		wantDecision(t, "refund retried", st, d, http.StatusOK, payment.Debited)
		if lb, _ := r.balances(t, "acme"); lb != (600+500-200)*usdRate {
			t.Fatalf("ledger balance %d, want %d", lb, (600+500-200)*usdRate)
		}
	})
}

// TestWebhookDispute: a dispute freezes the org when configured (and is only noted when not).
func TestWebhookDispute(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, l ledger.Ledger) {
		r := newRig(t, l, &payment.Config{FreezeOnDispute: true}, nil)
		r.createOrg(t, "acme")
		st, d := r.send(t, intentSucceeded("evt_p", "pi_d", "acme", 1000, nil))
		wantDecision(t, "payment", st, d, http.StatusOK, payment.Credited)
		dispute := eventJSON("evt_dp", "charge.dispute.created", map[string]any{
			"id": "dp_1", "object": "dispute", "amount": 1000, "currency": "usd", "charge": "ch_d", "payment_intent": "pi_d",
			"reason": "fraudulent", "status": "needs_response",
		}, nil)
		st, d = r.send(t, dispute)
		wantDecision(t, "dispute", st, d, http.StatusOK, payment.Frozen)
		if d.Org != "acme" {
			t.Fatalf("dispute %+v", d)
		}
		lims, err := l.Limits(ctxT(t), "acme")
		must(t, err)
		if len(lims.Frozen) != 1 {
			t.Fatal("org not frozen after the dispute")
		}
	})
}

// TestWebhookNoRetryWithoutOrg: events that need no org are never answered 422 (which Stripe
// would retry for days): a failed payment that is no top-up, a dispute with the freeze off.
func TestWebhookNoRetryWithoutOrg(t *testing.T) {
	t.Parallel()
	r := newRig(t, memledger.New(), nil, nil)
	failed := eventJSON("evt_f", "payment_intent.payment_failed", map[string]any{
		"id": "pi_f", "object": "payment_intent", "amount": 100, "currency": "usd", "metadata": map[string]string{},
	}, nil)
	st, d := r.send(t, failed)
	wantDecision(t, "payment_failed of no top-up", st, d, http.StatusOK, payment.Ignored)
	dispute := eventJSON("evt_d", "charge.dispute.created", map[string]any{
		"id": "dp_x", "object": "dispute", "amount": 100, "currency": "usd", "charge": "ch_x", "payment_intent": "pi_x",
	}, nil)
	st, d = r.send(t, dispute)
	wantDecision(t, "dispute of an unknown payment, freeze off", st, d, http.StatusOK, payment.Noted)
}
