// Package async runs escrow's jobs: work that bills after its HTTP request ends (DESIGN.md
// "Async work"): background responses, OpenAI batches, Anthropic message batches. The ledger
// side of a job (its row, its lease, settling it once) is package ledger/job; this package is
// the process side: recording a job, keeping its hold, polling the upstream until the job ends,
// settling it.
//
// # The job core
//
// A route that starts a job (the proxy's background responses, the batches) does, in order:
//
//  1. reserve the job's hold as for any request (the hold id is a UUIDv7 made by the server);
//  2. send the request upstream and read the upstream's id from its answer;
//  3. Poller.Begin(ctx, job): the job is recorded in the ledger (org, key, hold, upstream id,
//     prices in force, the estimate charged if the upstream loses it) and its hold pinned —
//     BEFORE the client learns the id. A Begin that fails leaves the hold with the route (the
//     proxy then bills the request at its hold, since the upstream does the work anyway).
//     From here on the hold's owner is the job, not the connection: the route stops keeping
//     the hold alive and neither records nor releases it.
//
// A kind's Upstream (registered with Poller.Handle) answers "where does this job stand?".
// The Poller, in every process, claims due jobs with a lease (job.Store.ClaimJobs: FOR UPDATE
// SKIP LOCKED, like river's producers), renews each claimed job's pin (so whichever process
// holds the lease keeps the hold), polls the upstream, and either records the poll (the lease
// is given back and the job is due again after a backoff: MinBackoff doubling to MaxBackoff)
// or settles the job. A process that crashes holding leases loses nothing: each lease runs out
// after Config.Lease and any Poller claims the job again. A job's hold is never released by a
// reaper while the job is live: the pin keeps it from expiring, and the reaper's ledger check
// (UnsettledUsage) reports the hold of a live job busy even if the pin ran out.
//
// Settling happens once, whichever path sees the end first: the Poller's poll, a client's
// GET that read a terminal object (Poller.Observe), a streamed completion (Poller.Settle).
// job.Store.SettleJob writes the job's usage events in the transaction that marks it settled;
// the accounting worker charges them and its settle gives the rest of the hold back. A job
// whose upstream no longer knows it (Observation.Gone) or that has not ended after
// Config.GiveUpAfter is charged its Estimate, flagged Unresolved, and announced by a
// job.unresolved webhook.
package async

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/internal/startstop"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/job"
)

// Holds is the hot balance as the job core uses it (balance.Store is one): Pin pushes a hold's
// expiry far out (renewed by the lease holder at each poll) and keeps it out of the org's
// in-flight count.
type Holds interface {
	Pin(ctx context.Context, org, holdID string) (bool, error)
}

// Upstream asks the upstream where a job of its kind stands. An error is transient (the job is
// polled again after a backoff); a job the upstream does not know is Observation.Gone.
type Upstream interface {
	Poll(ctx context.Context, j job.Job) (Observation, error)
}

// UpstreamFunc is an Upstream as a function.
type UpstreamFunc func(ctx context.Context, j job.Job) (Observation, error)

// Poll calls f.
func (f UpstreamFunc) Poll(ctx context.Context, j job.Job) (Observation, error) { return f(ctx, j) }

// Observation is where the upstream says a job stands.
type Observation struct {
	// Status: job.Pending or job.Running while it runs, else terminal.
	Status job.Status
	// Lines is what a terminal job billed (priced with the job's Prices); none: nothing.
	Lines []job.Line
	// Gone: the upstream does not know the job (404): it lost it. The job is settled as
	// unresolved, charged its Estimate.
	Gone bool
	// EndedAt is when the upstream says the job ended (zero: unknown), for the settle lag.
	EndedAt time.Time
	// Reason is a short note kept with the job (an upstream error code).
	Reason string
}

// Defaults of the Config fields left zero.
const (
	DefaultLease       = time.Minute
	DefaultInterval    = time.Second
	DefaultMinBackoff  = 2 * time.Second
	DefaultMaxBackoff  = time.Minute
	DefaultGiveUpAfter = 72 * time.Hour
	DefaultBatch       = 32
	DefaultWorkers     = 4
	DefaultPollTimeout = 30 * time.Second
)

// ErrConfig is wrapped by NewPoller's error for a configuration it cannot use.
var ErrConfig = errors.New("async: invalid config")

