package pgledger

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

var _ balance.LimitLedger = (*Ledger)(nil)

// limitTx runs change in a transaction that first raises the org's limits version (which locks
// its account row: limit changes of one org are serialized with each other and with
// snapshots); an error of change rolls the version back with it.
func (p *Ledger) limitTx(ctx context.Context, op, org string, change func(tx pgx.Tx) error) (ledger.LimitChange, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.LimitChange{}, err
	}
	c := ledger.LimitChange{Org: org}
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, `UPDATE accounts SET limits_version = limits_version + 1 WHERE org_id = $1 RETURNING limits_version`, org).Scan(&c.Version)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
		}
		if err != nil {
			return err
		}
		return change(tx)
	})
	if err != nil {
		if isSentinel(err) {
			return ledger.LimitChange{}, err
		}
		return ledger.LimitChange{}, wrapPg(op, err)
	}
	return c, nil
}

// isSentinel: an error made by this package (already saying what is wrong), not by Postgres.
func isSentinel(err error) bool {
	for _, s := range []error{ledger.ErrUnknownOrg, ledger.ErrUnknownKey, ledger.ErrUnknownProject, ledger.ErrUnknownLimit, ledger.ErrProjectExists, ledger.ErrInvalidLimit} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// keyOrg returns the org of key id (ErrUnknownKey).
func (p *Ledger) keyOrg(ctx context.Context, id string) (string, error) {
	var org string
	err := p.pool.QueryRow(ctx, `SELECT org_id FROM api_keys WHERE id = $1`, id).Scan(&org)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("%w: %q", ledger.ErrUnknownKey, id)
	}
	return org, wrapPg("key", err)
}

// CreateProject creates a project of org.
func (p *Ledger) CreateProject(ctx context.Context, org, project string) (ledger.LimitChange, error) {
	if err := ledger.CheckProjectID(project); err != nil {
		return ledger.LimitChange{}, err
	}
	return p.limitTx(ctx, "create project", org, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO projects (org_id, id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, org, project)
		if err == nil && tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: %q", ledger.ErrProjectExists, project)
		}
		return err
	})
}

// SetKeyProject puts the key in a project of its org ("" for none).
func (p *Ledger) SetKeyProject(ctx context.Context, keyID, project string) (ledger.LimitChange, error) {
	org, err := p.keyOrg(ctx, keyID)
	if err != nil {
		return ledger.LimitChange{}, err
	}
	return p.limitTx(ctx, "set key project", org, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE api_keys SET project_id = NULLIF($2, '') WHERE id = $1`, keyID, project)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "23503" { // foreign_key_violation: no such project
			return fmt.Errorf("%w: %q", ledger.ErrUnknownProject, project)
		}
		return err
	})
}

// checkScopeTx checks that the scope's project or key is the org's.
func checkScopeTx(ctx context.Context, tx pgx.Tx, org string, s balance.Scope) error {
	var q string
	var miss error
	switch s.Kind {
	case balance.ScopeProject:
		q, miss = `SELECT EXISTS (SELECT 1 FROM projects WHERE org_id = $1 AND id = $2)`, ledger.ErrUnknownProject
	case balance.ScopeKey:
		q, miss = `SELECT EXISTS (SELECT 1 FROM api_keys WHERE org_id = $1 AND id = $2)`, ledger.ErrUnknownKey
	default:
		return nil
	}
	var ok bool
	if err := tx.QueryRow(ctx, q, org, s.ID).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: %q", miss, s.ID)
	}
	return nil
}

// CreateLimit adds a limit; its id comes from an identity and is never reused.
func (p *Ledger) CreateLimit(ctx context.Context, org string, l balance.Limit) (balance.Limit, ledger.LimitChange, error) {
	if err := ledger.CheckLimit(l); err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	c, err := p.limitTx(ctx, "create limit", org, func(tx pgx.Tx) error {
		if err := checkScopeTx(ctx, tx, org, l.Scope); err != nil {
			return err
		}
		var n int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM limits WHERE org_id = $1 AND deleted_at IS NULL`, org).Scan(&n); err != nil {
			return err
		}
		if n >= ledger.MaxLimits {
			return fmt.Errorf("%w: an org has at most %d limits", ledger.ErrInvalidLimit, ledger.MaxLimits)
		}
		return tx.QueryRow(ctx, `INSERT INTO limits (org_id, scope, scope_id, period, cap, unit, require_end_user) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id::text`,
			org, string(l.Scope.Kind), l.Scope.ID, string(l.Window), l.Cap, l.Unit.String(), l.RequireEndUser).Scan(&l.ID)
	})
	if err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	return l, c, nil
}

