package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/job"
)

var _ job.Store = (*Ledger)(nil)

const jobColumns = `id::text, kind, org_id, coalesce(key_id, ''), coalesce(project, ''), coalesce(end_user, ''), model,
	coalesce(endpoint, ''), upstream_id, hold, reserved_at, estimate, prices, data, status, attempts,
	coalesce(lease_owner, ''), lease_until, next_poll_at, usage, cost, unresolved, reason, settled_at, created_at, updated_at`

func scanJob(r pgx.Row) (job.Job, error) {
	var (
		j                    job.Job
		reserved, leaseUntil *time.Time
		prices, data, usage  []byte
		kind, status         string
	)
	err := r.Scan(&j.ID, &kind, &j.Org, &j.KeyID, &j.Project, &j.EndUser, &j.Model, &j.Endpoint, &j.UpstreamID,
		&j.Hold, &reserved, &j.Estimate, &prices, &data, &status, &j.Attempts, &j.LeaseOwner, &leaseUntil,
		&j.NextPollAt, &usage, &j.Cost, &j.Unresolved, &j.Reason, &j.SettledAt, &j.CreatedAt, &j.UpdatedAt)
	if err != nil {
		return j, err
	}
	j.Kind, j.Status = job.Kind(kind), job.Status(status)
	if reserved != nil {
		j.ReservedAt = reserved.UTC()
	}
	if leaseUntil != nil {
		j.LeaseUntil = *leaseUntil
	}
	if err := json.Unmarshal(prices, &j.Prices); err != nil {
		return j, fmt.Errorf("job %s prices: %w", j.ID, err)
	}
	if len(data) > 0 {
		j.Data = json.RawMessage(data)
	}
	if len(usage) > 0 {
		if err := json.Unmarshal(usage, &j.Usage); err != nil {
			return j, fmt.Errorf("job %s usage: %w", j.ID, err)
		}
	}
	return j, nil
}

// canonUUID is id in its canonical form, and whether it is a UUID at all.
func canonUUID(id string) (string, bool) {
	u, err := uuid.Parse(id)
	if err != nil {
		return id, false
	}
	return u.String(), true
}

// CreateJob records a job (idempotent by ID with the same kind and upstream id).
func (p *Ledger) CreateJob(ctx context.Context, j job.Job) (job.Job, bool, error) {
	j, err := job.Check(j)
	if err != nil {
		return j, false, err
	}
	prices, err := json.Marshal(j.Prices)
	if err != nil {
		return j, false, fmt.Errorf("%w: prices: %w", job.ErrInvalid, err)
	}
	var data, reserved, next any
	if len(j.Data) > 0 {
		data = []byte(j.Data)
	}
	if !j.ReservedAt.IsZero() {
		reserved = j.ReservedAt
	}
	if !j.NextPollAt.IsZero() {
		next = j.NextPollAt
	}
	out, err := scanJob(p.pool.QueryRow(ctx, `
INSERT INTO jobs (id, kind, org_id, key_id, project, end_user, model, endpoint, upstream_id, hold, reserved_at,
	estimate, prices, data, status, next_poll_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, 'pending', coalesce($15, now()))
ON CONFLICT DO NOTHING
RETURNING `+jobColumns,
		j.ID, string(j.Kind), j.Org, nullIfEmpty(j.KeyID), nullIfEmpty(j.Project), nullIfEmpty(j.EndUser), j.Model,
		nullIfEmpty(j.Endpoint), j.UpstreamID, j.Hold, reserved, j.Estimate, prices, data, next))
	if err == nil {
		return out, true, nil
	}
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == "23503" {
		return j, false, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, j.Org)
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return j, false, wrapPg("create job", err)
	}
	// A conflict: the same job again, or another one with its id or upstream id.
	stored, err := p.Job(ctx, j.ID)
	if err == nil && job.Same(stored, j) {
		return stored, false, nil
	}
	if err != nil && !errors.Is(err, job.ErrUnknownJob) {
		return j, false, err
	}
	return j, false, fmt.Errorf("%w: job %s, %s %q", job.ErrConflict, j.ID, j.Kind, j.UpstreamID)
}

