package pgledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

var _ ledger.Webhooks = (*Ledger)(nil)

// sqlOutbox returns the CTEs that write, for each row (org, data jsonb) of the query src, one
// event of type typ to the outbox and one delivery per endpoint subscribed to typ; with no such
// endpoint they write nothing. They run in the statement (and so the transaction) of the change
// that triggers the event. typ is one of the EventType constants (never user input).
func sqlOutbox(typ ledger.EventType, src string) string {
	t := `'` + string(typ) + `'`
	return `ob_src AS (` + src + `),
ob_ev AS (
	INSERT INTO webhook_events (id, type, org_id, body)
	SELECT s.id, ` + t + `, s.org, jsonb_build_object('id', s.id, 'type', ` + t + `, 'org', s.org,
		'created_at', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), 'data', s.data)::text
	FROM (SELECT gen_random_uuid() AS id, org, data FROM ob_src) s
	WHERE EXISTS (SELECT 1 FROM webhook_endpoints WHERE ` + t + ` = ANY (events))
	RETURNING id
),
ob_dl AS (
	INSERT INTO webhook_deliveries (endpoint_id, event_id)
	SELECT w.id, ob_ev.id FROM ob_ev CROSS JOIN webhook_endpoints w WHERE ` + t + ` = ANY (w.events)
)`
}

// Outbox statements, each run in the transaction that changes the ledger, after the change.
var (
	// $1 orgs, $2 the signed change of each one's balance in this transaction: a balance.low
	// event for each org whose balance went from >= its threshold to < it.
	sqlOutboxLowBalance = `WITH ` + sqlOutbox(ledger.EventBalanceLow, `
	SELECT a.org_id AS org, jsonb_build_object('balance', a.balance, 'threshold', a.low_balance_threshold) AS data
	FROM accounts a JOIN unnest($1::text[], $2::bigint[]) AS c(org, change) ON a.org_id = c.org
	WHERE a.org_id = ANY ($1::text[]) AND a.low_balance_threshold IS NOT NULL AND a.balance < a.low_balance_threshold
	  AND a.balance - c.change >= a.low_balance_threshold`) + ` SELECT 1`
	// $1 org, $2 amount, $3 ref: the credit just written (the account's last entry).
	sqlOutboxCredit = `WITH ` + sqlOutbox(ledger.EventCreditReceived, `
	SELECT org_id AS org, jsonb_build_object('amount', $2::bigint, 'reference', $3::text, 'seq', ledger_seq, 'balance', balance) AS data
	FROM accounts WHERE org_id = $1`) + ` SELECT 1`
)

// sqlRevokeKey revokes key $1 (revoking twice is fine) and, when this statement revoked it, writes
// a key.revoked event; it answers whether the key exists.
var sqlRevokeKey = `WITH rev AS (
	UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL RETURNING id, org_id
), ` + sqlOutbox(ledger.EventKeyRevoked, `SELECT org_id AS org, jsonb_build_object('key_id', id) AS data FROM rev`) + `
SELECT EXISTS (SELECT 1 FROM api_keys WHERE id = $1)`

// queueEntryOutbox adds the outbox statements of a credit or adjust entry just queued on b:
// credit.received for a credit, balance.low for a change that lowers the balance.
func queueEntryOutbox(b *pgx.Batch, org string, kind ledger.EntryKind, delta int64, ref string) {
	if kind == ledger.KindCredit {
		b.Queue(sqlOutboxCredit, org, delta, ref)
	}
	if delta < 0 {
		queueLowBalance(b, []string{org}, []int64{delta})
	}
}

// queueLowBalance adds the balance.low outbox statement for the orgs whose balances changed by
// changes (signed) to b, which runs in the changing transaction.
func queueLowBalance(b *pgx.Batch, orgs []string, changes []int64) {
	b.Queue(sqlOutboxLowBalance, orgs, changes)
}

