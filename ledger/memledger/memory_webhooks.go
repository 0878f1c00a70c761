package memledger

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

var _ ledger.Webhooks = (*Ledger)(nil)

// memHooks is the memory ledger's webhook state; Memory.mu guards it. Events are written under
// the same lock hold as the change that triggers them, which is the memory ledger's transaction.
type memHooks struct {
	endpoints  []*memEndpoint // by creation
	secrets    map[string]string
	thresholds map[string]int64 // org → low-balance threshold
	deliveries []*memDelivery   // by id (1, 2, 3 …)
	bodies     map[string][]byte
}

type memEndpoint struct {
	ledger.Webhook
	deleted bool
}

type memDelivery struct {
	d    ledger.Delivery
	next time.Time
}

func (h *memHooks) init() {
	if h.secrets == nil {
		h.secrets, h.thresholds, h.bodies = map[string]string{}, map[string]int64{}, map[string][]byte{}
	}
}

func (h *memHooks) threshold(org string) *int64 {
	if t, ok := h.thresholds[org]; ok {
		return &t
	}
	return nil
}

// emit writes an event and its deliveries when an endpoint subscribes to typ. Call with m.mu held.
func (h *memHooks) emit(typ ledger.EventType, org string, data any) {
	var subs []*memEndpoint
	for _, e := range h.endpoints {
		if !e.deleted && slices.Contains(e.Events, typ) {
			subs = append(subs, e)
		}
	}
	if len(subs) == 0 {
		return
	}
	h.init()
	now := time.Now().UTC().Truncate(time.Microsecond)
	id := uuid.Must(uuid.NewV7()).String()
	body, err := json.Marshal(eventBody{ID: id, Type: typ, Org: org, CreatedAt: timeText(now), Data: data})
	if err != nil {
		panic(fmt.Sprintf("memledger: webhook body: %v", err)) // data is always one of the types below
	}
	h.bodies[id] = body
	for _, e := range subs {
		h.deliveries = append(h.deliveries, &memDelivery{next: now, d: ledger.Delivery{
			ID: int64(len(h.deliveries)) + 1, WebhookID: e.ID, EventID: id, EventType: typ, Org: org,
			Status: ledger.DeliveryPending, CreatedAt: now,
		}})
	}
}

// The events' data (the same fields as the Postgres bodies).
type (
	lowBalanceData struct {
		Balance   int64 `json:"balance"`
		Threshold int64 `json:"threshold"`
	}
	creditData struct {
		Amount    int64  `json:"amount"`
		Reference string `json:"reference"`
		Seq       int64  `json:"seq"`
		Balance   int64  `json:"balance"`
	}
	keyRevokedData struct {
		KeyID string `json:"key_id"`
	}
)

// balanceChanged emits balance.low when the org's balance went from before to after across its
// threshold. Call with m.mu held.
func (h *memHooks) balanceChanged(org string, before, after int64) {
	if t := h.threshold(org); crossedBelow(before, after, t) {
		h.emit(ledger.EventBalanceLow, org, lowBalanceData{Balance: after, Threshold: *t})
	}
}

// CreateWebhook adds an endpoint and returns its secret.
func (m *Ledger) CreateWebhook(ctx context.Context, rawURL string, events []ledger.EventType) (ledger.Webhook, string, error) {
	evs, err := ledger.CheckWebhook(rawURL, events)
	if err != nil {
		return ledger.Webhook{}, "", err
	}
	w := ledger.Webhook{ID: ledger.NewWebhookID(), URL: rawURL, Events: evs, CreatedAt: time.Now().UTC().Truncate(time.Microsecond)}
	secret := ledger.NewWebhookSecret()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.hooks.init()
	m.hooks.endpoints = append(m.hooks.endpoints, &memEndpoint{Webhook: w})
	m.hooks.secrets[w.ID] = secret
	return w, secret, nil
}

// ListWebhooks lists the endpoints by creation.
func (m *Ledger) ListWebhooks(ctx context.Context) ([]ledger.Webhook, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []ledger.Webhook
	for _, e := range m.hooks.endpoints {
		if !e.deleted {
			w := e.Webhook
			w.Events = slices.Clone(w.Events)
			out = append(out, w)
		}
	}
	return out, nil
}

func (m *Ledger) endpointLocked(id string) *memEndpoint {
	for _, e := range m.hooks.endpoints {
		if e.ID == id && !e.deleted {
			return e
		}
	}
	return nil
}

// DeleteWebhook deletes an endpoint and its deliveries.
func (m *Ledger) DeleteWebhook(ctx context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.endpointLocked(id)
	if e == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownWebhook, id)
	}
	e.deleted = true
	delete(m.hooks.secrets, id)
	for _, d := range m.hooks.deliveries {
		if d.d.WebhookID == id {
			d.d.Status = "" // gone: never claimed, never listed
		}
	}
	return nil
}

func (d *memDelivery) view() ledger.Delivery {
	out := d.d
	if out.Status == ledger.DeliveryPending {
		next := d.next
		out.NextAttemptAt = &next
	}
	return out
}

