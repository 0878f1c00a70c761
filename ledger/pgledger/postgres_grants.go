package pgledger

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
)

var _ grant.Store = (*Ledger)(nil)

const (
	// sqlWriteEntry writes a credit or an adjustment: $1 org, $2 delta, $3 kind, $4 reference,
	// $5 a credit's expiry (NULL: never), $6 its priority. A credit is also its grants row, and
	// a credit that expires marks the account (grants_expiring) and its entry (grant_expires_at).
	sqlWriteEntry = `
WITH acc AS (
	UPDATE accounts SET balance = balance + $2, ledger_seq = ledger_seq + 1,
		grants_expiring = grants_expiring OR ($3 = 'credit' AND $5::timestamptz IS NOT NULL)
	WHERE org_id = $1 RETURNING ledger_seq
), ins AS (
	INSERT INTO ledger_entries (org_id, seq, delta, kind, ref, grant_expires_at)
	SELECT $1, ledger_seq, $2, $3, NULLIF($4, ''), CASE WHEN $3 = 'credit' THEN $5::timestamptz END FROM acc
	RETURNING seq, created_at
), g AS (
	INSERT INTO grants (org_id, seq, amount, priority, expires_at, rest, ref)
	SELECT $1, seq, $2, $6, $5::timestamptz, $2, NULLIF($4, '') FROM ins WHERE $3 = 'credit'
)
SELECT seq, created_at FROM ins`
	// sqlSpendGrants: charges (or a debit) spend the grants (migration 024's function): $1 each
	// entry's org, $2 its cost, $3 its reserve time. Rows: the rests per expiry of the orgs that
	// have had a grant that expires (readSpend).
	sqlSpendGrants = `SELECT org_id, expires_at, rest FROM escrow_spend_grants($1::text[], $2::bigint[], $3::timestamptz[])`
	// sqlDue reads the rests per expiry of the orgs $1 that have had a grant that expires, with
	// their ledger_seq, in one snapshot.
	sqlDue = `
SELECT a.org_id, a.ledger_seq, d.expires_at, coalesce(d.rest, 0)::bigint
FROM accounts a LEFT JOIN LATERAL (
	SELECT g.expires_at, sum(g.rest)::bigint AS rest FROM grants g
	WHERE g.org_id = a.org_id AND g.expires_at IS NOT NULL AND g.expired_seq IS NULL
	GROUP BY g.expires_at) d ON true
WHERE a.org_id = ANY ($1::text[]) AND a.grants_expiring
ORDER BY a.org_id, d.expires_at`
)

