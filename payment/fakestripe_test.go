package payment_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"

	"github.com/stripe/stripe-go/v82"
)

// fakeStripe is a local stand-in for the one Stripe API endpoint auto top-up uses: POST
// /v1/payment_intents (create and confirm off-session), with Stripe's Idempotency-Key
// semantics (the same key gets the first answer again, and creates nothing) and a card that
// declines (pm_card_chargeDeclined, answered 402 card_error as Stripe does). stripe-mock is
// served by the Go module proxy, but it is stateless: it neither replays idempotent requests
// nor declines cards ("testing for specific responses and errors is not supported"), which is
// what these tests are about.
type fakeStripe struct {
	srv *httptest.Server

	mu       sync.Mutex
	answers  map[string]fakeAnswer // by idempotency key
	created  []fakeIntent          // PaymentIntents created, in order
	requests int
	keys     []string // the Idempotency-Key of every create request, in order
	failNext int      // answer the next creates 500 (an outage: nothing created, nothing saved)
}

type fakeAnswer struct {
	status int
	body   []byte
}

type fakeIntent struct {
	ID, Key, Org, TopUp, Customer, PaymentMethod, Currency string
	Amount                                                 int64
	OffSession, Confirm                                    bool
}

const declinedCard = "pm_card_chargeDeclined"

func newFakeStripe(t *testing.T) *fakeStripe {
	f := &fakeStripe{answers: map[string]fakeAnswer{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// client is a stripe-go client whose API backend is the fake.
func (f *fakeStripe) client() *stripe.Client {
	return stripe.NewClient("sk_test_fake", stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL: stripe.String(f.srv.URL), MaxNetworkRetries: stripe.Int64(0), LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
	})))
}

func (f *fakeStripe) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests++
	answer := func(a fakeAnswer) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
	}
	if r.Method != http.MethodPost || r.URL.Path != "/v1/payment_intents" {
		answer(stripeError(http.StatusNotFound, "invalid_request_error", "resource_missing", "", nil))
		return
	}
	key := r.Header.Get("Idempotency-Key")
	f.keys = append(f.keys, key)
	if f.failNext > 0 {
		f.failNext--
		answer(stripeError(http.StatusInternalServerError, "api_error", "", "", nil))
		return
	}
	if a, ok := f.answers[key]; ok && key != "" {
		answer(a) // Stripe replays the first answer of a key
		return
	}
	if err := r.ParseForm(); err != nil {
		answer(stripeError(http.StatusBadRequest, "invalid_request_error", "parameter_invalid", "", nil))
		return
	}
	amount, _ := strconv.ParseInt(r.PostForm.Get("amount"), 10, 64)
	pi := fakeIntent{
		ID: fmt.Sprintf("pi_fake_%d", len(f.created)+1), Key: key, Amount: amount, Currency: r.PostForm.Get("currency"),
		Customer: r.PostForm.Get("customer"), PaymentMethod: r.PostForm.Get("payment_method"),
		Org: r.PostForm.Get("metadata[escrow_org]"), TopUp: r.PostForm.Get("metadata[escrow_topup]"),
		OffSession: r.PostForm.Get("off_session") == "true", Confirm: r.PostForm.Get("confirm") == "true",
	}
	f.created = append(f.created, pi)
	obj := map[string]any{
		"id": pi.ID, "object": "payment_intent", "amount": pi.Amount, "currency": pi.Currency, "customer": pi.Customer,
		"payment_method": pi.PaymentMethod, "status": "succeeded", "amount_received": pi.Amount,
		"metadata": map[string]string{"escrow_org": pi.Org, "escrow_topup": pi.TopUp},
	}
	var a fakeAnswer
	if pi.PaymentMethod == declinedCard {
		obj["status"], obj["amount_received"] = "requires_payment_method", 0
		a = stripeError(http.StatusPaymentRequired, "card_error", "card_declined", "generic_decline", obj)
	} else {
		body, _ := json.Marshal(obj)
		a = fakeAnswer{status: http.StatusOK, body: body}
	}
	if key != "" {
		f.answers[key] = a
	}
	answer(a)
}

func stripeError(status int, typ, code, decline string, pi map[string]any) fakeAnswer {
	e := map[string]any{"type": typ, "code": code, "message": "fake stripe: " + code}
	if decline != "" {
		e["decline_code"] = decline
	}
	if pi != nil {
		e["payment_intent"] = pi
	}
	body, _ := json.Marshal(map[string]any{"error": e})
	return fakeAnswer{status: status, body: body}
}

// intents returns the PaymentIntents created so far.
func (f *fakeStripe) intents() []fakeIntent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeIntent(nil), f.created...)
}
