package memledger

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/pricing"
)

var _ job.Store = (*Ledger)(nil)

// memJobs is the memory ledger's jobs; Ledger.mu guards it.
type memJobs struct {
	byID       map[string]*job.Job
	byUpstream map[upstreamKey]*job.Job
	order      []*job.Job // by creation
}

type upstreamKey struct {
	kind job.Kind
	id   string
}

// copyJob is a copy of j that shares no slice or map with it.
func copyJob(j *job.Job) job.Job {
	c := *j
	c.Prices = maps.Clone(j.Prices)
	c.Data = slices.Clone(j.Data)
	c.Usage.Units = maps.Clone(j.Usage.Units)
	if j.SettledAt != nil {
		t := *j.SettledAt
		c.SettledAt = &t
	}
	return c
}

func jobNow() time.Time { return time.Now().UTC().Truncate(time.Microsecond) }

// CreateJob records a job (idempotent by ID with the same kind and upstream id).
func (m *Ledger) CreateJob(ctx context.Context, j job.Job) (job.Job, bool, error) {
	j, err := job.Check(j)
	if err != nil {
		return j, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[j.Org] == nil {
		return j, false, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, j.Org)
	}
	if m.jobs.byID == nil {
		m.jobs.byID, m.jobs.byUpstream = map[string]*job.Job{}, map[upstreamKey]*job.Job{}
	}
	if old := m.jobs.byID[j.ID]; old != nil {
		if job.Same(*old, j) {
			return copyJob(old), false, nil
		}
		return j, false, fmt.Errorf("%w: job %s", job.ErrConflict, j.ID)
	}
	uk := upstreamKey{j.Kind, j.UpstreamID}
	if m.jobs.byUpstream[uk] != nil {
		return j, false, fmt.Errorf("%w: %s %q", job.ErrConflict, j.Kind, j.UpstreamID)
	}
	t := jobNow()
	j.CreatedAt, j.UpdatedAt = t, t
	if j.NextPollAt.IsZero() {
		j.NextPollAt = t
	}
	j.NextPollAt = j.NextPollAt.UTC().Truncate(time.Microsecond)
	j.Attempts, j.LeaseOwner, j.LeaseUntil, j.SettledAt = 0, "", time.Time{}, nil
	j.Usage, j.Cost, j.Unresolved, j.Reason = pricing.Usage{}, 0, false, ""
	stored := copyJob(&j)
	m.jobs.byID[j.ID] = &stored
	m.jobs.byUpstream[uk] = &stored
	m.jobs.order = append(m.jobs.order, &stored)
	return copyJob(&stored), true, nil
}

// Job returns a job by id.
func (m *Ledger) Job(ctx context.Context, id string) (job.Job, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	j := m.jobByID(id)
	if j == nil {
		return job.Job{}, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	}
	return copyJob(j), nil
}

func (m *Ledger) jobByID(id string) *job.Job {
	u, err := uuid.Parse(id)
	if err != nil {
		return nil
	}
	return m.jobs.byID[u.String()]
}

// JobByUpstream returns the job of kind with the upstream's id.
func (m *Ledger) JobByUpstream(ctx context.Context, kind job.Kind, upstreamID string) (job.Job, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	j := m.jobs.byUpstream[upstreamKey{kind, upstreamID}]
	if j == nil {
		return job.Job{}, fmt.Errorf("%w: %s %q", job.ErrUnknownJob, kind, upstreamID)
	}
	return copyJob(j), nil
}

// Jobs lists jobs, newest first.
func (m *Ledger) Jobs(ctx context.Context, q job.Query) ([]job.Job, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []job.Job
	for i := len(m.jobs.order) - 1; i >= 0 && len(out) < q.Bounded(); i-- {
		j := m.jobs.order[i]
		if (q.Org == "" || j.Org == q.Org) && (q.Kind == "" || j.Kind == q.Kind) && (!q.Live || j.Live()) {
			out = append(out, copyJob(j))
		}
	}
	return out, nil
}

// LiveJobs counts the live jobs per kind.
func (m *Ledger) LiveJobs(ctx context.Context) (map[job.Kind]int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[job.Kind]int{}
	for _, j := range m.jobs.order {
		if j.Live() {
			out[j.Kind]++
		}
	}
	return out, nil
}