// expiresArg is an expiry as a query argument (nil: never).
func expiresArg(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

// sameTerms reports whether a stored grant's terms (nil: a credit from before grants, which is
// paid) are o.
func sameTerms(prio *int, exp *time.Time, o grant.Options) bool {
	if prio == nil {
		return o == grant.Paid
	}
	if exp == nil {
		return *prio == o.Priority && o.ExpiresAt.IsZero()
	}
	return *prio == o.Priority && exp.Equal(o.ExpiresAt)
}

// readSpend reads sqlSpendGrants' rows: org → its rests per expiry (an org with none pending:
// an empty map).
func readSpend(br pgx.BatchResults) (map[string]map[int64]int64, error) {
	rows, _ := br.Query()
	out := map[string]map[int64]int64{}
	var org string
	var at *time.Time
	var rest int64
	_, err := pgx.ForEachRow(rows, []any{&org, &at, &rest}, func() error {
		addDue(out, org, at, rest)
		return nil
	})
	return out, err
}

// addDue adds one row of rests (at nil: the org's row without any) to by.
func addDue(by map[string]map[int64]int64, org string, at *time.Time, rest int64) {
	d := by[org]
	if d == nil {
		d = map[int64]int64{}
		by[org] = d
	}
	if at != nil {
		d[at.UnixMilli()] += rest
	}
}

// CreditGrant credits amount with grant terms o, idempotent by ref like Credit.
func (p *Ledger) CreditGrant(ctx context.Context, org string, amount int64, ref string, o grant.Options) (ledger.LedgerEntry, bool, error) {
	if amount <= 0 || amount > balance.MaxAmount {
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: credit %d", ledger.ErrInvalidAmount, amount)
	}
	if err := o.Check(time.Now()); err != nil {
		return ledger.LedgerEntry{}, false, err
	}
	if !o.ExpiresAt.IsZero() {
		o.ExpiresAt = time.UnixMilli(o.ExpiresAt.UnixMilli()).UTC() // the hot balance's clock: ms
	}
	return p.write(ctx, org, ledger.KindCredit, amount, ref, o)
}

// Grants lists the org's grants in spending order, the expired last.
func (p *Ledger) Grants(ctx context.Context, org string) ([]grant.Grant, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	var exists bool
	if err := p.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM accounts WHERE org_id = $1)`, org).Scan(&exists); err != nil {
		return nil, wrapPg("grants", err)
	}
	if !exists {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	rows, _ := p.pool.Query(ctx, `
SELECT seq, coalesce(ref, ''), amount, priority, expires_at, rest, expired_seq IS NOT NULL, coalesce(expired_amount, 0), created_at
FROM grants WHERE org_id = $1`, org)
	var out []grant.Grant
	var g grant.Grant
	var exp *time.Time
	_, err := pgx.ForEachRow(rows, []any{&g.Seq, &g.Reference, &g.Amount, &g.Priority, &exp, &g.Rest, &g.Expired, &g.ExpiredAmount, &g.CreatedAt}, func() error {
		x := g
		x.Org = org
		if exp != nil {
			x.ExpiresAt = exp.UTC()
		}
		out = append(out, x)
		return nil
	})
	if err != nil {
		return nil, wrapPg("grants", err)
	}
	return grant.Sorted(out), nil
}

// DueGrants lists the orgs with grants expired by upTo and no expire entry yet, with the latest
// such expiry each.
func (p *Ledger) DueGrants(ctx context.Context, upTo time.Time, limit int) (map[string]time.Time, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	rows, _ := p.pool.Query(ctx, `SELECT org_id, max(expires_at) FROM grants WHERE expires_at <= $1 AND expired_seq IS NULL
GROUP BY org_id ORDER BY org_id LIMIT $2`, upTo, limit)
	out := map[string]time.Time{}
	var org string
	var at time.Time
	_, err := pgx.ForEachRow(rows, []any{&org, &at}, func() error {
		out[org] = at.UTC()
		return nil
	})
	if err != nil {
		return nil, wrapPg("due grants", err)
	}
	return out, nil
}

// ExpireGrants writes the expire entries of the org's grants expired by upTo in one transaction
// that first accounts its pending usage (the snapshot's reads: the account row and the org's
// advisory lock held): each grant's unspent rest, one entry per grant with its reference, the
// last of each expiry time marked.
func (p *Ledger) ExpireGrants(ctx context.Context, org string, upTo time.Time) (int, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return 0, err
	}
	n := 0
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		rd, err := readSnapshot(ctx, tx, org, false)
		if err != nil {
			return err
		}
		if err := chargeAtSnapshot(ctx, tx, org, &rd); err != nil {
			return err
		}
		seq := rd.seq
		rows, _ := tx.Query(ctx, `SELECT seq, rest, expires_at FROM grants WHERE org_id = $1 AND expires_at <= $2 AND expired_seq IS NULL
ORDER BY expires_at, seq FOR UPDATE`, org, upTo)
		type due struct {
			seq, rest int64
			at        time.Time
		}
		ds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (due, error) {
			var d due
			return d, r.Scan(&d.seq, &d.rest, &d.at)
		})
		if err != nil || len(ds) == 0 {
			return err
		}
		var gSeqs, eSeqs, deltas []int64
		var refs []string
		var ats []time.Time
		var lasts []bool
		var sum int64
		for i, d := range ds {
			gSeqs, eSeqs, deltas = append(gSeqs, d.seq), append(eSeqs, seq+int64(i)+1), append(deltas, -d.rest)
			refs, ats = append(refs, grant.ExpireRef(org, d.seq)), append(ats, d.at)
			lasts = append(lasts, i == len(ds)-1 || !ds[i+1].at.Equal(d.at))
			sum += d.rest
		}
		b := &pgx.Batch{}
		b.Queue(`INSERT INTO ledger_entries (org_id, seq, delta, kind, ref, grant_expires_at, expire_last)
SELECT $1, s, d, 'expire', r, a, l FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::timestamptz[], $6::boolean[]) AS x(s, d, r, a, l)`,
			org, eSeqs, deltas, refs, ats, lasts)
		b.Queue(`UPDATE grants g SET expired_seq = x.e, expired_amount = g.rest, rest = 0
