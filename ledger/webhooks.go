package ledger

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Webhooks: the ledger side of durable webhooks. An event (a low balance, a credit, a revoked
// key, a limit crossing) is written to an outbox in the same transaction as the ledger change that triggers it,
// with one delivery per endpoint subscribed to its type; a delivery worker (package webhook)
// claims due deliveries, sends them and records the outcome. Both ledgers implement Webhooks
// and pass the same conformance suite (ledger/ledgertest). Nothing here speaks HTTP.

// EventType names a webhook event.
type EventType string

// The webhook events.
const (
	// EventBalanceLow: a change to the org's ledger balance took it from at least its
	// low-balance threshold to below it (once per crossing: a batch of charges that crosses
	// fires once; a credit back above the threshold re-arms it). Data: balance, threshold.
	EventBalanceLow EventType = "balance.low"
	// EventCreditReceived: a credit entry was written (once per payment reference). Data:
	// amount, reference, seq, balance.
	EventCreditReceived EventType = "credit.received"
	// EventKeyRevoked: an API key was revoked (once per key). Data: key_id.
	EventKeyRevoked EventType = "key.revoked"
	// EventLimitCrossed: the accounting of charges took the ledger's spend in a limit's window
	// from below 80 % (100 %) of its cap to at or above it (once per crossing and window: a
	// batch that jumps past both fires both; a cap change never fires by itself; a deleted
	// limit never fires; see limit_crossed.go). Data: limit_id, scope, scope_id, window,
	// window_start (null for lifetime), cap, used, threshold (80 or 100).
	EventLimitCrossed EventType = "limit.crossed"
	// EventTopUpFailed: an auto top-up attempt failed (a declined charge), which stops the
	// org's top-ups until its settings are updated (once per attempt; see topup.go). Data:
	// attempt, amount, currency, payment, reason.
	EventTopUpFailed EventType = "topup.failed"
	// EventJobUnresolved: the upstream lost a job's result (not found after it ended, or never
	// ended in time), so it was charged by the estimate rule and flagged (once per job; see
	// package ledger/job). Data: job, kind, upstream_id, model, hold, cost, reason.
	EventJobUnresolved EventType = "job.unresolved"
)

// EventTypes lists every event type an endpoint may subscribe to.
var EventTypes = []EventType{EventBalanceLow, EventCreditReceived, EventKeyRevoked, EventLimitCrossed, EventTopUpFailed, EventJobUnresolved}

// Sentinel errors of webhooks.
var (
	ErrUnknownWebhook  = errors.New("ledger: unknown webhook")
	ErrInvalidWebhook  = errors.New("ledger: invalid webhook")
	ErrNoWebhooks      = errors.New("ledger: the ledger has no webhooks")
	ErrDeliveryChanged = errors.New("ledger: delivery claimed again or gone") // a lost lease: the outcome is not recorded
)

// DeliveryStatus is where a delivery stands.
type DeliveryStatus string

// Delivery statuses.
const (
	DeliveryPending   DeliveryStatus = "pending"   // to be attempted (again) at NextAttemptAt
	DeliveryDelivered DeliveryStatus = "delivered" // an attempt got a 2xx
	DeliveryFailed    DeliveryStatus = "failed"    // gave up after the last attempt
)

// Webhook is an endpoint that receives events. Its secret is shown once, at creation.
type Webhook struct {
	ID        string      `json:"id"`
	URL       string      `json:"url"`
	Events    []EventType `json:"events"`
	CreatedAt time.Time   `json:"created_at"`
}

// Delivery is one event's delivery to one webhook. A claim (ClaimDeliveries) also carries
// what the attempt needs: the URL, the secret and the body.
type Delivery struct {
	ID            int64          `json:"id"`
	WebhookID     string         `json:"webhook_id"`
	EventID       string         `json:"event_id"`
	EventType     EventType      `json:"event_type"`
	Org           string         `json:"org"`
	Status        DeliveryStatus `json:"status"`
	Attempts      int            `json:"attempts"`
	LastError     string         `json:"last_error"`
	LastStatus    int            `json:"last_status"`     // HTTP status of the last answer; 0 for none
	NextAttemptAt *time.Time     `json:"next_attempt_at"` // nil unless pending (while an attempt runs: its lease's end)
	DeliveredAt   *time.Time     `json:"delivered_at"`    // nil unless delivered
	CreatedAt     time.Time      `json:"created_at"`

	URL    string `json:"-"` // claims only
	Secret string `json:"-"` // claims only: never shown, never logged
	Body   []byte `json:"-"` // claims only: the event's JSON, the same bytes on every attempt
}

// EndpointLimit bounds how many deliveries of one endpoint a claim takes: Max, less what Busy
// counts for the endpoint (by webhook id: the caller's attempts to it still running), so one
// slow endpoint cannot take every slot of a sender. The zero value bounds nothing.
type EndpointLimit struct {
	Max  int
	Busy map[string]int
}

// Room is how many deliveries of endpoint id a claim may take; -1 for no bound.
func (l EndpointLimit) Room(id string) int {
	if l.Max <= 0 {
		return -1
	}
	return max(0, l.Max-l.Busy[id])
}

// Outcome is what an attempt came to.
type Outcome struct {
	Status     DeliveryStatus // DeliveryDelivered, DeliveryPending (retry after RetryAfter) or DeliveryFailed
	RetryAfter time.Duration  // with DeliveryPending: the wait before the next attempt
	HTTPStatus int            // the answer's status; 0 for none
	Error      string         // why the attempt failed ("" when delivered)
}

// Webhooks is the role interface of a ledger with webhooks (both ledgers implement it).
type Webhooks interface {
	// CreateWebhook adds an endpoint for the given event types and returns it with its signing
	// secret (ErrInvalidWebhook for a URL that is not absolute http(s) or an unknown type).
	CreateWebhook(ctx context.Context, rawURL string, events []EventType) (Webhook, string, error)
	// ListWebhooks lists the endpoints by creation.
	ListWebhooks(ctx context.Context) ([]Webhook, error)
	// DeleteWebhook deletes an endpoint and its deliveries (ErrUnknownWebhook).
	DeleteWebhook(ctx context.Context, id string) error
	// ListDeliveries lists an endpoint's deliveries, newest first (ErrUnknownWebhook).
	ListDeliveries(ctx context.Context, webhookID string, q ListQuery) (Page[Delivery], error)

	// SetLowBalanceThreshold sets (nil: clears) the org's low-balance threshold
	// (ErrUnknownOrg). Setting it never fires: only a later change that crosses it does.
	SetLowBalanceThreshold(ctx context.Context, org string, threshold *int64) error
	// LowBalanceThreshold returns the org's threshold, nil for none (ErrUnknownOrg).
	LowBalanceThreshold(ctx context.Context, org string) (*int64, error)

	// ClaimDeliveries claims up to limit due pending deliveries, oldest due first, and of one
	// endpoint no more than per allows: each one's attempt count goes up by one and it is not
	// due again before lease has passed, so two workers (in any process) never hold the same
	// attempt. The claims carry the URL, the secret and the body.
	ClaimDeliveries(ctx context.Context, limit int, lease time.Duration, per EndpointLimit) ([]Delivery, error)
	// FinishDelivery records the outcome of attempt number attempt of delivery id; when the
	// delivery was claimed again since (its lease ran out) or deleted, nothing is written and
	// the error is ErrDeliveryChanged.
	FinishDelivery(ctx context.Context, id int64, attempt int, o Outcome) error
}

// CheckWebhook validates a new endpoint and returns its event types sorted, without duplicates.
func CheckWebhook(rawURL string, events []EventType) ([]EventType, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || len(rawURL) > 2048 {
		return nil, fmt.Errorf("%w: url must be an absolute http or https URL", ErrInvalidWebhook)
	}
	if len(events) == 0 {
		return nil, fmt.Errorf("%w: events must name at least one of %v", ErrInvalidWebhook, EventTypes)
	}
	out := make([]EventType, 0, len(events))
	for _, e := range events {
		if !slices.Contains(EventTypes, e) {
			return nil, fmt.Errorf("%w: unknown event %q (known: %v)", ErrInvalidWebhook, e, EventTypes)
		}
		if !slices.Contains(out, e) {
			out = append(out, e)
		}
	}
	slices.Sort(out)
	return out, nil
}

// DeliveryPage reads ListDeliveries' query: the deliveries to list are those with an id below
// before (all of them without a cursor), at most limit of them.
func DeliveryPage(q ListQuery) (before int64, limit int, err error) {
	before = int64(1<<63 - 1)
	if q.Cursor != "" {
		if before, err = ParseSeqCursor(q.Cursor, "delivery"); err != nil {
			return 0, 0, err
		}
	}
	return before, PageLimit(q.Limit), nil
}

// CheckThreshold checks SetLowBalanceThreshold's arguments: a valid org id, and a threshold
// (when set) within ±balance.MaxAmount.
func CheckThreshold(org string, t *int64) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	if t != nil && (*t > balance.MaxAmount || *t < -balance.MaxAmount) {
		return fmt.Errorf("%w: low balance threshold %d outside ±%d", ErrInvalidAmount, *t, balance.MaxAmount)
	}
	return nil
}

func CheckOutcome(o Outcome) error {
	switch o.Status {
	case DeliveryDelivered, DeliveryFailed:
		return nil
	case DeliveryPending:
		if o.RetryAfter >= 0 {
			return nil
		}
	}
	return fmt.Errorf("%w: outcome %q (retry after %v)", ErrInvalidWebhook, o.Status, o.RetryAfter)
}

// maxErrorLen bounds a delivery's recorded error.
const maxErrorLen = 500

func TruncateError(s string) string {
	if len(s) <= maxErrorLen {
		return s
	}
	return strings.ToValidUTF8(s[:maxErrorLen], "")
}

// SecretPrefix starts every webhook signing secret.
const SecretPrefix = "whsec_"

func NewWebhookID() string { return "wh_" + RandomHex(12) }

// NewWebhookSecret is SecretPrefix and 32 random bytes in hex (no character a receiver's
// configuration could mangle).
func NewWebhookSecret() string { return SecretPrefix + RandomHex(32) }

func DeliveryCursor(d Delivery) string { return makeCursor("delivery", strconv.FormatInt(d.ID, 10)) }