// Config configures a Poller. A nil *Config, and every zero field, means the documented default.
type Config struct {
	// Owner names this process in the jobs' leases. Default: host name, pid and a random suffix.
	Owner string
	// Lease is how long a claimed job is this process's; a process that dies holding it loses
	// it after that. Must exceed PollTimeout. Default 1m.
	Lease time.Duration
	// Interval is how often the Poller looks for due jobs (Kick looks at once). Default 1s.
	Interval time.Duration
	// MinBackoff and MaxBackoff bound the pause between two polls of a job: MinBackoff,
	// doubling with each poll up to MaxBackoff, ±10 % jitter. Defaults 2s and 1m.
	MinBackoff, MaxBackoff time.Duration
	// GiveUpAfter: a job not ended this long after it was recorded is lost (charged its
	// estimate, flagged, announced). Default 72h (a batch's window is 24h).
	GiveUpAfter time.Duration
	// Batch is the most jobs claimed at once; Workers how many are polled in parallel.
	// Defaults 32 and 4.
	Batch, Workers int
	// PollTimeout bounds one poll of the upstream. Default 30s.
	PollTimeout time.Duration
	// Now is the clock (tests). Default time.Now.
	Now func() time.Time
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

func (c *Config) withDefaults() Config {
	var z Config
	if c != nil {
		z = *c
	}
	if z.Owner == "" {
		host, _ := os.Hostname()
		z.Owner = fmt.Sprintf("%s-%d-%s", cmp.Or(host, "escrow"), os.Getpid(), ledger.RandomHex(4))
	}
	z.Lease = cmp.Or(z.Lease, DefaultLease)
	z.Interval = cmp.Or(z.Interval, DefaultInterval)
	z.MinBackoff = cmp.Or(z.MinBackoff, DefaultMinBackoff)
	z.MaxBackoff = cmp.Or(z.MaxBackoff, DefaultMaxBackoff)
	z.GiveUpAfter = cmp.Or(z.GiveUpAfter, DefaultGiveUpAfter)
	z.Batch = cmp.Or(z.Batch, DefaultBatch)
	z.Workers = cmp.Or(z.Workers, DefaultWorkers)
	z.PollTimeout = cmp.Or(z.PollTimeout, DefaultPollTimeout)
	if z.Now == nil {
		z.Now = time.Now
	}
	z.Logger = cmp.Or(z.Logger, slog.Default())
	return z
}

func (c *Config) validate() error {
	switch {
	case c.Lease < 0 || c.Interval < 0 || c.MinBackoff < 0 || c.MaxBackoff < 0 || c.GiveUpAfter < 0 || c.PollTimeout < 0:
		return fmt.Errorf("%w: negative duration", ErrConfig)
	case c.MinBackoff > c.MaxBackoff:
		return fmt.Errorf("%w: MinBackoff %v above MaxBackoff %v", ErrConfig, c.MinBackoff, c.MaxBackoff)
	case c.Lease <= c.PollTimeout:
		return fmt.Errorf("%w: Lease %v must exceed PollTimeout %v", ErrConfig, c.Lease, c.PollTimeout)
	case c.Batch < 1 || c.Workers < 1:
		return fmt.Errorf("%w: Batch and Workers must be positive", ErrConfig)
	}
	return nil
}

// Stats are a Poller's counters since it was made.
type Stats struct {
	Claimed    int64         // jobs claimed
	Polls      int64         // upstream polls
	PollErrors int64         // polls that failed (transient)
	Settled    int64         // jobs this process settled (any path)
	Unresolved int64         // of which unresolved (lost upstream)
	LagSum     time.Duration // Σ settle lag (the upstream's end, else the poll that saw it, to the settle)
	LagMax     time.Duration
}

// Poller claims, polls and settles jobs. Make it with NewPoller, register an Upstream per kind
// with Handle, then Start.
type Poller struct {
	jobs  job.Store
	holds Holds
	cfg   Config
	log   *slog.Logger

	mu        sync.Mutex
	upstreams map[job.Kind]Upstream
	kinds     []job.Kind

	kick chan struct{}
	run  startstop.Base

	claimed, polls, pollErrs, settled, unresolved atomic.Int64
	lagMu                                         sync.Mutex
	lagSum, lagMax                                time.Duration
}

// NewPoller makes a Poller over the ledger's jobs and the hot balance's holds.
func NewPoller(jobs job.Store, holds Holds, conf *Config) (*Poller, error) {
	if jobs == nil || holds == nil {
		return nil, fmt.Errorf("%w: a job store and holds are required", ErrConfig)
	}
	c := conf.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &Poller{jobs: jobs, holds: holds, cfg: c, log: c.Logger, upstreams: map[job.Kind]Upstream{},
		kick: make(chan struct{}, 1)}, nil
}

// Config returns the Poller's configuration with its defaults.
func (p *Poller) Config() Config { return p.cfg }

// Handle registers the Upstream of a kind; only kinds with one are claimed. Register before
// Start (a later one is claimed from the next pass on).
func (p *Poller) Handle(kind job.Kind, u Upstream) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.upstreams[kind]; !ok {
		p.kinds = append(p.kinds, kind)
	}
	p.upstreams[kind] = u
}

