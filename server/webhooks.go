package server

import (
	"github.com/llmescrow/escrow/webhook"
)

// Webhooks returns the server's webhook sender (its Stats, for metrics and tests).
func (s *Server) Webhooks() *webhook.Sender { return s.webhooks }

// webhookMetrics are the sender's totals.
func (m *metrics) webhookMetrics(a *Server) {
	counter, _ := statFuncs(m.reg, a.webhooks.Stats)
	counter("escrow_webhook_attempts_total", "Webhook delivery attempts sent (or tried).", func(s webhook.Stats) int64 { return s.Attempts })
	counter("escrow_webhook_delivered_total", "Webhook deliveries answered with a 2xx.", func(s webhook.Stats) int64 { return s.Delivered })
	counter("escrow_webhook_retries_total", "Failed webhook attempts with another one to come.", func(s webhook.Stats) int64 { return s.Retries })
	counter("escrow_webhook_failed_total", "Webhook deliveries given up after the last attempt.", func(s webhook.Stats) int64 { return s.Failed })
	counter("escrow_webhook_claim_errors_total", "Failed reads of the webhook outbox (the ledger unreachable).", func(s webhook.Stats) int64 { return s.ClaimErrors })
}
