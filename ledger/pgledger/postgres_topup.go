package pgledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
)

var _ topup.Store = (*Ledger)(nil)

const topUpColumns = `org_id, threshold, amount, currency, customer, payment_method, daily_cap, monthly_cap, stopped, updated_at`

func scanTopUp(r pgx.Row) (topup.Settings, error) {
	var s topup.Settings
	err := r.Scan(&s.Org, &s.Threshold, &s.Amount, &s.Currency, &s.Customer, &s.PaymentMethod, &s.DailyCap, &s.MonthlyCap, &s.Stopped, &s.UpdatedAt)
	return s, err
}

// PutTopUp creates or replaces the org's settings and clears stopped.
func (p *Ledger) PutTopUp(ctx context.Context, s topup.Settings) (topup.Settings, error) {
	s, err := topup.Check(s)
	if err != nil {
		return s, err
	}
	out, err := scanTopUp(p.pool.QueryRow(ctx, `
INSERT INTO topup_settings (org_id, threshold, amount, currency, customer, payment_method, daily_cap, monthly_cap, stopped, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, '', now())
ON CONFLICT (org_id) DO UPDATE SET threshold = $2, amount = $3, currency = $4, customer = $5, payment_method = $6,
	daily_cap = $7, monthly_cap = $8, stopped = '', updated_at = now()
RETURNING `+topUpColumns, s.Org, s.Threshold, s.Amount, s.Currency, s.Customer, s.PaymentMethod, s.DailyCap, s.MonthlyCap))
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23503" { // foreign_key_violation: no account
		return s, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, s.Org)
	}
	return out, wrapPg("put top-up", err)
}

// TopUp returns the org's settings.
func (p *Ledger) TopUp(ctx context.Context, org string) (topup.Settings, error) {
	s, err := scanTopUp(p.pool.QueryRow(ctx, `SELECT `+topUpColumns+` FROM topup_settings WHERE org_id = $1`, org))
	if errors.Is(err, pgx.ErrNoRows) {
		return s, fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
	}
	return s, wrapPg("top-up", err)
}

// DeleteTopUp removes the org's settings.
func (p *Ledger) DeleteTopUp(ctx context.Context, org string) error {
	tag, err := p.pool.Exec(ctx, `DELETE FROM topup_settings WHERE org_id = $1`, org)
	if err != nil {
		return wrapPg("delete top-up", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
	}
	return nil
}

// TopUpOrgs lists the orgs whose top-ups may start.
func (p *Ledger) TopUpOrgs(ctx context.Context) ([]string, error) {
	rows, _ := p.pool.Query(ctx, `SELECT org_id FROM topup_settings WHERE stopped = '' ORDER BY org_id`)
	orgs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return orgs, wrapPg("top-up orgs", err)
}

// OrgOfCustomer is the org whose settings name customer.
func (p *Ledger) OrgOfCustomer(ctx context.Context, customer string) (string, error) {
	var org string
	err := p.pool.QueryRow(ctx, `SELECT org_id FROM topup_settings WHERE customer = $1 ORDER BY org_id LIMIT 1`, customer).Scan(&org)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("%w: customer %q", topup.ErrNoSettings, customer)
	}
	return org, wrapPg("org of customer", err)
}

const attemptColumns = `id, org_id, amount, currency, status, payment, reason, created_at, finished_at`

func scanAttempt(r pgx.Row) (topup.Attempt, error) {
	var a topup.Attempt
	var status string
	err := r.Scan(&a.ID, &a.Org, &a.Amount, &a.Currency, &status, &a.Payment, &a.Reason, &a.CreatedAt, &a.FinishedAt)
	a.Status = topup.Status(status)
	return a, err
}

// BeginTopUp starts an attempt in one transaction that locks the org's settings row: the
// checks and the insert cannot interleave with another BeginTopUp of the org.
func (p *Ledger) BeginTopUp(ctx context.Context, org string, now time.Time) (topup.Attempt, error) {
	var out topup.Attempt
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		s, err := scanTopUp(tx.QueryRow(ctx, `SELECT `+topUpColumns+` FROM topup_settings WHERE org_id = $1 FOR UPDATE`, org))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
		} else if err != nil {
			return err
		}
		if s.Stopped != "" {
			return fmt.Errorf("%w: %s", topup.ErrStopped, s.Stopped)
		}
		pending, err := scanAttempt(tx.QueryRow(ctx, `SELECT `+attemptColumns+` FROM topup_attempts WHERE org_id = $1 AND status = 'pending'`, org))
		switch {
		case err == nil && pending.Payment == "":
			out = pending // never made: retried with the same idempotency key
			return nil
		case err == nil:
			return fmt.Errorf("%w: %s", topup.ErrInFlight, pending.ID)
		case !errors.Is(err, pgx.ErrNoRows):
			return err
		}
		day, month := topup.Windows(now)
		var bal, daySum, monthSum int64
		err = tx.QueryRow(ctx, `
SELECT a.balance,
	COALESCE((SELECT sum(amount) FROM topup_attempts WHERE org_id = $1 AND status = 'succeeded' AND created_at >= $2), 0),
	COALESCE((SELECT sum(amount) FROM topup_attempts WHERE org_id = $1 AND status = 'succeeded' AND created_at >= $3), 0)
FROM accounts a WHERE a.org_id = $1`, org, day, month).Scan(&bal, &daySum, &monthSum)
		if err != nil {
			return err
		}
		if bal >= s.Threshold {
			return fmt.Errorf("%w: balance %d, threshold %d", topup.ErrNotNeeded, bal, s.Threshold)
		}
		if daySum+s.Amount > s.DailyCap || monthSum+s.Amount > s.MonthlyCap {
			return fmt.Errorf("%w: %d today of %d, %d this month of %d, next %d",
				topup.ErrCap, daySum, s.DailyCap, monthSum, s.MonthlyCap, s.Amount)
		}
		out, err = scanAttempt(tx.QueryRow(ctx, `
INSERT INTO topup_attempts (id, org_id, amount, currency, status, created_at) VALUES ($1, $2, $3, $4, 'pending', $5)
RETURNING `+attemptColumns, topup.NewAttemptID(), org, s.Amount, s.Currency, now.UTC()))
		return err
	})
	if err != nil {
		if isTopUpSentinel(err) {
			return topup.Attempt{}, err
		}
		return topup.Attempt{}, wrapPg("begin top-up", err)
	}
	return out, nil
}

