package server

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"
)

// TestStripeWebhookThroughTheProxy: with ESCROW_STRIPE_WEBHOOK_SECRETS and ESCROW_PAYMENT_RATES
// set, POST /webhooks/stripe on the running proxy turns a signed payment into a credit the
// org's next request can spend, once; an unsigned one is refused with 400.
func TestStripeWebhookThroughTheProxy(t *testing.T) {
	t.Parallel()
	bothModes(t, func(t *testing.T, real bool) {
		p := startTestProxy(t, real, func(c *Config) {
			c.StripeWebhookSecrets = " whsec_old , whsec_new"
			c.PaymentRates = "usd=10"
			c.StripeAPIKey, c.StripeAPIURL = "sk_test_unused", "http://127.0.0.1:9" // auto top-up runs; no org has one
		})
		p.setup("acme", 0, 65)
		payload := []byte(`{"id":"evt_1","object":"event","type":"payment_intent.succeeded","data":{"object":` +
			`{"id":"pi_1","object":"payment_intent","amount_received":1234,"currency":"usd","metadata":{"escrow_org":"acme"}}}}`)
		post := func(header string) (int, string) {
			req, _ := http.NewRequest("POST", p.base+"/webhooks/stripe", bytes.NewReader(payload))
			if header != "" {
				req.Header.Set("Stripe-Signature", header)
			}
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Body.Close()
			b, _ := io.ReadAll(res.Body)
			return res.StatusCode, string(b)
		}
		if st, b := post(""); st != http.StatusBadRequest {
			t.Fatalf("unsigned: %d %s", st, b)
		}
		sig := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: payload, Secret: "whsec_new", Timestamp: time.Now()})
		for i, want := range []string{`"outcome":"credited"`, `"outcome":"duplicate"`} {
			if st, b := post(sig.Header); st != http.StatusOK || !strings.Contains(b, want) {
				t.Fatalf("delivery %d: %d %s", i, st, b)
			}
		}
		if b := p.settled("acme"); b.LedgerBalance != 12340 || b.Available != 12340 {
			t.Fatalf("balance after the payment: %+v", b)
		}
		res, err := http.Get(p.base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		m, _ := io.ReadAll(res.Body)
		res.Body.Close()
		for _, want := range []string{`escrow_payment_events_total{outcome="credited"} 1`, `escrow_payment_events_total{outcome="duplicate"} 1`,
			`escrow_payment_events_total{outcome="rejected"} 1`, "escrow_topups_started_total 0"} {
			if !strings.Contains(string(m), want) {
				t.Fatalf("metrics lack %s", want)
			}
		}
	})
}

func TestPaymentConfig(t *testing.T) {
	t.Parallel()
	r, err := parseRates(" USD=10000, eur=10800 ,")
	if err != nil || r["usd"] != 10000 || r["eur"] != 10800 || len(r) != 2 {
		t.Fatalf("rates %v %v", r, err)
	}
	for _, bad := range []string{"usd", "usd=0", "usd=-1", "dollar=1", "usd=1.5"} {
		if _, err := parseRates(bad); !errors.Is(err, ErrConfig) {
			t.Fatalf("rates %q: %v, want ErrConfig", bad, err)
		}
	}
	s := &Server{cfg: *DefaultConfig()}
	s.cfg.StripeWebhookSecrets = "whsec_x"
	if err := s.openPayments(); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "ESCROW_PAYMENT_RATES") {
		t.Fatalf("Stripe without rates: %v", err)
	}
	if s.cfg.StripeWebhookSecrets = ""; s.openPayments() != nil || s.pay != nil {
		t.Fatal("payments built without Stripe configured")
	}
}
