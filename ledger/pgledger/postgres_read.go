package pgledger

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

var _ ledger.Console = (*Ledger)(nil)

// tsArg is a time bound as a query argument: NULL for an open bound.
func tsArg(t time.Time) pgtype.Timestamptz {
	return pgtype.Timestamptz{Time: t, Valid: !t.IsZero()}
}

const sqlOrgColumns = `org_id, name, balance, ledger_seq, settled_seq, created_at, exempt`

func scanOrg(r pgx.CollectableRow) (ledger.OrgInfo, error) {
	var o ledger.OrgInfo
	err := r.Scan(&o.ID, &o.Name, &o.Balance, &o.LedgerSeq, &o.SettledSeq, &o.CreatedAt, &o.Exempt)
	o.CreatedAt = o.CreatedAt.UTC()
	return o, err
}

// ListOrgs lists orgs by id (the accounts primary key).
func (p *Ledger) ListOrgs(ctx context.Context, q ledger.ListQuery) (ledger.Page[ledger.OrgInfo], error) {
	after, err := ledger.ParseOrgCursor(q.Cursor)
	if err != nil {
		return ledger.Page[ledger.OrgInfo]{}, err
	}
	limit := ledger.PageLimit(q.Limit)
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlOrgColumns+` FROM accounts WHERE org_id > $1 ORDER BY org_id LIMIT $2`, after, limit+1)
	orgs, err := pgx.CollectRows(rows, scanOrg)
	if err != nil {
		return ledger.Page[ledger.OrgInfo]{}, wrapPg("list orgs", err)
	}
	return ledger.PageOf(orgs, limit, func(x ledger.OrgInfo) string { return ledger.OrgCursor(x.ID) }), nil
}

// Org returns one org.
func (p *Ledger) Org(ctx context.Context, org string) (ledger.OrgInfo, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.OrgInfo{}, err
	}
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlOrgColumns+` FROM accounts WHERE org_id = $1`, org)
	o, err := pgx.CollectExactlyOneRow(rows, scanOrg)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.OrgInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return o, wrapPg("org", err)
}

// SetOrgName sets an org's display name.
func (p *Ledger) SetOrgName(ctx context.Context, org, name string) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	if err := ledger.CheckName(name); err != nil {
		return err
	}
	tag, err := p.pool.Exec(ctx, `UPDATE accounts SET name = $2 WHERE org_id = $1`, org, name)
	if err != nil {
		return wrapPg("set org name", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return nil
}

// ListKeys lists an org's keys by (created_at, id) (index api_keys_org_created).
func (p *Ledger) ListKeys(ctx context.Context, org string, q ledger.ListQuery) (ledger.Page[ledger.KeyInfo], error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Page[ledger.KeyInfo]{}, err
	}
	afterT, afterID := time.Time{}, ""
	if q.Cursor != "" {
		var err error
		if afterT, afterID, err = ledger.ParseKeyCursor(q.Cursor); err != nil {
			return ledger.Page[ledger.KeyInfo]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	var keys []ledger.KeyInfo
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if err := orgExists(ctx, tx, org); err != nil {
			return err
		}
		rows, _ := tx.Query(ctx, `
SELECT id, org_id, name, created_at, revoked_at, coalesce(project_id, ''), frozen, last_used_at, coalesce(models, '{}') FROM api_keys
WHERE org_id = $1 AND ($2::timestamptz IS NULL OR (created_at, id) > ($2, $3))
ORDER BY created_at, id LIMIT $4`, org, tsArg(afterT), afterID, limit+1)
		var err error
		keys, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.KeyInfo, error) {
			var k ledger.KeyInfo
			err := r.Scan(&k.ID, &k.Org, &k.Name, &k.CreatedAt, &k.RevokedAt, &k.Project, &k.Frozen, &k.LastUsedAt, &k.Models)
			k.CreatedAt = k.CreatedAt.UTC()
			k.RevokedAt, k.LastUsedAt = utcPtr(k.RevokedAt), utcPtr(k.LastUsedAt)
			return k, err
		})
		return err
	})
	if errors.Is(err, ledger.ErrUnknownOrg) {
		return ledger.Page[ledger.KeyInfo]{}, err
	}
	if err != nil {
		return ledger.Page[ledger.KeyInfo]{}, wrapPg("list keys", err)
	}
	return ledger.PageOf(keys, limit, func(x ledger.KeyInfo) string { return ledger.KeyCursor(x.CreatedAt, x.ID) }), nil
}