// Jobs is the ledger's job store the Poller works on.
func (p *Poller) Jobs() job.Store { return p.jobs }

// Begin records a new job and pins its hold (see the package doc): call it before the client
// learns the job's id. An error means the job may not be recorded: the caller still owns the
// hold (release it, and cancel the upstream work if it can). A pin that fails is only logged:
// the reaper's ledger check protects a live job's hold, and the next poll pins again.
func (p *Poller) Begin(ctx context.Context, j job.Job) (job.Job, error) {
	stored, _, err := p.jobs.CreateJob(ctx, j)
	if err != nil {
		return stored, fmt.Errorf("async: record job: %w", err)
	}
	p.pin(ctx, stored)
	p.Kick()
	return stored, nil
}

// Kick makes the Poller look for due jobs now.
func (p *Poller) Kick() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Observe reports what a path other than the Poller (a client's GET, a stream) read from the
// upstream about a job: a terminal observation settles it (once: a job settled already is
// returned as it is, first = false); a live one changes nothing.
func (p *Poller) Observe(ctx context.Context, j job.Job, o Observation) (job.Job, bool, error) {
	switch {
	case o.Gone:
		return p.lost(ctx, j, cmp.Or(o.Reason, "not found upstream"))
	case !o.Status.Terminal():
		return j, false, nil
	}
	return p.Settle(ctx, j, job.Settlement{Status: o.Status, Lines: o.Lines, Reason: o.Reason}, o.EndedAt)
}

// Settle settles a job once (job.Store.SettleJob) and counts it. endedAt is when the upstream
// says it ended (zero: now), for the settle lag.
func (p *Poller) Settle(ctx context.Context, j job.Job, s job.Settlement, endedAt time.Time) (job.Job, bool, error) {
	if !j.Live() {
		return j, false, nil
	}
	got, first, err := p.jobs.SettleJob(ctx, j.ID, s)
	if err != nil {
		return got, false, fmt.Errorf("async: settle job %s: %w", j.ID, err)
	}
	if first {
		p.settled.Add(1)
		if got.Unresolved {
			p.unresolved.Add(1)
			p.log.Warn("async: job unresolved: charged its estimate", "job", got.ID, "kind", got.Kind,
				"org", got.Org, "upstream_id", got.UpstreamID, "cost", got.Cost, "reason", got.Reason)
		}
		if !endedAt.IsZero() && got.SettledAt != nil {
			lag := max(got.SettledAt.Sub(endedAt), 0)
			p.lagMu.Lock()
			p.lagSum += lag
			p.lagMax = max(p.lagMax, lag)
			p.lagMu.Unlock()
		}
	}
	return got, first, nil
}

// lost settles a job the upstream lost: charged its estimate, flagged, announced.
func (p *Poller) lost(ctx context.Context, j job.Job, reason string) (job.Job, bool, error) {
	var lines []job.Line
	if j.Estimate > 0 {
		lines = []job.Line{{Cost: j.Estimate, Estimated: true}}
	}
	return p.Settle(ctx, j, job.Settlement{Status: job.Lost, Lines: lines, Unresolved: true, Reason: reason}, time.Time{})
}

// Stats returns the Poller's counters.
func (p *Poller) Stats() Stats {
	p.lagMu.Lock()
	defer p.lagMu.Unlock()
	return Stats{Claimed: p.claimed.Load(), Polls: p.polls.Load(), PollErrors: p.pollErrs.Load(),
		Settled: p.settled.Load(), Unresolved: p.unresolved.Load(), LagSum: p.lagSum, LagMax: p.lagMax}
}

// Start starts the claim loop.
func (p *Poller) Start(ctx context.Context) error {
	ctx, ok := p.run.Start(ctx)
	if !ok {
		return nil
	}
	p.run.Go(func() { p.loop(ctx) })
	return nil
}

// Stop stops the loop and waits for the polls in flight (or ctx). Leases it holds are not
// given back: they run out after Config.Lease and any process claims the jobs again.
func (p *Poller) Stop(ctx context.Context) error {
	_, err := p.run.Stop(ctx)
	return err
}

func (p *Poller) loop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
		full := p.Pass(ctx)
		wait := p.cfg.Interval
		if full {
			wait = 0 // a full claim: there may be more due
		}
		t.Reset(wait)
	}
}

