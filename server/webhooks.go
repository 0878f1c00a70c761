package server

import (
	"fmt"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/webhook"
)

// openWebhooks makes the sender of the ledger's webhook outbox (both ledgers have one). Every
// proxy process runs one: claims are exclusive for their lease, so several never send the same
// attempt.
func (s *Server) openWebhooks() error {
	h, ok := s.ledger.(accounting.Webhooks)
	if !ok {
		return fmt.Errorf("webhooks: %w", accounting.ErrNoWebhooks)
	}
	var err error
	s.webhooks, err = webhook.NewSender(h, &webhook.Config{
		Timeout:     s.cfg.WebhookTimeout,
		MaxAttempts: s.cfg.WebhookMaxAttempts,
		Logger:      s.log,
	})
	if err != nil {
		return fmt.Errorf("webhooks: %w", err)
	}
	return nil
}

// Webhooks returns the server's webhook sender (its Stats, for metrics and tests).
func (s *Server) Webhooks() *webhook.Sender { return s.webhooks }