FROM unnest($2::bigint[], $3::bigint[]) AS x(s, e) WHERE g.org_id = $1 AND g.seq = x.s`, org, gSeqs, eSeqs)
		b.Queue(`UPDATE accounts SET balance = balance - $2, ledger_seq = ledger_seq + $3 WHERE org_id = $1`, org, sum, len(ds))
		b.Queue(sqlNotify, org)
		if sum > 0 {
			queueEntryOutbox(b, org, grant.KindExpire, -sum, "")
		}
		n = len(ds)
		return tx.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return 0, wrapPg("expire grants", err)
	}
	return n, nil
}

// expiriesOf reads the rests per expiry of orgs (those that have had a grant that expires), and
// each one's ledger_seq they are as of, in one statement.
func (p *Ledger) expiriesOf(ctx context.Context, orgs []string) (map[string]map[int64]int64, map[string]int64, error) {
	rows, _ := p.pool.Query(ctx, sqlDue, orgs)
	out, asOf := map[string]map[int64]int64{}, map[string]int64{}
	var org string
	var seq, rest int64
	var at *time.Time
	_, err := pgx.ForEachRow(rows, []any{&org, &seq, &at, &rest}, func() error {
		addDue(out, org, at, rest)
		asOf[org] = seq
		return nil
	})
	return out, asOf, err
}

// withExpiries puts the rests read now on the last entry of each org's read, when that entry is
// the org's latest (the rests are as of it).
func (p *Ledger) withExpiries(ctx context.Context, by map[string][]balance.Entry, flagged []string) error {
	if len(flagged) == 0 {
		return nil
	}
	xs, asOf, err := p.expiriesOf(ctx, flagged)
	if err != nil {
		return wrapPg("grant expiries", err)
	}
	for org, x := range xs {
		es := by[org]
		if n := len(es); n > 0 && es[n-1].Seq == asOf[org] {
			es[n-1].Expiries = &x
		}
	}
	return nil
}

// markGrant fills an entry's grant marks from its row: gx the credit's expiry or the expiry an
// expire entry closes, last (non-nil only for an expire entry) whether it is its time's last.
func markGrant(e *balance.Entry, gx *time.Time, last *bool) {
	if gx == nil {
		return
	}
	if last == nil {
		e.GrantExpiry = gx.UTC()
		return
	}
	e.Expired, e.LastOfExpiry = gx.UTC(), *last
}

// snapshotExpiries reads the rests per expiry into s, in the snapshot's transaction (nil for an
// org that never had a grant that expires).
func snapshotExpiries(ctx context.Context, tx pgx.Tx, org string, s *balance.Snapshot) error {
	rows, _ := tx.Query(ctx, sqlDue, []string{org})
	var o string
	var seq, rest int64
	var at *time.Time
	_, err := pgx.ForEachRow(rows, []any{&o, &seq, &at, &rest}, func() error {
		if s.Expiries == nil {
			s.Expiries = &map[int64]int64{}
		}
		if at != nil {
			(*s.Expiries)[at.UnixMilli()] += rest
		}
		return nil
	})
	return err
}