// Pass claims up to Batch due jobs and polls them (Workers at a time), and reports whether
// it claimed a full batch. The claim loop calls it; tests may call it directly.
func (p *Poller) Pass(ctx context.Context) bool {
	p.mu.Lock()
	kinds := append([]job.Kind(nil), p.kinds...)
	p.mu.Unlock()
	if len(kinds) == 0 {
		return false
	}
	jobs, err := p.jobs.ClaimJobs(ctx, p.cfg.Owner, kinds, p.cfg.Lease, p.cfg.Batch)
	if err != nil {
		if ctx.Err() == nil {
			p.log.Warn("async: claim jobs", "err", err)
		}
		return false
	}
	p.claimed.Add(int64(len(jobs)))
	sem := make(chan struct{}, p.cfg.Workers)
	var wg sync.WaitGroup
	for _, j := range jobs {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			p.poll(ctx, j)
		}()
	}
	wg.Wait()
	return len(jobs) == p.cfg.Batch
}

// poll handles one claimed job.
func (p *Poller) poll(ctx context.Context, j job.Job) {
	p.pin(ctx, j)
	if p.cfg.Now().Sub(j.CreatedAt) > p.cfg.GiveUpAfter {
		if _, _, err := p.lost(ctx, j, fmt.Sprintf("not ended %v after it was recorded", p.cfg.GiveUpAfter)); err != nil {
			p.log.Warn("async: give up job", "job", j.ID, "err", err)
		}
		return
	}
	p.mu.Lock()
	up := p.upstreams[j.Kind]
	p.mu.Unlock()
	pctx, cancel := context.WithTimeout(ctx, p.cfg.PollTimeout)
	o, err := up.Poll(pctx, j)
	cancel()
	p.polls.Add(1)
	if err != nil {
		if ctx.Err() != nil {
			return // stopping: the lease runs out
		}
		p.pollErrs.Add(1)
		p.log.Info("async: poll failed; will retry", "job", j.ID, "kind", j.Kind, "err", err)
		p.record(ctx, j, j.Status)
		return
	}
	if o.Gone || o.Status.Terminal() {
		if _, _, err := p.Observe(ctx, j, o); err != nil {
			p.log.Warn("async: settle job", "job", j.ID, "err", err)
		}
		return
	}
	p.record(ctx, j, o.Status)
}

// record notes a poll of a live job and gives its lease back.
func (p *Poller) record(ctx context.Context, j job.Job, st job.Status) {
	if st != job.Running {
		st = job.Pending
	}
	_, err := p.jobs.RecordPoll(ctx, j.ID, p.cfg.Owner, job.Progress{Status: st, Next: p.Backoff(j.Attempts)})
	if err != nil && !errors.Is(err, job.ErrLeaseLost) && ctx.Err() == nil {
		p.log.Warn("async: record poll", "job", j.ID, "err", err)
	}
}

// Backoff is the pause before the next poll of a job polled attempts times: MinBackoff
// doubling up to MaxBackoff, ±10 % jitter.
func (p *Poller) Backoff(attempts int) time.Duration {
	d := p.cfg.MinBackoff
	for i := 0; i < attempts && d < p.cfg.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, p.cfg.MaxBackoff)
	if d <= 0 {
		return 0
	}
	return d - d/10 + rand.N(d/5+1)
}

// pin keeps the job's hold from expiring while the job is live (renewed at every poll).
func (p *Poller) pin(ctx context.Context, j job.Job) {
	if _, err := p.holds.Pin(ctx, j.Org, j.ID); err != nil && ctx.Err() == nil {
		p.log.Warn("async: pin job hold (the ledger check still protects it)", "job", j.ID, "org", j.Org, "err", err)
	}
}