// CreateWebhook adds an endpoint and returns its secret.
func (p *Ledger) CreateWebhook(ctx context.Context, rawURL string, events []ledger.EventType) (ledger.Webhook, string, error) {
	evs, err := ledger.CheckWebhook(rawURL, events)
	if err != nil {
		return ledger.Webhook{}, "", err
	}
	w := ledger.Webhook{ID: ledger.NewWebhookID(), URL: rawURL, Events: evs}
	secret := ledger.NewWebhookSecret()
	err = p.pool.QueryRow(ctx, `INSERT INTO webhook_endpoints (id, url, secret, events) VALUES ($1, $2, $3, $4) RETURNING created_at`,
		w.ID, w.URL, secret, eventStrings(evs)).Scan(&w.CreatedAt)
	if err != nil {
		return ledger.Webhook{}, "", wrapPg("create webhook", err)
	}
	return w, secret, nil
}

func eventStrings(evs []ledger.EventType) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = string(e)
	}
	return out
}

// ListWebhooks lists the endpoints by creation.
func (p *Ledger) ListWebhooks(ctx context.Context) ([]ledger.Webhook, error) {
	rows, _ := p.pool.Query(ctx, `SELECT id, url, events, created_at FROM webhook_endpoints ORDER BY created_at, id`)
	ws, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.Webhook, error) {
		var w ledger.Webhook
		var evs []string
		err := r.Scan(&w.ID, &w.URL, &evs, &w.CreatedAt)
		for _, e := range evs {
			w.Events = append(w.Events, ledger.EventType(e))
		}
		return w, err
	})
	return ws, wrapPg("list webhooks", err)
}

// DeleteWebhook deletes an endpoint and its deliveries.
func (p *Ledger) DeleteWebhook(ctx context.Context, id string) error {
	tag, err := p.pool.Exec(ctx, `DELETE FROM webhook_endpoints WHERE id = $1`, id)
	if err != nil {
		return wrapPg("delete webhook", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownWebhook, id)
	}
	return nil
}

const sqlDeliveryColumns = `d.id, d.endpoint_id, d.event_id::text, e.type, e.org_id, d.status, d.attempts, d.last_error,
	d.last_status, d.next_attempt_at, d.delivered_at, d.created_at`

func scanDelivery(r pgx.Row, more ...any) (ledger.Delivery, error) {
	var d ledger.Delivery
	var next time.Time
	err := r.Scan(append([]any{&d.ID, &d.WebhookID, &d.EventID, &d.EventType, &d.Org, &d.Status, &d.Attempts, &d.LastError,
		&d.LastStatus, &next, &d.DeliveredAt, &d.CreatedAt}, more...)...)
	if d.Status == ledger.DeliveryPending {
		d.NextAttemptAt = &next
	}
	return d, err
}

