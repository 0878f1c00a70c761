package payment_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/payment"
)

const (
	secret    = "whsec_test_current"
	oldSecret = "whsec_test_previous"
	usdRate   = 10_000 // micro-units per cent
)

// rig is one ledger (memory or Postgres), a hot balance, a worker, and the Stripe webhook
// mounted on an Echo at /webhooks/stripe.
type rig struct {
	l      ledger.Ledger
	store  *balance.Store
	worker *accounting.Worker
	ops    *accounting.Ops
	pay    *payment.Payments
	e      *echo.Echo
}

// eachLedger runs fn on the memory ledger and on Postgres.
func eachLedger(t *testing.T, fn func(t *testing.T, l ledger.Ledger)) {
	t.Run("Memory", func(t *testing.T) {
		t.Parallel()
		l := memledger.New()
		t.Cleanup(l.Close)
		fn(t, l)
	})
	t.Run("Postgres", func(t *testing.T) {
		t.Parallel()
		l, _ := testutil.PostgresLedger(t)
		fn(t, l)
	})
}

func newRig(t *testing.T, l ledger.Ledger, cfg *payment.Config, wc *accounting.WorkerConfig) *rig {
	t.Helper()
	env := testutil.Redis(t)
	store, err := balance.New(context.Background(), env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	if wc == nil {
		wc = &accounting.WorkerConfig{}
	}
	wc.Logger = quiet
	w, err := accounting.NewWorker(l, store, wc)
	if err != nil {
		t.Fatal(err)
	}
	ops := accounting.NewOps(w)
	if cfg == nil {
		cfg = &payment.Config{}
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	if cfg.Rates == nil {
		cfg.Rates = map[string]int64{"usd": usdRate}
	}
	pay, err := payment.New(ops, cfg)
	if err != nil {
		t.Fatal(err)
	}
	proc, err := payment.NewStripe(payment.StripeConfig{Secrets: []string{secret, oldSecret}})
	if err != nil {
		t.Fatal(err)
	}
	e := echo.New()
	e.POST("/webhooks/stripe", pay.Handler(proc))
	return &rig{l: l, store: store, worker: w, ops: ops, pay: pay, e: e}
}

func ctxT(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

// deliver POSTs payload signed (stripe-go's GenerateTestSignedPayload) with key at ts.
func (r *rig) deliver(t *testing.T, key string, ts time.Time, payload []byte) (int, payment.Decision) {
	t.Helper()
	sp := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: payload, Secret: key, Timestamp: ts})
	return r.post(t, sp.Header, payload)
}

func (r *rig) post(t *testing.T, header string, payload []byte) (int, payment.Decision) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/webhooks/stripe", bytes.NewReader(payload))
	if header != "" {
		req.Header.Set("Stripe-Signature", header)
	}
	req.Header.Set("Content-Type", "application/json")
	rec := httptest.NewRecorder()
	r.e.ServeHTTP(rec, req)
	var d payment.Decision
	if err := json.Unmarshal(rec.Body.Bytes(), &d); err != nil {
		t.Fatalf("answer %d %q: %v", rec.Code, rec.Body.String(), err)
	}
	return rec.Code, d
}

// send delivers payload signed now with the current secret.
func (r *rig) send(t *testing.T, payload []byte) (int, payment.Decision) {
	t.Helper()
	return r.deliver(t, secret, time.Now(), payload)
}

func (r *rig) balances(t *testing.T, org string) (ledgerBal, hot int64) {
	t.Helper()
	a, err := r.l.Account(ctxT(t), org)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.worker.SettleOrg(ctxT(t), org); err != nil {
		t.Fatal(err)
	}
	st, err := r.store.State(ctxT(t), org)
	if err != nil {
		t.Fatal(err)
	}
	return a.Balance, st.Balance
}

// spend charges cost to org through a usage event and the worker's account pass.
func (r *rig) spend(t *testing.T, org string, cost int64) {
	t.Helper()
	r.spendWith(t, r.worker, org, cost)
}

// spendWith is spend through worker w's account pass.
func (r *rig) spendWith(t *testing.T, w *accounting.Worker, org string, cost int64) {
	t.Helper()
	ev := ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: org, KeyID: "key_1", Model: "gpt-test",
		Endpoint: "/v1/chat/completions", Cost: cost, HoldAmount: cost, CreatedAt: time.Now()}
	if err := r.l.RecordUsage(ctxT(t), []ledger.UsageEvent{ev}); err != nil {
		t.Error(err)
		return
	}
	if _, err := w.AccountAll(ctxT(t)); err != nil {
		t.Error(err)
	}
}

func (r *rig) createOrg(t *testing.T, org string) {
	t.Helper()
	if err := r.l.CreateOrg(ctxT(t), org); err != nil {
		t.Fatal(err)
	}
}

// auditOf is the audit trail's records by the actor, oldest first.
func (r *rig) auditOf(t *testing.T, actor string) []ledger.AuditRecord {
	t.Helper()
	p, err := r.l.AuditLog(ctxT(t), ledger.ListQuery{Limit: 500})
	if err != nil {
		t.Fatal(err)
	}
	var out []ledger.AuditRecord
	for i := len(p.Data) - 1; i >= 0; i-- {
		if p.Data[i].Actor == actor {
			out = append(out, p.Data[i])
		}
	}
	return out
}

// Stripe event payloads (the fields escrow reads, in Stripe's shapes).

func eventJSON(id, typ string, object map[string]any, previous map[string]any) []byte {
	data := map[string]any{"object": object}
	if previous != nil {
		data["previous_attributes"] = previous
	}
	b, _ := json.Marshal(map[string]any{
		"id": id, "object": "event", "type": typ, "api_version": "2025-03-31.basil", "created": time.Now().Unix(),
		"livemode": false, "data": data,
	})
	return b
}

func intentSucceeded(evID, pi, org string, cents int64, meta map[string]string) []byte {
	md := map[string]string{}
	if org != "" {
		md[payment.MetadataOrg] = org
	}
	for k, v := range meta {
		md[k] = v
	}
	return eventJSON(evID, "payment_intent.succeeded", map[string]any{
		"id": pi, "object": "payment_intent", "amount": cents, "amount_received": cents, "currency": "usd",
		"customer": "cus_" + org, "status": "succeeded", "metadata": md,
	}, nil)
}

func sessionCompleted(evID, cs, pi, org string, cents int64) []byte {
	return eventJSON(evID, "checkout.session.completed", map[string]any{
		"id": cs, "object": "checkout.session", "amount_total": cents, "currency": "usd", "payment_intent": pi,
		"payment_status": "paid", "mode": "payment", "client_reference_id": org, "metadata": map[string]string{},
	}, nil)
}

func chargeRefunded(evID, ch, pi, org string, refundedTotal, before int64) []byte {
	md := map[string]string{}
	if org != "" {
		md[payment.MetadataOrg] = org
	}
	return eventJSON(evID, "charge.refunded", map[string]any{
		"id": ch, "object": "charge", "amount": 100_000, "amount_refunded": refundedTotal, "currency": "usd",
		"payment_intent": pi, "refunded": true, "metadata": md,
	}, map[string]any{"amount_refunded": before, "refunded": false})
}

func evID() string { return "evt_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:24] }

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantDecision(t *testing.T, what string, status int, d payment.Decision, wantStatus int, want payment.Outcome) {
	t.Helper()
	if status != wantStatus || d.Outcome != want {
		t.Fatalf("%s: %d %+v, want %d %s", what, status, d, wantStatus, want)
	}
}

var quiet = slog.New(slog.DiscardHandler)