// ClaimJobs leases due live jobs whose lease is free or ran out.
func (m *Ledger) ClaimJobs(ctx context.Context, owner string, kinds []job.Kind, lease time.Duration, limit int) ([]job.Job, error) {
	if owner == "" || lease <= 0 || limit <= 0 {
		return nil, fmt.Errorf("%w: claim needs an owner, a lease and a limit", job.ErrInvalid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	t := jobNow()
	var due []*job.Job
	for _, j := range m.jobs.order {
		if j.Live() && !j.NextPollAt.After(t) && (j.LeaseUntil.IsZero() || !j.LeaseUntil.After(t)) &&
			(len(kinds) == 0 || slices.Contains(kinds, j.Kind)) {
			due = append(due, j)
		}
	}
	slices.SortStableFunc(due, func(a, b *job.Job) int {
		if c := a.NextPollAt.Compare(b.NextPollAt); c != 0 {
			return c
		}
		return compareStrings(a.ID, b.ID)
	})
	out := make([]job.Job, 0, min(limit, len(due)))
	for _, j := range due[:min(limit, len(due))] {
		j.LeaseOwner, j.LeaseUntil, j.UpdatedAt = owner, t.Add(lease), t
		out = append(out, copyJob(j))
	}
	return out, nil
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// RecordPoll records the lease holder's poll and gives the lease back.
func (m *Ledger) RecordPoll(ctx context.Context, id, owner string, p job.Progress) (job.Job, error) {
	if p.Status != job.Pending && p.Status != job.Running {
		return job.Job{}, fmt.Errorf("%w: a poll records pending or running, not %q", job.ErrInvalid, p.Status)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	j := m.jobByID(id)
	switch {
	case j == nil:
		return job.Job{}, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	case !j.Live() || j.LeaseOwner != owner:
		return job.Job{}, fmt.Errorf("%w: job %s", job.ErrLeaseLost, id)
	}
	t := jobNow()
	j.Status, j.Attempts, j.NextPollAt = p.Status, j.Attempts+1, t.Add(max(p.Next, 0))
	j.LeaseUntil, j.UpdatedAt = time.Time{}, t
	return copyJob(j), nil
}

// SettleJob ends a live job once: its outcome, its usage events and (unresolved) its webhook
// event under one lock.
func (m *Ledger) SettleJob(ctx context.Context, id string, s job.Settlement) (job.Job, bool, error) {
	if err := job.CheckSettlement(s); err != nil {
		return job.Job{}, false, err
	}
	m.mu.Lock()
	j := m.jobByID(id)
	if j == nil {
		m.mu.Unlock()
		return job.Job{}, false, fmt.Errorf("%w: %q", job.ErrUnknownJob, id)
	}
	if !j.Live() {
		out := copyJob(j)
		m.mu.Unlock()
		return out, false, nil
	}
	t := jobNow()
	raw := job.Events(*j, s, t)
	evs := make([]ledger.UsageEvent, len(raw))
	for i, ev := range raw {
		var err error
		if evs[i], err = ledger.NormalizeEvent(ev); err != nil {
			m.mu.Unlock()
			return job.Job{}, false, fmt.Errorf("%w: %w", job.ErrInvalid, err)
		}
	}
	orgs := m.storeEvents(evs)
	j.Cost, j.Usage = job.Total(s)
	j.Status, j.Unresolved, j.Reason = s.Status, s.Unresolved, s.Reason
	j.SettledAt, j.UpdatedAt, j.LeaseOwner, j.LeaseUntil = &t, t, "", time.Time{}
	if s.Unresolved {
		m.hooks.emit(ledger.EventJobUnresolved, j.Org, json.RawMessage(mustJSON(job.UnresolvedData{Job: j.ID,
			Kind: j.Kind, UpstreamID: j.UpstreamID, Model: j.Model, Hold: j.Hold, Cost: j.Cost, Reason: j.Reason})))
	}
	out := copyJob(j)
	m.mu.Unlock()
	m.notify(orgs...)
	return out, true, nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("memledger: %v", err)) // a plain struct of strings and integers
	}
	return b
}