// SetKeyName sets a key's display name.
func (p *Ledger) SetKeyName(ctx context.Context, id, name string) error {
	if err := ledger.CheckName(name); err != nil {
		return err
	}
	tag, err := p.pool.Exec(ctx, `UPDATE api_keys SET name = $2 WHERE id = $1`, id, name)
	if err != nil {
		return wrapPg("set key name", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, id)
	}
	return nil
}

// ListEntries lists an org's entries, newest first: a backward walk of the (org_id, seq) primary
// key from the cursor, each charge joined to its usage event by the event's primary key.
func (p *Ledger) ListEntries(ctx context.Context, org string, q ledger.EntryQuery) (ledger.Page[ledger.EntryInfo], error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Page[ledger.EntryInfo]{}, err
	}
	if err := q.Check(); err != nil {
		return ledger.Page[ledger.EntryInfo]{}, err
	}
	before := int64(1<<63 - 1)
	if q.Cursor != "" {
		var err error
		if before, err = ledger.ParseSeqCursor(q.Cursor, "entry"); err != nil {
			return ledger.Page[ledger.EntryInfo]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	var out []ledger.EntryInfo
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if err := orgExists(ctx, tx, org); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sqlListEntries, org, before, string(q.Kind), tsArg(q.From), tsArg(q.To), limit+1)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var e ledger.EntryInfo
			var hold, ref, evID, key, model, project, endUser *string
			var pt, cpt, rt, cost, holdAmt *int64
			var units pricing.Units
			var est *bool
			if err := rows.Scan(&e.Org, &e.Seq, &e.Delta, &e.Kind, &hold, &ref, &e.CreatedAt,
				&evID, &key, &model, &pt, &units, &cpt, &rt, &cost, &holdAmt, &est, &project, &endUser); err != nil {
				return err
			}
			e.CreatedAt = e.CreatedAt.UTC()
			e.HoldID, e.Ref = deref(hold), deref(ref)
			if evID != nil {
				e.Request = &ledger.EntryRequest{
					ID: *evID, KeyID: deref(key), Project: deref(project), EndUser: deref(endUser), Model: deref(model),
					Usage: pricing.Usage{Prompt: *pt, Completion: *cpt, Reasoning: *rt, Units: units},
					Cost:  *cost, HoldAmount: *holdAmt, Estimated: *est,
				}
			}
			out = append(out, e)
		}
		return rows.Err()
	})
	if errors.Is(err, ledger.ErrUnknownOrg) {
		return ledger.Page[ledger.EntryInfo]{}, err
	}
	if err != nil {
		return ledger.Page[ledger.EntryInfo]{}, wrapPg("list entries", err)
	}
	return ledger.PageOf(out, limit, func(x ledger.EntryInfo) string { return ledger.EntryCursor(x.Seq) }), nil
}

const sqlListEntries = `
SELECT e.org_id, e.seq, e.delta, e.kind, e.hold_id::text, e.ref, e.created_at,
       u.id::text, u.key_id, u.model, u.prompt_tokens, u.units, u.completion_tokens,
       u.reasoning_tokens, u.cost, u.hold_amount, u.estimated, u.project, u.end_user
FROM ledger_entries e
LEFT JOIN usage_events u ON e.kind = 'charge' AND u.id = e.hold_id
WHERE e.org_id = $1::text AND e.seq < $2::bigint
  AND ($3::text = '' OR e.kind = $3::text)
  AND ($4::timestamptz IS NULL OR coalesce(e.reserved_at, e.created_at) >= $4)
  AND ($5::timestamptz IS NULL OR coalesce(e.reserved_at, e.created_at) < $5)
ORDER BY e.seq DESC LIMIT $6::int`

func deref[T any](p *T) T {
	var z T
	if p == nil {
		return z
	}
	return *p
}

