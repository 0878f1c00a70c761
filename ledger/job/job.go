// Package job is the ledger's role for work that bills after its HTTP request ends (DESIGN.md
// "Async work"): background responses, OpenAI batches, Anthropic message batches. A job is
// recorded — org, key, hold, upstream id, prices in force — before the client learns its id; a
// poller (package async) claims it with a lease, asks the upstream where it stands, and settles
// it once. memledger and pgledger implement Store and pass the same conformance suite
// (ledgertest).
//
// # The rules a Store keeps
//
//   - A job's ID is its hold's id (a UUID made by the server, like every hold id). The job's
//     hold lives in the hot balance like any other; its owner is the job, not a connection.
//   - A job is live until it is settled. While it is live, UnsettledUsage (the reaper's ledger
//     check) reports its hold busy, so no reaper releases it, whoever holds the lease and
//     however long ago the hold was extended: the same rule as a pinned hold.
//   - ClaimJobs hands a live job that is due to one owner at a time (a lease, taken with FOR
//     UPDATE SKIP LOCKED); a lease that ran out (its owner crashed) can be claimed again.
//   - SettleJob settles a job exactly once, whichever path sees its end first (the poller, the
//     client's GET, a streamed completion): in one transaction it stores the outcome, writes the
//     usage events of its Lines (the job's own event, whose ID is the job's, gives its hold back
//     when the worker settles it) and, for an unresolved job, the job.unresolved webhook event.
//     Later calls change nothing and return the stored job with first = false.
package job