// ListDeliveries lists an endpoint's deliveries, newest first.
func (p *Ledger) ListDeliveries(ctx context.Context, webhookID string, q ledger.ListQuery) (ledger.Page[ledger.Delivery], error) {
	before, limit, err := ledger.DeliveryPage(q)
	if err != nil {
		return ledger.Page[ledger.Delivery]{}, err
	}
	var exists bool
	if err := p.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM webhook_endpoints WHERE id = $1)`, webhookID).Scan(&exists); err != nil {
		return ledger.Page[ledger.Delivery]{}, wrapPg("list deliveries", err)
	}
	if !exists {
		return ledger.Page[ledger.Delivery]{}, fmt.Errorf("%w: %q", ledger.ErrUnknownWebhook, webhookID)
	}
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlDeliveryColumns+`
FROM webhook_deliveries d JOIN webhook_events e ON e.id = d.event_id
WHERE d.endpoint_id = $1 AND d.id < $2 ORDER BY d.id DESC LIMIT $3`, webhookID, before, limit+1)
	ds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.Delivery, error) { return scanDelivery(r) })
	if err != nil {
		return ledger.Page[ledger.Delivery]{}, wrapPg("list deliveries", err)
	}
	return ledger.PageOf(ds, limit, ledger.DeliveryCursor), nil
}

// SetLowBalanceThreshold sets or clears the org's threshold.
func (p *Ledger) SetLowBalanceThreshold(ctx context.Context, org string, threshold *int64) error {
	if err := ledger.CheckThreshold(org, threshold); err != nil {
		return err
	}
	tag, err := p.pool.Exec(ctx, `UPDATE accounts SET low_balance_threshold = $2 WHERE org_id = $1`, org, threshold)
	if err != nil {
		return wrapPg("set low balance threshold", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return nil
}

// LowBalanceThreshold returns the org's threshold (nil for none).
func (p *Ledger) LowBalanceThreshold(ctx context.Context, org string) (*int64, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	var t *int64
	err := p.pool.QueryRow(ctx, `SELECT low_balance_threshold FROM accounts WHERE org_id = $1`, org).Scan(&t)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return t, wrapPg("low balance threshold", err)
}

// ClaimDeliveries claims due deliveries with FOR UPDATE SKIP LOCKED: workers in other
// processes skip the rows being claimed here. With a bound per endpoint, the due deliveries
// are ranked within their endpoint and only those within its room are claimed (a row another
// worker holds still counts against the room: a claim may take fewer, never more).
func (p *Ledger) ClaimDeliveries(ctx context.Context, limit int, lease time.Duration, per ledger.EndpointLimit) ([]ledger.Delivery, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	due := `
	SELECT id FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= now()
	ORDER BY next_attempt_at, id LIMIT $1 FOR UPDATE SKIP LOCKED`
	args := []any{limit, lease.Microseconds()}
	if per.Max > 0 {
		ids, busy := make([]string, 0, len(per.Busy)), make([]int32, 0, len(per.Busy))
		for id, n := range per.Busy {
			ids, busy = append(ids, id), append(busy, int32(n))
		}
		due = `
	SELECT w.id FROM webhook_deliveries w
	JOIN (SELECT id, endpoint_id, row_number() OVER (PARTITION BY endpoint_id ORDER BY next_attempt_at, id) AS n
		FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= now()) r ON r.id = w.id
	LEFT JOIN unnest($4::text[], $5::int[]) AS b(endpoint_id, n) ON b.endpoint_id = r.endpoint_id
	WHERE w.status = 'pending' AND w.next_attempt_at <= now() AND r.n <= $3 - COALESCE(b.n, 0)
	ORDER BY w.next_attempt_at, w.id LIMIT $1 FOR UPDATE OF w SKIP LOCKED`
		args = append(args, per.Max, ids, busy)
	}
	rows, _ := p.pool.Query(ctx, `
WITH due AS (`+due+`
), d AS (
	UPDATE webhook_deliveries w SET attempts = w.attempts + 1,
		next_attempt_at = now() + $2::bigint * interval '1 microsecond'
	FROM due WHERE w.id = due.id
	RETURNING w.*
)
SELECT `+sqlDeliveryColumns+`, w.url, w.secret, e.body
FROM d JOIN webhook_events e ON e.id = d.event_id JOIN webhook_endpoints w ON w.id = d.endpoint_id
ORDER BY d.next_attempt_at, d.id`, args...)
	ds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.Delivery, error) {
		var url, secret, body string
		d, err := scanDelivery(r, &url, &secret, &body)
		d.URL, d.Secret, d.Body = url, secret, []byte(body)
		return d, err
	})
	return ds, wrapPg("claim deliveries", err)
}

// FinishDelivery records an attempt's outcome unless the delivery was claimed again since.
func (p *Ledger) FinishDelivery(ctx context.Context, id int64, attempt int, o ledger.Outcome) error {
	if err := ledger.CheckOutcome(o); err != nil {
		return err
	}
	tag, err := p.pool.Exec(ctx, `
UPDATE webhook_deliveries SET status = $3, last_error = $4, last_status = $5,
	next_attempt_at = CASE WHEN $3 = 'pending' THEN now() + $6::bigint * interval '1 microsecond' ELSE next_attempt_at END,
	delivered_at = CASE WHEN $3 = 'delivered' THEN now() END
WHERE id = $1 AND attempts = $2 AND status = 'pending'`,
		id, attempt, string(o.Status), ledger.TruncateError(o.Error), o.HTTPStatus, o.RetryAfter.Microseconds())
	if err != nil {
		return wrapPg("finish delivery", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: delivery %d attempt %d", ledger.ErrDeliveryChanged, id, attempt)
	}
	return nil
}