func isTopUpSentinel(err error) bool {
	for _, s := range []error{topup.ErrNoSettings, topup.ErrStopped, topup.ErrInFlight, topup.ErrNotNeeded, topup.ErrCap} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// SetTopUpPayment records a pending attempt's payment id.
func (p *Ledger) SetTopUpPayment(ctx context.Context, id, payment string) error {
	var n int
	err := p.pool.QueryRow(ctx, `
WITH u AS (UPDATE topup_attempts SET payment = $2 WHERE id = $1 AND status = 'pending' RETURNING 1)
SELECT (SELECT count(*) FROM topup_attempts WHERE id = $1)::int`, id, payment).Scan(&n)
	if err != nil {
		return wrapPg("set top-up payment", err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %q", topup.ErrUnknownAttempt, id)
	}
	return nil
}

// FinishTopUp ends a pending attempt; a failure stops the org's top-ups in the same
// transaction.
func (p *Ledger) FinishTopUp(ctx context.Context, id string, succeeded bool, reason string, now time.Time) (topup.Attempt, error) {
	var out topup.Attempt
	status := topup.Succeeded
	if !succeeded {
		status = topup.Failed
	} else {
		reason = ""
	}
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		a, err := scanAttempt(tx.QueryRow(ctx, `SELECT `+attemptColumns+` FROM topup_attempts WHERE id = $1 FOR UPDATE`, id))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", topup.ErrUnknownAttempt, id)
		} else if err != nil {
			return err
		}
		if a.Status != topup.Pending {
			out = a
			return nil
		}
		if out, err = scanAttempt(tx.QueryRow(ctx, `
UPDATE topup_attempts SET status = $2, reason = $3, finished_at = $4 WHERE id = $1 RETURNING `+attemptColumns,
			id, string(status), reason, now.UTC())); err != nil {
			return err
		}
		if succeeded {
			return nil
		}
		if _, err = tx.Exec(ctx, `UPDATE topup_settings SET stopped = $2 WHERE org_id = $1`,
			a.Org, "attempt "+a.ID+" failed: "+reason); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, sqlOutboxTopUpFailed, out.Org, out.ID, out.Amount, out.Currency, out.Payment, out.Reason)
		return err
	})
	if errors.Is(err, topup.ErrUnknownAttempt) {
		return out, err
	}
	return out, wrapPg("finish top-up", err)
}

// sqlOutboxTopUpFailed writes the topup.failed event in FinishTopUp's transaction: $1 org, $2
// attempt, $3 amount, $4 currency, $5 payment, $6 reason.
var sqlOutboxTopUpFailed = `WITH ` + sqlOutbox(ledger.EventTopUpFailed, `
	SELECT $1::text AS org, jsonb_build_object('attempt', $2::text, 'amount', $3::bigint, 'currency', $4::text,
		'payment', $5::text, 'reason', $6::text) AS data`) + ` SELECT 1`

// TopUpAttempts lists the org's attempts, newest first.
func (p *Ledger) TopUpAttempts(ctx context.Context, org string, limit int) ([]topup.Attempt, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = 100
	}
	rows, _ := p.pool.Query(ctx, `SELECT `+attemptColumns+` FROM topup_attempts WHERE org_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2`, org, limit)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (topup.Attempt, error) { return scanAttempt(r) })
	return out, wrapPg("top-up attempts", err)
}

// CreditOrg is the org of the credit with reference ref.
func (p *Ledger) CreditOrg(ctx context.Context, ref string) (string, error) {
	var org string
	err := p.pool.QueryRow(ctx, `SELECT org_id FROM ledger_entries WHERE kind = 'credit' AND ref = $1`, ref).Scan(&org)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("%w: %q", topup.ErrUnknownReference, ref)
	}
	return org, wrapPg("credit org", err)
}