// UsageReport sums the org's accounted usage events per group, each at its request's reserve
// time (the record time for a fail-open request), as limits count it. It reads the org's charge
// entries of the range (index ledger_entries_org_reserved: a charge's reserved_at is its event's
// time) and each one's event by its id: an event is accounted exactly when it has its charge
// entry, with its cost, so the rows add up to the org's charges.
func (p *Ledger) UsageReport(ctx context.Context, org string, q ledger.UsageQuery) ([]ledger.UsageRow, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	if err := q.Check(); err != nil {
		return nil, err
	}
	group := map[string]string{
		ledger.GroupByDay:     `to_char(coalesce(u.reserved_at, u.created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')`,
		ledger.GroupByModel:   `u.model`,
		ledger.GroupByKey:     `coalesce(u.key_id, '')`,
		ledger.GroupByEndUser: `coalesce(u.end_user, '')`,
	}[q.GroupBy]
	var out []ledger.UsageRow
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		if err := orgExists(ctx, tx, org); err != nil {
			return err
		}
		rows, _ := tx.Query(ctx, `
SELECT g, count(*), sum(cost)::bigint, sum(prompt_tokens)::bigint, `+sqlSumUnits+`,
       sum(completion_tokens)::bigint, sum(reasoning_tokens)::bigint
FROM (SELECT `+group+` AS g, u.cost, u.prompt_tokens, u.units, u.completion_tokens, u.reasoning_tokens
      FROM ledger_entries e JOIN usage_events u ON u.id = e.hold_id
      WHERE e.org_id = $1 AND e.kind = 'charge'
        AND ($2::timestamptz IS NULL OR coalesce(e.reserved_at, e.created_at) >= $2)
        AND ($3::timestamptz IS NULL OR coalesce(e.reserved_at, e.created_at) < $3)) x
GROUP BY g ORDER BY g COLLATE "C"`, org, tsArg(q.From), tsArg(q.To))
		var err error
		out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.UsageRow, error) {
			var u ledger.UsageRow
			err := r.Scan(&u.Group, &u.Requests, &u.Cost, &u.Prompt, &u.Units, &u.Completion, &u.Reasoning)
			u.Fill()
			return u, err
		})
		return err
	})
	if errors.Is(err, ledger.ErrUnknownOrg) {
		return nil, err
	}
	if out == nil && err == nil {
		out = []ledger.UsageRow{}
	}
	return out, wrapPg("usage report", err)
}

// TopSpenders sums the accounted usage events reserved in the range per org and keeps the
// largest. It reads every accounted event of the range (the BRIN index on the reserve time skips the blocks
// outside it; no index orders orgs by spend): a report query, not a hot one.
func (p *Ledger) TopSpenders(ctx context.Context, q ledger.TopQuery) ([]ledger.UsageRow, error) {
	if err := q.Check(); err != nil {
		return nil, err
	}
	// The bounds are written into the statement only when given, so the planner sees the range
	// and uses usage_events_at_brin (an "x IS NULL OR" form would hide it in a generic plan).
	// An event is accounted when it is neither voided nor in the queue of pending usage
	// (migration 016; 'accounted' is the status of the events accounted before it).
	where, args := "status IN ('accounted', 'recorded') AND id NOT IN (SELECT unnest(ids) FROM usage_pending)", []any{q.Limit}
	if !q.From.IsZero() {
		args = append(args, q.From)
		where += fmt.Sprintf(" AND coalesce(reserved_at, created_at) >= $%d", len(args))
	}
	if !q.To.IsZero() {
		args = append(args, q.To)
		where += fmt.Sprintf(" AND coalesce(reserved_at, created_at) < $%d", len(args))
	}
	rows, _ := p.pool.Query(ctx, sqlTopSpenders(where), args...)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.UsageRow, error) {
		var u ledger.UsageRow
		err := r.Scan(&u.Group, &u.Requests, &u.Cost, &u.Prompt, &u.Units, &u.Completion, &u.Reasoning)
		u.Fill()
		return u, err
	})
	if out == nil && err == nil {
		out = []ledger.UsageRow{}
	}
	return out, wrapPg("top spenders", err)
}

// sqlSumUnits is an aggregate over a group's events: the sum of each class's units (a JSON
// object, NULL when there are none), whatever classes they hold.
const sqlSumUnits = `(SELECT jsonb_object_agg(k, n) FROM (SELECT e.key AS k, sum(e.value::bigint) AS n
	FROM unnest(array_agg(units)) AS x(u), jsonb_each_text(x.u) AS e GROUP BY e.key) s)`

// sqlTopSpenders is TopSpenders' query for a WHERE clause ($1 is the limit).
func sqlTopSpenders(where string) string {
	return `
SELECT org_id, count(*), sum(cost)::bigint, sum(prompt_tokens)::bigint, ` + sqlSumUnits + `,
       sum(completion_tokens)::bigint, sum(reasoning_tokens)::bigint
FROM usage_events WHERE ` + where + `
GROUP BY org_id
ORDER BY sum(cost) DESC, org_id COLLATE "C"
LIMIT $1`
}

