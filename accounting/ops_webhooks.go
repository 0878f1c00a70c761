package accounting

import (
	"context"
	"github.com/llmescrow/escrow/ledger"
)

// Webhooks returns the ledger's webhook side (ErrNoWebhooks for a ledger without one; both of
// escrow's ledgers have it).
func (o *Ops) Webhooks() (ledger.Webhooks, error) {
	h, ok := o.ledger.(ledger.Webhooks)
	if !ok {
		return nil, ledger.ErrNoWebhooks
	}
	return h, nil
}

// CreateWebhook adds an endpoint for the given event types; its signing secret is returned
// once.
func (o *Ops) CreateWebhook(ctx context.Context, rawURL string, events []ledger.EventType) (ledger.Webhook, string, error) {
	h, err := o.Webhooks()
	if err != nil {
		return ledger.Webhook{}, "", err
	}
	return h.CreateWebhook(ctx, rawURL, events)
}

// ListWebhooks lists the endpoints (without their secrets).
func (o *Ops) ListWebhooks(ctx context.Context) ([]ledger.Webhook, error) {
	h, err := o.Webhooks()
	if err != nil {
		return nil, err
	}
	return h.ListWebhooks(ctx)
}

// DeleteWebhook deletes an endpoint and its deliveries (ErrUnknownWebhook).
func (o *Ops) DeleteWebhook(ctx context.Context, id string) error {
	h, err := o.Webhooks()
	if err != nil {
		return err
	}
	return h.DeleteWebhook(ctx, id)
}

// ListDeliveries lists an endpoint's deliveries, newest first (ErrUnknownWebhook).
func (o *Ops) ListDeliveries(ctx context.Context, id string, q ledger.ListQuery) (ledger.Page[ledger.Delivery], error) {
	h, err := o.Webhooks()
	if err != nil {
		return ledger.Page[ledger.Delivery]{}, err
	}
	return h.ListDeliveries(ctx, id, q)
}

// SetLowBalanceThreshold sets (nil: clears) the org's low-balance threshold.
func (o *Ops) SetLowBalanceThreshold(ctx context.Context, org string, threshold *int64) error {
	h, err := o.Webhooks()
	if err != nil {
		return err
	}
	return h.SetLowBalanceThreshold(ctx, org, threshold)
}

// lowBalanceThreshold is the org's threshold, nil for none or without webhooks.
func (o *Ops) lowBalanceThreshold(ctx context.Context, org string) (*int64, error) {
	h, ok := o.ledger.(ledger.Webhooks)
	if !ok {
		return nil, nil
	}
	return h.LowBalanceThreshold(ctx, org)
}
