package server

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stripe/stripe-go/v82"

	"github.com/llmescrow/escrow/payment"
)

// payments is the money coming in (docs/payments.md): Stripe's webhook, when
// ESCROW_STRIPE_WEBHOOK_SECRETS is set, and auto top-up, when ESCROW_STRIPE_API_KEY is.
type payments struct {
	pay    *payment.Payments
	stripe *payment.Stripe // nil: no webhook route
	topups *payment.TopUps // nil: no auto top-up
}

// parseRates reads ESCROW_PAYMENT_RATES: "usd=10000,eur=10800".
func parseRates(v string) (map[string]int64, error) {
	rates := map[string]int64{}
	for _, part := range strings.Split(v, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		cur, n, ok := strings.Cut(part, "=")
		r, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		cur = strings.ToLower(strings.TrimSpace(cur))
		if !ok || err != nil || r <= 0 || len(cur) != 3 {
			return nil, fmt.Errorf("%w: ESCROW_PAYMENT_RATES: %q is not currency=micro-units per smallest unit (usd=10000)", ErrConfig, part)
		}
		rates[cur] = r
	}
	return rates, nil
}

// openPayments builds the payment parts the configuration asks for (after openEscrow).
func (s *Server) openPayments() error {
	c := s.cfg
	if c.StripeWebhookSecrets == "" && c.StripeAPIKey == "" {
		return nil
	}
	rates, err := parseRates(c.PaymentRates)
	if err != nil {
		return err
	}
	if len(rates) == 0 {
		return fmt.Errorf("%w: Stripe is configured but ESCROW_PAYMENT_RATES is empty: no payment could be credited", ErrConfig)
	}
	p := &payments{}
	if p.pay, err = payment.New(s.ops, &payment.Config{Rates: rates, FreezeOnDispute: c.StripeFreezeOnDispute, Logger: s.log}); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if c.StripeWebhookSecrets != "" {
		if p.stripe, err = payment.NewStripe(payment.StripeConfig{Secrets: strings.Split(c.StripeWebhookSecrets, ","), Tolerance: c.StripeTolerance}); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	if c.StripeAPIKey != "" {
		var opts []stripe.ClientOption
		if c.StripeAPIURL != "" {
			opts = append(opts, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{URL: stripe.String(c.StripeAPIURL)})))
		}
		if p.topups, err = payment.NewTopUps(s.ops, &payment.TopUpConfig{Stripe: stripe.NewClient(c.StripeAPIKey, opts...), Logger: s.log}); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	s.pay = p
	return nil
}

// charged is the worker's WorkerConfig.Charged: the orgs a pass charged go to auto top-up.
func (s *Server) charged(orgs []string) {
	if s.pay != nil && s.pay.topups != nil {
		s.pay.topups.Charged(orgs)
	}
}

// mountPayments adds POST /webhooks/stripe (authenticated by its signature, not by a token)
// and the payments' metrics.
func (s *Server) mountPayments(e *echo.Echo) {
	if s.pay == nil {
		return
	}
	if s.pay.stripe != nil {
		e.POST("/webhooks/stripe", s.pay.pay.Handler(s.pay.stripe))
	}
	reg := s.metrics.reg
	for _, o := range payment.Outcomes {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "escrow_payment_events_total",
			Help: "payment webhook deliveries by decision (credited, duplicate, rejected, …)", ConstLabels: prometheus.Labels{"outcome": string(o)}},
			func() float64 { return float64(s.pay.pay.Decisions(o)) }))
	}
	if tu := s.pay.topups; tu != nil {
		counter, _ := statFuncs(reg, tu.Stats)
		counter("escrow_topups_started_total", "auto top-up PaymentIntents created", func(st payment.TopUpStats) int64 { return st.Started })
		counter("escrow_topups_failed_total", "auto top-ups declined (their orgs stopped until updated)", func(st payment.TopUpStats) int64 { return st.Failed })
		counter("escrow_topups_capped_total", "auto top-up checks refused by a daily or monthly cap", func(st payment.TopUpStats) int64 { return st.Capped })
		counter("escrow_topups_errors_total", "auto top-up checks that failed (Stripe or the ledger did not answer)", func(st payment.TopUpStats) int64 { return st.Errors })
	}
}

func (s *Server) startPayments(ctx context.Context) error {
	if s.pay != nil && s.pay.topups != nil {
		return s.pay.topups.Start(ctx)
	}
	return nil
}

func (s *Server) stopPayments(ctx context.Context) error {
	if s.pay != nil && s.pay.topups != nil {
		return s.pay.topups.Stop(ctx)
	}
	return nil
}