// Job returns a job by id.
func (p *Ledger) Job(ctx context.Context, id string) (job.Job, error) {
	id, ok := canonUUID(id)
	if !ok {
		return job.Job{}, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	}
	return p.oneJob(ctx, `SELECT `+jobColumns+` FROM jobs WHERE id = $1::text::uuid`, id)
}

// JobByUpstream returns the job of kind with the upstream's id.
func (p *Ledger) JobByUpstream(ctx context.Context, kind job.Kind, upstreamID string) (job.Job, error) {
	return p.oneJob(ctx, `SELECT `+jobColumns+` FROM jobs WHERE kind = $1 AND upstream_id = $2`, string(kind), upstreamID)
}

func (p *Ledger) oneJob(ctx context.Context, sql string, args ...any) (job.Job, error) {
	j, err := scanJob(p.pool.QueryRow(ctx, sql, args...))
	if errors.Is(err, pgx.ErrNoRows) {
		return j, fmt.Errorf("%w: %v", job.ErrUnknownJob, args)
	}
	return j, wrapPg("job", err)
}

// Jobs lists jobs, newest first.
func (p *Ledger) Jobs(ctx context.Context, q job.Query) ([]job.Job, error) {
	rows, err := p.pool.Query(ctx, `SELECT `+jobColumns+` FROM jobs
WHERE ($1 = '' OR org_id = $1) AND ($2 = '' OR kind = $2) AND (NOT $3 OR settled_at IS NULL)
ORDER BY created_at DESC, id DESC LIMIT $4`, q.Org, string(q.Kind), q.Live, q.Bounded())
	if err != nil {
		return nil, wrapPg("jobs", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (job.Job, error) { return scanJob(r) })
	return out, wrapPg("jobs", err)
}

// LiveJobs counts the live jobs per kind.
func (p *Ledger) LiveJobs(ctx context.Context) (map[job.Kind]int, error) {
	rows, err := p.pool.Query(ctx, `SELECT kind, count(*) FROM jobs WHERE settled_at IS NULL GROUP BY kind`)
	if err != nil {
		return nil, wrapPg("live jobs", err)
	}
	out := map[job.Kind]int{}
	var (
		kind string
		n    int
	)
	_, err = pgx.ForEachRow(rows, []any{&kind, &n}, func() error { out[job.Kind(kind)] = n; return nil })
	return out, wrapPg("live jobs", err)
}

// ClaimJobs leases due live jobs whose lease is free or ran out.
func (p *Ledger) ClaimJobs(ctx context.Context, owner string, kinds []job.Kind, lease time.Duration, limit int) ([]job.Job, error) {
	if owner == "" || lease <= 0 || limit <= 0 {
		return nil, fmt.Errorf("%w: claim needs an owner, a lease and a limit", job.ErrInvalid)
	}
	ks := make([]string, len(kinds))
	for i, k := range kinds {
		ks[i] = string(k)
	}
	rows, err := p.pool.Query(ctx, `
WITH due AS (
	SELECT id FROM jobs
	WHERE settled_at IS NULL AND next_poll_at <= now() AND (lease_until IS NULL OR lease_until <= now())
	  AND (cardinality($3::text[]) = 0 OR kind = ANY ($3::text[]))
	ORDER BY next_poll_at, id
	LIMIT $4
	FOR UPDATE SKIP LOCKED
)
UPDATE jobs SET lease_owner = $1, lease_until = now() + $2 * interval '1 microsecond', updated_at = now()
WHERE id IN (SELECT id FROM due)
RETURNING `+jobColumns, owner, lease.Microseconds(), ks, limit)
	if err != nil {
		return nil, wrapPg("claim jobs", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (job.Job, error) { return scanJob(r) })
	return out, wrapPg("claim jobs", err)
}

// RecordPoll records the lease holder's poll and gives the lease back.
func (p *Ledger) RecordPoll(ctx context.Context, id, owner string, pr job.Progress) (job.Job, error) {
	if pr.Status != job.Pending && pr.Status != job.Running {
		return job.Job{}, fmt.Errorf("%w: a poll records pending or running, not %q", job.ErrInvalid, pr.Status)
	}
	id, ok := canonUUID(id)
	if !ok {
		return job.Job{}, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	}
	j, err := scanJob(p.pool.QueryRow(ctx, `
UPDATE jobs SET status = $3, attempts = attempts + 1, next_poll_at = now() + $4 * interval '1 microsecond',
	lease_until = NULL, updated_at = now()
WHERE id = $1::text::uuid AND settled_at IS NULL AND lease_owner = $2
RETURNING `+jobColumns, id, owner, string(pr.Status), max(pr.Next, 0).Microseconds()))
	if errors.Is(err, pgx.ErrNoRows) {
		if _, err := p.Job(ctx, id); err != nil {
			return job.Job{}, err
		}
		return job.Job{}, fmt.Errorf("%w: job %s", job.ErrLeaseLost, id)
	}
	return j, wrapPg("record poll", err)
}

// SettleJob ends a live job once: its outcome, its usage events and (unresolved) its webhook
// event in one transaction.
func (p *Ledger) SettleJob(ctx context.Context, id string, s job.Settlement) (job.Job, bool, error) {
	if err := job.CheckSettlement(s); err != nil {
		return job.Job{}, false, err
	}
	id, ok := canonUUID(id)
	if !ok {
		return job.Job{}, false, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	}
	var (
		out   job.Job
		first bool
	)
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		j, err := scanJob(tx.QueryRow(ctx, `SELECT `+jobColumns+` FROM jobs WHERE id = $1::text::uuid FOR UPDATE`, id))
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
		} else if err != nil {
			return err
		}
		if !j.Live() {
			out = j
			return nil
		}
		var now time.Time
		if err := tx.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
			return err
		}
		args, _, err := usageArgs(job.Events(j, s, now))
		if err != nil {
			return fmt.Errorf("%w: %w", job.ErrInvalid, err)
		}
		if _, err := tx.Exec(ctx, sqlRecordNotifyOnConflict, args...); err != nil {
			return err
		}
		cost, usage := job.Total(s)
		ub, err := json.Marshal(usage)
		if err != nil {
			return err
		}
		if out, err = scanJob(tx.QueryRow(ctx, `
UPDATE jobs SET status = $2, usage = $3, cost = $4, unresolved = $5, reason = $6, settled_at = now(),
	lease_owner = NULL, lease_until = NULL, updated_at = now()
WHERE id = $1::text::uuid RETURNING `+jobColumns, id, string(s.Status), ub, cost, s.Unresolved, s.Reason)); err != nil {
			return err
		}
		first = true
		if !s.Unresolved {
			return nil
		}
		data, err := json.Marshal(job.UnresolvedData{Job: out.ID, Kind: out.Kind, UpstreamID: out.UpstreamID,
			Model: out.Model, Hold: out.Hold, Cost: out.Cost, Reason: out.Reason})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, sqlOutboxJobUnresolved, out.Org, data)
		return err
	})
	if errors.Is(err, job.ErrUnknownJob) || errors.Is(err, job.ErrInvalid) {
		return out, false, err
	}
	return out, first, wrapPg("settle job", err)
}

// sqlOutboxJobUnresolved writes the job.unresolved event in SettleJob's transaction: $1 org, $2
// the data (job.UnresolvedData).
var sqlOutboxJobUnresolved = `WITH ` + sqlOutbox(ledger.EventJobUnresolved, `
	SELECT $1::text AS org, $2::jsonb AS data`) + ` SELECT 1`

// liveJobHolds is the part of UnsettledUsage's statement that reports the holds of live jobs
// ($1 org, $2 canonical ids): a job's hold is busy until the job is settled.
const liveJobHolds = `
UNION
SELECT id::text FROM jobs WHERE org_id = $1 AND settled_at IS NULL AND id = ANY ($2::text[]::uuid[])`