import (
	"cmp"
	"context"
	"crypto/sha1"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// Kind is what a job is.
type Kind string

// The kinds of job.
const (
	BackgroundResponse Kind = "background_response" // POST /v1/responses with background: true
	OpenAIBatch        Kind = "openai_batch"        // POST /v1/batches
	AnthropicBatch     Kind = "anthropic_batch"     // POST /v1/messages/batches
)

// Kinds lists every kind.
var Kinds = []Kind{BackgroundResponse, OpenAIBatch, AnthropicBatch}

// Status is where a job stands upstream, as escrow last saw it.
type Status string

// Job statuses. Pending and Running are live; the others are terminal, and a job reaches one
// only through SettleJob.
const (
	Pending    Status = "pending"    // recorded; the upstream has it queued (or has not said more)
	Running    Status = "running"    // the upstream is working on it
	Completed  Status = "completed"  // ended with a result
	Incomplete Status = "incomplete" // ended early (a cap reached), usage billed
	Failed     Status = "failed"     // ended with an error (usage billed if any)
	Cancelled  Status = "cancelled"  // cancelled (usage billed if any)
	Expired    Status = "expired"    // a batch whose window ran out (lines done are billed)
	Lost       Status = "lost"       // the upstream lost it: charged by the estimate, Unresolved
)

// Terminal reports whether s is an end state.
func (s Status) Terminal() bool {
	switch s {
	case Completed, Incomplete, Failed, Cancelled, Expired, Lost:
		return true
	}
	return false
}

// Valid reports whether s is one of the statuses.
func (s Status) Valid() bool { return s == Pending || s == Running || s.Terminal() }

// Job is one piece of async work.
type Job struct {
	ID         string `json:"id"` // the hold's id (UUID); also the id of the job's own usage event
	Kind       Kind   `json:"kind"`
	Org        string `json:"org"`
	KeyID      string `json:"key_id,omitempty"`
	Project    string `json:"project,omitempty"`
	EndUser    string `json:"end_user,omitempty"`
	Model      string `json:"model"`              // the job's model (a batch: its lines' model; a Line may name its own)
	Endpoint   string `json:"endpoint,omitempty"` // the endpoint its usage is billed under (a Line may name its own)
	UpstreamID string `json:"upstream_id"`        // the upstream's id (resp_…, batch_…, msgbatch_…); unique per kind
	// Hold is the amount held for the job; ReservedAt the Redis clock at reserve (its limit
	// attribution, like a request's).
	Hold       int64     `json:"hold"`
	ReservedAt time.Time `json:"reserved_at,omitzero"`
	// Estimate is what the job is charged when the upstream loses its result (the estimate
	// rule: at least the input's cost), ≤ Hold.
	Estimate int64          `json:"estimate"`
	Prices   pricing.Prices `json:"prices"` // the prices in force when the hold was taken
	// Data is the kind's own state (a batch's input file, line count…), opaque to the store.
	Data json.RawMessage `json:"data,omitempty"`

	Status     Status    `json:"status"`
	Attempts   int       `json:"attempts"` // polls recorded
	LeaseOwner string    `json:"lease_owner,omitempty"`
	LeaseUntil time.Time `json:"lease_until,omitzero"`
	NextPollAt time.Time `json:"next_poll_at"`

	// The outcome, once settled.
	Usage      pricing.Usage `json:"usage"`
	Cost       int64         `json:"cost"`
	Unresolved bool          `json:"unresolved,omitempty"` // charged by the estimate: the upstream lost it
	Reason     string        `json:"reason,omitempty"`
	SettledAt  *time.Time    `json:"settled_at,omitempty"`

	CreatedAt time.Time `json:"created_at"`
	UpdatedAt time.Time `json:"updated_at"`
}

// Live reports whether the job still holds its hold (not settled).
func (j Job) Live() bool { return j.SettledAt == nil }

// Line is one billed unit of a job's outcome: the whole of a background response, or one line
// of a batch (CustomID kept).
type Line struct {
	CustomID  string        `json:"custom_id,omitempty"`
	Model     string        `json:"model,omitempty"` // "" is the job's model
	Endpoint  string        `json:"endpoint,omitempty"`
	Usage     pricing.Usage `json:"usage"`
	Cost      int64         `json:"cost"`
	Estimated bool          `json:"estimated,omitempty"`
}

// Settlement is how a job ended.
type Settlement struct {
	Status     Status // terminal
	Lines      []Line // what it billed; none: nothing (the whole hold comes back)
	Unresolved bool   // the upstream lost the result: charged by the estimate, announced
	Reason     string // a short note (an error, why it is unresolved)
}

// Progress is what the lease holder learned from one poll of a live job.
type Progress struct {
	Status Status        // Pending or Running
	Next   time.Duration // poll again after this long (from the store's now)
}

// Query selects jobs for a listing.
type Query struct {
	Org   string // "" for every org
	Kind  Kind   // "" for every kind
	Live  bool   // only jobs not settled
	Limit int    // ≤ 0: 100; at most 1000
}

// Store is the ledger side of jobs. Times are the store's clock (Postgres now()).
type Store interface {
	// CreateJob records a job (ErrInvalid, ledger.ErrUnknownOrg). Recording the same ID again
	// with the same kind and upstream id returns the stored job (created false); another job
	// with that ID, or another ID with that kind and upstream id, is ErrConflict. The job
	// starts Pending, due at once (NextPollAt zero) unless NextPollAt says later.
	CreateJob(ctx context.Context, j Job) (stored Job, created bool, err error)
	// Job returns a job by ID (ErrUnknownJob).
	Job(ctx context.Context, id string) (Job, error)
	// JobByUpstream returns the job of kind with the upstream's id (ErrUnknownJob).
	JobByUpstream(ctx context.Context, kind Kind, upstreamID string) (Job, error)
	// Jobs lists jobs, newest first.
	Jobs(ctx context.Context, q Query) ([]Job, error)
	// LiveJobs counts the live jobs per kind.
	LiveJobs(ctx context.Context) (map[Kind]int, error)

	// ClaimJobs leases up to limit live jobs of the kinds given (none: every kind) that are
	// due (NextPollAt ≤ now) and whose lease is free or ran out, oldest due first, to owner
	// until now+lease, skipping rows another claimer has locked. Claiming never waits.
	ClaimJobs(ctx context.Context, owner string, kinds []Kind, lease time.Duration, limit int) ([]Job, error)
	// RecordPoll is the lease holder's note of a poll: status, attempts+1, NextPollAt =
	// now+p.Next, and the lease given back. ErrLeaseLost when owner no longer holds the job's
	// lease (another owner claimed it after it ran out) or the job is settled; ErrUnknownJob.
	RecordPoll(ctx context.Context, id, owner string, p Progress) (Job, error)
	// SettleJob ends a live job, exactly once (see the package doc): first reports whether
	// this call did. ErrUnknownJob, ErrInvalid (a status that is not terminal, a line's cost
	// outside the amount range).
	SettleJob(ctx context.Context, id string, s Settlement) (stored Job, first bool, err error)
}

// Sentinel errors of Store.
var (
	ErrUnknownJob = errors.New("job: unknown job")
	ErrInvalid    = errors.New("job: invalid job")
	ErrConflict   = errors.New("job: job id or upstream id already used")
	ErrLeaseLost  = errors.New("job: lease lost")
)

// Check validates a job to be created and returns it normalized (canonical UUID, Pending).
func Check(j Job) (Job, error) {
	bad := func(format string, args ...any) (Job, error) {
		return j, fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
	}
	id, err := uuid.Parse(j.ID)
	if err != nil {
		return bad("id %q is not a UUID", j.ID)
	}
	j.ID = id.String()
	if err := balance.ValidateOrg(j.Org); err != nil {
		return j, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	switch {
	case !validKind(j.Kind):
		return bad("unknown kind %q", j.Kind)
	case j.UpstreamID == "" || len(j.UpstreamID) > 256:
		return bad("upstream id must be 1-256 bytes")
	case j.Model == "":
		return bad("no model")
	case j.Hold < 0 || j.Hold > balance.MaxAmount:
		return bad("hold %d outside [0, %d]", j.Hold, balance.MaxAmount)
	case j.Estimate < 0 || j.Estimate > j.Hold:
		return bad("estimate %d outside [0, hold %d]", j.Estimate, j.Hold)
	}
	if err := j.Prices.Check(); err != nil {
		return j, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(j.Data) > 0 && !json.Valid(j.Data) {
		return bad("data is not JSON")
	}
	j.Status = Pending
	if !j.ReservedAt.IsZero() {
		j.ReservedAt = j.ReservedAt.Round(0).Truncate(time.Millisecond).UTC()
	}
	return j, nil
}

func validKind(k Kind) bool {
	for _, x := range Kinds {
		if k == x {
			return true
		}
	}
	return false
}

// Same reports whether a stored job and a job created again are the same job (CreateJob's
// idempotency).
func Same(stored, again Job) bool {
	return stored.ID == again.ID && stored.Kind == again.Kind && stored.UpstreamID == again.UpstreamID && stored.Org == again.Org
}

// CheckSettlement validates a settlement.
func CheckSettlement(s Settlement) error {
	if !s.Status.Terminal() {
		return fmt.Errorf("%w: settle with status %q (not terminal)", ErrInvalid, s.Status)
	}
	for _, l := range s.Lines {
		if l.Cost < 0 || l.Cost > balance.MaxAmount {
			return fmt.Errorf("%w: line cost %d outside [0, %d]", ErrInvalid, l.Cost, balance.MaxAmount)
		}
		if err := l.Usage.Check(); err != nil {
			return fmt.Errorf("%w: %w", ErrInvalid, err)
		}
	}
	return nil
}

// Events are the usage events a settlement writes, at now. A single line with no custom id is
// the job's own event (ID = the job's ID), so its settle gives the hold back and charges the
// line. Otherwise each line is an event whose ID is derived from the job's and the line's
// custom id (a UUIDv5: the same line always gets the same id, so writing it twice charges
// once), and a closing event with the job's ID and cost 0 gives the hold back.
func Events(j Job, s Settlement, now time.Time) []ledger.UsageEvent {
	ev := func(id string, l Line) ledger.UsageEvent {
		return ledger.UsageEvent{ID: id, Org: j.Org, KeyID: j.KeyID, Project: j.Project, ReservedAt: j.ReservedAt,
			EndUser: j.EndUser, Model: cmp.Or(l.Model, j.Model), Endpoint: cmp.Or(l.Endpoint, j.Endpoint), Usage: l.Usage,
			Cost: l.Cost, HoldAmount: 0, Estimated: l.Estimated, CreatedAt: now}
	}
	if len(s.Lines) == 1 && s.Lines[0].CustomID == "" {
		e := ev(j.ID, s.Lines[0])
		e.HoldAmount = j.Hold
		return []ledger.UsageEvent{e}
	}
	out := make([]ledger.UsageEvent, 0, len(s.Lines)+1)
	base := uuid.MustParse(j.ID)
	for i, l := range s.Lines {
		name := l.CustomID
		if name == "" {
			name = fmt.Sprintf("#%d", i)
		}
		out = append(out, ev(uuid.NewHash(sha1.New(), base, []byte(name), 5).String(), l))
	}
	closing := ev(j.ID, Line{})
	closing.HoldAmount = j.Hold
	return append(out, closing)
}

// Total is the settlement's cost: the sum of its lines.
func Total(s Settlement) (cost int64, usage pricing.Usage) {
	for _, l := range s.Lines {
		cost += l.Cost
		usage.Prompt += l.Usage.Prompt
		usage.Completion += l.Usage.Completion
		usage.Reasoning += l.Usage.Reasoning
		for c, n := range l.Usage.Units {
			usage = usage.With(c, usage.Of(c)+n)
		}
	}
	return cost, usage
}

// UnresolvedData is a job.unresolved webhook event's data.
type UnresolvedData struct {
	Job        string `json:"job"`
	Kind       Kind   `json:"kind"`
	UpstreamID string `json:"upstream_id"`
	Model      string `json:"model"`
	Hold       int64  `json:"hold"`
	Cost       int64  `json:"cost"`
	Reason     string `json:"reason,omitempty"`
}

// Bounded is q's limit with its default (100) and bound (1000) applied.
func (q Query) Bounded() int {
	switch {
	case q.Limit <= 0:
		return 100
	case q.Limit > 1000:
		return 1000
	}
	return q.Limit
}