// ListDeliveries lists an endpoint's deliveries, newest first.
func (m *Ledger) ListDeliveries(ctx context.Context, webhookID string, q ledger.ListQuery) (ledger.Page[ledger.Delivery], error) {
	before, limit, err := ledger.DeliveryPage(q)
	if err != nil {
		return ledger.Page[ledger.Delivery]{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.endpointLocked(webhookID) == nil {
		return ledger.Page[ledger.Delivery]{}, fmt.Errorf("%w: %q", ledger.ErrUnknownWebhook, webhookID)
	}
	var out []ledger.Delivery
	for i := len(m.hooks.deliveries) - 1; i >= 0 && len(out) <= limit; i-- {
		d := m.hooks.deliveries[i]
		if d.d.WebhookID == webhookID && d.d.ID < before && d.d.Status != "" {
			out = append(out, d.view())
		}
	}
	return ledger.PageOf(out, limit, ledger.DeliveryCursor), nil
}

// SetLowBalanceThreshold sets or clears the org's threshold.
func (m *Ledger) SetLowBalanceThreshold(ctx context.Context, org string, threshold *int64) error {
	if err := ledger.CheckThreshold(org, threshold); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	m.hooks.init()
	if threshold == nil {
		delete(m.hooks.thresholds, org)
	} else {
		m.hooks.thresholds[org] = *threshold
	}
	return nil
}

// LowBalanceThreshold returns the org's threshold (nil for none).
func (m *Ledger) LowBalanceThreshold(ctx context.Context, org string) (*int64, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] == nil {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return m.hooks.threshold(org), nil
}

// ClaimDeliveries claims due deliveries, oldest due first, within per's bound for each
// endpoint; a claim is not due again before its lease ends.
func (m *Ledger) ClaimDeliveries(ctx context.Context, limit int, lease time.Duration, per ledger.EndpointLimit) ([]ledger.Delivery, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	var due []*memDelivery
	for _, d := range m.hooks.deliveries {
		if d.d.Status == ledger.DeliveryPending && !d.next.After(now) {
			due = append(due, d)
		}
	}
	slices.SortStableFunc(due, func(a, b *memDelivery) int { return cmp.Or(a.next.Compare(b.next), cmp.Compare(a.d.ID, b.d.ID)) })
	var out []ledger.Delivery
	taken := map[string]int{}
	for _, d := range due {
		if len(out) == limit {
			break
		}
		if room := per.Room(d.d.WebhookID); room >= 0 && taken[d.d.WebhookID] >= room {
			continue
		}
		taken[d.d.WebhookID]++
		d.d.Attempts++
		d.next = now.Add(lease).UTC().Truncate(time.Microsecond)
		c := d.view()
		c.URL = m.endpointLocked(d.d.WebhookID).URL
		c.Secret = m.hooks.secrets[d.d.WebhookID]
		c.Body = slices.Clone(m.hooks.bodies[d.d.EventID])
		out = append(out, c)
	}
	return out, nil
}

// FinishDelivery records an attempt's outcome unless the delivery was claimed again since.
func (m *Ledger) FinishDelivery(ctx context.Context, id int64, attempt int, o ledger.Outcome) error {
	if err := ledger.CheckOutcome(o); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if id <= 0 || id > int64(len(m.hooks.deliveries)) {
		return fmt.Errorf("%w: delivery %d attempt %d", ledger.ErrDeliveryChanged, id, attempt)
	}
	d := m.hooks.deliveries[id-1]
	if d.d.Status != ledger.DeliveryPending || d.d.Attempts != attempt {
		return fmt.Errorf("%w: delivery %d attempt %d", ledger.ErrDeliveryChanged, id, attempt)
	}
	now := time.Now().UTC().Truncate(time.Microsecond)
	d.d.Status, d.d.LastError, d.d.LastStatus, d.d.DeliveredAt = o.Status, ledger.TruncateError(o.Error), o.HTTPStatus, nil
	switch o.Status {
	case ledger.DeliveryPending:
		d.next = now.Add(o.RetryAfter)
	case ledger.DeliveryDelivered:
		d.d.DeliveredAt = &now
	}
	return nil
}

// crossedBelow reports whether a balance change from before to after crosses threshold
// downwards.
func crossedBelow(before, after int64, threshold *int64) bool {
	return threshold != nil && before >= *threshold && after < *threshold
}

// timeText formats t like the Postgres bodies (UTC, microseconds).
func timeText(t time.Time) string {
	return t.UTC().Truncate(time.Microsecond).Format("2006-01-02T15:04:05.000000Z")
}

// eventBody is the JSON every endpoint receives for one event (Postgres builds the same object
// with jsonb_build_object).
type eventBody struct {
	ID        string           `json:"id"`
	Type      ledger.EventType `json:"type"`
	Org       string           `json:"org"`
	CreatedAt string           `json:"created_at"`
	Data      any              `json:"data"`
}