// SetLimitCap changes a live limit's cap.
func (p *Ledger) SetLimitCap(ctx context.Context, org, id string, cap int64) (balance.Limit, ledger.LimitChange, error) {
	if err := ledger.CheckCap(cap); err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	n, ok := parseLimitID(id)
	if !ok {
		return balance.Limit{}, ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
	}
	var l balance.Limit
	c, err := p.limitTx(ctx, "set limit cap", org, func(tx pgx.Tx) error {
		rows, _ := tx.Query(ctx, `UPDATE limits SET cap = $3, changed_at = now() WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL
RETURNING `+sqlLimitColumns, org, n, cap)
		var err error
		l, err = pgx.CollectExactlyOneRow(rows, scanLimit)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
		}
		return err
	})
	if err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	return l, c, nil
}

// DeleteLimit marks a live limit deleted (its row stays; its id is never used again).
func (p *Ledger) DeleteLimit(ctx context.Context, org, id string) (ledger.LimitChange, error) {
	n, ok := parseLimitID(id)
	if !ok {
		return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
	}
	return p.limitTx(ctx, "delete limit", org, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE limits SET deleted_at = now(), changed_at = now() WHERE org_id = $1 AND id = $2 AND deleted_at IS NULL`, org, n)
		if err == nil && tag.RowsAffected() == 0 {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
		}
		return err
	})
}

// SetFrozen freezes or unfreezes the org, a project or a key.
func (p *Ledger) SetFrozen(ctx context.Context, org string, s balance.Scope, frozen bool) (ledger.LimitChange, error) {
	if err := s.Validate(); err != nil {
		return ledger.LimitChange{}, fmt.Errorf("%w: %w", ledger.ErrInvalidLimit, err)
	}
	if s.Kind == balance.ScopeKey {
		keyOrg, err := p.keyOrg(ctx, s.ID)
		if err != nil {
			return ledger.LimitChange{}, err
		}
		if org != "" && org != keyOrg {
			return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownKey, s.ID)
		}
		org = keyOrg
	}
	return p.limitTx(ctx, "freeze", org, func(tx pgx.Tx) error {
		var tag pgconn.CommandTag
		var err error
		switch s.Kind {
		case balance.ScopeOrg:
			_, err = tx.Exec(ctx, `UPDATE accounts SET frozen = $2 WHERE org_id = $1`, org, frozen)
			return err
		case balance.ScopeProject:
			tag, err = tx.Exec(ctx, `UPDATE projects SET frozen = $3 WHERE org_id = $1 AND id = $2`, org, s.ID, frozen)
			if err == nil && tag.RowsAffected() == 0 {
				return fmt.Errorf("%w: %q", ledger.ErrUnknownProject, s.ID)
			}
		default:
			_, err = tx.Exec(ctx, `UPDATE api_keys SET frozen = $3 WHERE org_id = $1 AND id = $2`, org, s.ID, frozen)
		}
		return err
	})
}

const sqlLimitColumns = `id::text, scope, scope_id, period, cap, unit, require_end_user`

func scanLimit(r pgx.CollectableRow) (balance.Limit, error) {
	var l balance.Limit
	var kind, w, u string
	err := r.Scan(&l.ID, &kind, &l.Scope.ID, &w, &l.Cap, &u, &l.RequireEndUser)
	l.Scope.Kind, l.Window, l.Unit = balance.ScopeKind(kind), balance.Window(w), unitOf(u)
	return l, err
}

// unitOf reads the limits table's unit ("money", "requests", "tokens").
func unitOf(s string) balance.Unit {
	u, _ := ledger.ParseUnit(s)
	return u
}

// queueLimits queues the reads of an org's limits, freezes and key → project map (scanLimits
// reads their answers).
func queueLimits(b *pgx.Batch, org string) {
	b.Queue(`SELECT limits_version, frozen FROM accounts WHERE org_id = $1`, org)
	b.Queue(`SELECT `+sqlLimitColumns+` FROM limits WHERE org_id = $1 AND deleted_at IS NULL ORDER BY id`, org)
	b.Queue(`SELECT id FROM projects WHERE org_id = $1 AND frozen ORDER BY id`, org)
	b.Queue(`SELECT id, coalesce(project_id, ''), frozen FROM api_keys
WHERE org_id = $1 AND revoked_at IS NULL AND (project_id IS NOT NULL OR frozen) ORDER BY id`, org)
}

// scanLimits reads queueLimits' answers; found is false for an org without an account.
func scanLimits(br pgx.BatchResults) (ls balance.Limits, found bool, err error) {
	var frozen bool
	err = br.QueryRow().Scan(&ls.Version, &frozen)
	found = err == nil
	if errors.Is(err, pgx.ErrNoRows) {
		err = nil
	}
	if err != nil {
		return ls, found, err
	}
	if frozen {
		ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeOrg})
	}
	rows, _ := br.Query()
	if ls.Limits, err = pgx.CollectRows(rows, scanLimit); err != nil {
		return ls, found, err
	}
	rows, _ = br.Query()
	projects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return ls, found, err
	}
	for _, p := range projects {
		ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeProject, ID: p})
	}
	rows, _ = br.Query()
	var id, project string
	_, err = pgx.ForEachRow(rows, []any{&id, &project, &frozen}, func() error {
		if frozen {
			ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeKey, ID: id})
		}
		if project != "" {
			if ls.Projects == nil {
				ls.Projects = map[string]string{}
			}
			ls.Projects[id] = project
		}
		return nil
	})
	return ls, found, err
}

// Limits returns the org's limits, freezes and key → project map, read in one snapshot.
func (p *Ledger) Limits(ctx context.Context, org string) (balance.Limits, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return balance.Limits{}, err
	}
	var ls balance.Limits
	var found bool
	err := pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		queueLimits(b, org)
		br := tx.SendBatch(ctx, b)
		var err error
		ls, found, err = scanLimits(br)
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		return err
	})
	if err != nil {
		return balance.Limits{}, wrapPg("limits", err)
	}
	if !found {
		return balance.Limits{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return ls, nil
}

// LimitUsage is the spend of the org's limits' windows from since's on (a read-only snapshot).
func (p *Ledger) LimitUsage(ctx context.Context, org string, since time.Time, maxSeq int64) ([]balance.WindowUsed, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	var used []balance.WindowUsed
	var found bool
	err := pgx.BeginTxFunc(ctx, p.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		b := &pgx.Batch{}
		queueLimits(b, org)
		br := tx.SendBatch(ctx, b)
		ls, ok, err := scanLimits(br)
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil || !ok {
			return err
		}
		found = true
		if maxSeq < 0 {
			maxSeq = 1<<63 - 1
		}
		used, err = limitUsage(ctx, tx, org, ls.Limits, since, maxSeq, false)
		return err
	})
	if err != nil {
		return nil, wrapPg("limit usage", err)
	}
	if !found {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return used, nil
}

// sqlSpend groups an org's ($1) charges with seq ≤ $2 whose time (reserve time, else the
// entry's own) is at or after $4 by (key, project, end user, bucket): their cost, count and
// tokens. The bucket is -1 before $3, the minute from $8 on, else the hour
// (ledger.LimitSpan.Bucket); $5: every charge counts (an org limit), else only those of keys $6,
// projects $7, end users $10, or with an end user at all when $11 (a limit of each end user
// apart). Rows are split by end user only when $9 (some end-user limit): else they stay few.
// The times are whole milliseconds or microseconds, so floor(ms) is the UnixMilli Go buckets.
const sqlSpend = `
SELECT coalesce(key_id, ''), coalesce(project, ''), CASE WHEN $9 THEN coalesce(end_user, '') ELSE '' END,
       CASE WHEN t < $3 THEN -1
            WHEN t >= $8 THEN floor(extract(epoch FROM t) * 1000)::bigint / 60000 * 60000
            ELSE floor(extract(epoch FROM t) * 1000)::bigint / 3600000 * 3600000 END AS b,
       sum(-delta)::bigint, count(*), sum(tokens)::bigint
FROM (
	SELECT key_id, project, end_user, delta, tokens, coalesce(reserved_at, created_at) AS t FROM ledger_entries
	WHERE org_id = $1 AND kind = 'charge' AND coalesce(reserved_at, created_at) >= $4 AND seq <= $2
	  AND ($5 OR key_id = ANY($6::text[]) OR project = ANY($7::text[])
	       OR end_user = ANY($10::text[]) OR ($11 AND end_user IS NOT NULL))
) e
GROUP BY 1, 2, 3, 4`

// limitUsage sums the org's charges with seq ≤ maxSeq into the limits' windows from since's on,
// in the caller's transaction.
func limitUsage(ctx context.Context, tx pgx.Tx, org string, limits []balance.Limit, since time.Time, maxSeq int64, forSeed bool) ([]balance.WindowUsed, error) {
	span := ledger.NewLimitSpan(limits, since, forSeed)
	if span.Empty() { // no limit, or only lifetime limits of each end user apart (loaded per end user)
		return nil, nil
	}
	far := time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	earliest := far
	if span.Earliest < far.UnixMilli() {
		earliest = time.UnixMilli(span.Earliest).UTC()
	}
	lower := earliest
	if span.Lifetime {
		lower = time.Unix(0, 0).UTC()
	}
	minutes := far
	if span.MinuteFrom < far.UnixMilli() {
		minutes = time.UnixMilli(span.MinuteFrom).UTC()
	}
	rows, _ := tx.Query(ctx, sqlSpend, org, maxSeq, earliest, lower, span.Org, nonNil(span.Keys), nonNil(span.Projects), minutes,
		span.ByEndUser(), nonNil(span.EndUsers), span.EachEndUser)
	var sr []ledger.SpendRow
	var r ledger.SpendRow
	_, err := pgx.ForEachRow(rows, []any{&r.Key, &r.Project, &r.EndUser, &r.Start, &r.Cost, &r.Requests, &r.Tokens}, func() error {
		sr = append(sr, r)
		return nil
	})
	if err != nil {
		return nil, err
	}
	return span.Used(sr), nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// entryAttr is an entry row's nullable attribution ids.
type entryAttr struct{ key, project, endUser *string }

// attribute fills a balance.Entry's attribution from a ledger row (nil: none).
func attribute(e *balance.Entry, key, project, endUser *string, at *time.Time) {
	if key != nil {
		e.KeyID = ledger.AttrID(balance.ScopeKey, *key)
	}
	if project != nil {
		e.Project = ledger.AttrID(balance.ScopeProject, *project)
	}
	if endUser != nil {
		e.EndUser = ledger.AttrID(balance.ScopeEndUser, *endUser)
	}
	if at != nil {
		e.ReservedAt = at.UTC()
	}
}

// parseLimitID reads a limit id: the decimal form of a positive integer.
func parseLimitID(id string) (int64, bool) {
	n, err := strconv.ParseInt(id, 10, 64)
	return n, err == nil && n > 0 && strconv.FormatInt(n, 10) == id
}