// Request returns one request's usage event by its id (the primary key).
func (p *Ledger) Request(ctx context.Context, id string) (ledger.RequestInfo, error) {
	u, err := uuid.Parse(id)
	if err != nil {
		return ledger.RequestInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownRequest, id)
	}
	var r ledger.RequestInfo
	var key, endpoint, project, endUser *string
	var seq *int64
	var reserved *time.Time
	// A recorded event (migration 016) is pending while in the queue, else accounted by its
	// charge entry, found by the org and the time it copies from the event
	// (ledger_entries_org_reserved).
	err = p.pool.QueryRow(ctx, `
SELECT id::text, org_id, key_id, model, endpoint, prompt_tokens, units, completion_tokens,
       reasoning_tokens, cost, hold_amount, estimated,
       CASE WHEN status <> 'recorded' THEN status
            WHEN e.seq IS NOT NULL THEN 'accounted' ELSE 'pending' END,
       coalesce(u.seq, e.seq), created_at, project, reserved_at, end_user
FROM usage_events u LEFT JOIN LATERAL (
	SELECT l.seq FROM ledger_entries l
	WHERE u.status = 'recorded' AND l.org_id = u.org_id AND l.kind = 'charge'
	  AND coalesce(l.reserved_at, l.created_at) = coalesce(u.reserved_at, u.created_at) AND l.hold_id = u.id
) e ON true
WHERE u.id = $1`, u).Scan(&r.ID, &r.Org, &key, &r.Model, &endpoint,
		&r.Usage.Prompt, &r.Usage.Units, &r.Usage.Completion, &r.Usage.Reasoning, &r.Cost, &r.HoldAmount,
		&r.Estimated, &r.Status, &seq, &r.CreatedAt, &project, &reserved, &endUser)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.RequestInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownRequest, id)
	}
	if err != nil {
		return ledger.RequestInfo{}, wrapPg("request", err)
	}
	r.KeyID, r.Endpoint, r.Seq, r.Project, r.EndUser = deref(key), deref(endpoint), deref(seq), deref(project), deref(endUser)
	r.CreatedAt = r.CreatedAt.UTC()
	if reserved != nil {
		r.ReservedAt = reserved.UTC()
	}
	return r, nil
}

// DeleteModel deletes a model no usage event names. The check reads usage_events without an
// index on model: one more index would slow every recorded request, for a rare admin call. A
// request priced just before the delete still records (an event keeps its model name and cost).
// ModelUsed reports whether a usage event names the model (DeleteModel's ErrModelInUse).
func (p *Ledger) ModelUsed(ctx context.Context, name string) (bool, error) {
	var used bool
	err := p.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM usage_events WHERE model = $1)`, name).Scan(&used)
	return used, wrapPg("model used", err)
}

func (p *Ledger) DeleteModel(ctx context.Context, name string) error {
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		var found, used bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM models WHERE model = $1 FOR UPDATE)`, name).Scan(&found); err != nil {
			return err
		}
		if !found {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownModel, name)
		}
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM usage_events WHERE model = $1)`, name).Scan(&used); err != nil {
			return err
		}
		if used {
			return fmt.Errorf("%w: %q", ledger.ErrModelInUse, name)
		}
		_, err := tx.Exec(ctx, `DELETE FROM models WHERE model = $1`, name)
		return err
	})
	if errors.Is(err, ledger.ErrUnknownModel) || errors.Is(err, ledger.ErrModelInUse) {
		return err
	}
	return wrapPg("delete model", err)
}

// RecordAudit appends r to the audit trail.
func (p *Ledger) RecordAudit(ctx context.Context, r ledger.AuditRecord) (ledger.AuditRecord, error) {
	err := p.pool.QueryRow(ctx, `INSERT INTO admin_audit (actor, action, target, status, detail, token_id)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id, at`, r.Actor, r.Action, r.Target, r.Status, r.Detail, r.Token).Scan(&r.ID, &r.At)
	r.At = r.At.UTC()
	return r, wrapPg("record audit", err)
}

// AuditLog lists the audit trail, newest first.
func (p *Ledger) AuditLog(ctx context.Context, q ledger.ListQuery) (ledger.Page[ledger.AuditRecord], error) {
	before := int64(1<<63 - 1)
	if q.Cursor != "" {
		var err error
		if before, err = ledger.ParseSeqCursor(q.Cursor, "audit"); err != nil {
			return ledger.Page[ledger.AuditRecord]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	rows, _ := p.pool.Query(ctx, `SELECT id, at, actor, action, target, status, detail, token_id FROM admin_audit
WHERE id < $1 ORDER BY id DESC LIMIT $2`, before, limit+1)
	recs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ledger.AuditRecord, error) {
		var a ledger.AuditRecord
		err := r.Scan(&a.ID, &a.At, &a.Actor, &a.Action, &a.Target, &a.Status, &a.Detail, &a.Token)
		a.At = a.At.UTC()
		return a, err
	})
	if err != nil {
		return ledger.Page[ledger.AuditRecord]{}, wrapPg("audit log", err)
	}
	return ledger.PageOf(recs, limit, func(x ledger.AuditRecord) string { return ledger.AuditCursor(x.ID) }), nil
}

// utcPtr returns t in UTC (nil stays nil).
func utcPtr(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	u := t.UTC()
	return &u
}

// orgExists is nil when org has an account, ErrUnknownOrg when not: the reads that list an org's
// rows check it in their transaction, so an unknown org is an error, not an empty list.
func orgExists(ctx context.Context, tx pgx.Tx, org string) error {
	var ok bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM accounts WHERE org_id = $1)`, org).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return nil
}

// maxSpendSince bounds the instants one Spend call sums from.
const maxSpendSince = 16

// Spend reads the account, the key and the key's days in one statement (one snapshot), from the
// sums the account pass keeps (migration 021: accounts.charged, api_keys.charged, key_days): a
// few rows by primary key whatever the number of charges — never ledger_entries. It runs on the
// view pool (Config.ViewConns, ViewTimeout) when the ledger has one, so that customers polling
// it never take a connection the request path waits for.
func (p *Ledger) Spend(ctx context.Context, org, keyID string, since []time.Time) (ledger.Spend, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Spend{}, err
	}
	if len(since) > maxSpendSince {
		return ledger.Spend{}, fmt.Errorf("%w: at most %d instants", ledger.ErrInvalidQuery, maxSpendSince)
	}
	var sums strings.Builder
	args := []any{org, keyID}
	for _, t := range since {
		// A day counts from its midnight: an instant within a day counts that whole day (the
		// views ask for day, week and month starts, which are midnights).
		args = append(args, utcDay(t))
		fmt.Fprintf(&sums, `, coalesce(sum(d.charged) FILTER (WHERE d.day >= $%d::date), 0)`, len(args))
	}
	s := ledger.Spend{Key: ledger.KeySpend{ID: keyID, Since: make([]int64, len(since))}}
	dst := []any{&s.Balance, &s.Charged, &s.Key.Name, &s.Key.Project, &s.Key.Charged}
	for i := range s.Key.Since {
		dst = append(dst, &s.Key.Since[i])
	}
	earliest := utcDay(time.Now())
	for _, t := range since {
		if d := utcDay(t); d.Before(earliest) {
			earliest = d
		}
	}
	args = append(args, earliest)
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ViewTimeout)
	defer cancel()
	err := p.views.QueryRow(ctx, `
SELECT a.balance, a.charged, coalesce(k.name, ''), coalesce(k.project_id, ''), coalesce(k.charged, 0)`+sums.String()+`
FROM accounts a
LEFT JOIN api_keys k ON k.id = $2 AND k.org_id = a.org_id
LEFT JOIN key_days d ON k.id IS NOT NULL AND d.key_id = $2 AND d.day >= $`+strconv.Itoa(len(args))+`::date
WHERE a.org_id = $1
GROUP BY a.balance, a.charged, k.name, k.project_id, k.charged`, args...).Scan(dst...)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.Spend{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return s, wrapPg("spend", err)
}

// LimitWindows reads the org's limits' windows as the account pass keeps them (limit_windows:
// each limit's current window, at the org's last charge), on the view pool: a customer view's
// windowed numbers without a scan of the charges (issue 34). A window that no batch has charged
// since its limit was made has no row yet, and reads as nothing.
func (p *Ledger) LimitWindows(ctx context.Context, org string) ([]balance.WindowUsed, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ViewTimeout)
	defer cancel()
	rows, _ := p.views.Query(ctx, `SELECT w.limit_id::text, w.window_start, w.end_user, w.used
FROM limits l JOIN limit_windows w ON w.limit_id = l.id WHERE l.org_id = $1 AND l.deleted_at IS NULL`, org)
	var out []balance.WindowUsed
	var u balance.WindowUsed
	var start time.Time
	_, err := pgx.ForEachRow(rows, []any{&u.LimitID, &start, &u.EndUser, &u.Used}, func() error {
		u.Start = start.UnixMilli()
		out = append(out, u)
		return nil
	})
	return out, wrapPg("limit windows", err)
}
