package accounting

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/startstop"
	"github.com/llmescrow/escrow/ledger"
)

// WorkerConfig configures a Worker. The zero value of every field means its documented default;
// a negative value is refused (ErrConfig).
type WorkerConfig struct {
	// AccountBatch is how many pending usage events one accounting pass claims (a pass claims
	// again while a batch comes back full). Default 5000: with a backlog each batch costs the same
	// few round trips whatever its size, so larger batches account faster (make bench's pipeline:
	// about 26,000 events/s at 1000, 35,000–38,000 at 5000 and at 10,000); the orgs' account rows
	// stay locked for the batch's transaction (a seed or a credit of one of them waits for it).
	// The ledger caps it at 10,000.
	AccountBatch int
	// SettleBatch is how many entries of one org one settle call applies. Default 500.
	SettleBatch int
	// SweepInterval is how often the worker looks for unsettled orgs without being notified.
	// Default 2s.
	SweepInterval time.Duration
	// ReapInterval is how often the holds of the orgs this process put holds on are reaped.
	// Default 5s.
	ReapInterval time.Duration
	// ScanInterval is how often a rate-limited SCAN looks for expired holds of dead processes.
	// Default 1m.
	ScanInterval time.Duration
	// ReconcileInterval is how often every warm org is checked against the ledger. Default 1m.
	ReconcileInterval time.Duration
	// OrgTimeout bounds the background work on one org (one settle, reap or reconcile of it), so
	// a Redis that drops replies stalls one org for this long, not the whole loop. It needs a
	// Redis client that honours context deadlines (go-redis: ContextTimeoutEnabled). Default 10s.
	OrgTimeout time.Duration
	// SettleConcurrency is how many orgs are settled at once when they need one settle each (a
	// cold org to seed, a gap to heal, a Redis error); the others of a pass are settled together
	// (one ledger read, one Redis pipeline, one ledger write). Each org's entries stay in order.
	// Default 8.
	SettleConcurrency int
	// PassInterval is the least time between the starts of two accounting passes: a pass woken
	// sooner waits for the rest of it, while notifications gather, so one pass (a few round trips
	// to Postgres and one to Redis) covers the usage of many requests. Lower means a shorter
	// settle lag and more passes; the unused part of a hold is already returned when the usage
	// is recorded, so the lag ties up no money a request could use. Credits and adjusts settle at
	// once regardless (Credit settles the org itself). Default 20ms.
	PassInterval time.Duration
	// Charged, when set, is told the orgs each accounting pass charged, once the pass has
	// written their entries (in the worker's goroutine: it must not block). Auto top-up
	// (package payment) looks at those orgs' balances from it, off the request path. Default nil.
	Charged func(orgs []string)
	// GrantGrace is how long after a grant's expiry its expire entry is written (on the sweep):
	// the hot balance takes the rest out at the expiry itself, and requests reserved before it
	// are charged to it meanwhile (docs/grants.md). Default 2m.
	GrantGrace time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// The Worker's defaults, used for the zero value of the WorkerConfig field they name.
const (
	defaultWorkerAccountBatch      = 5000
	defaultWorkerSettleBatch       = 500
	defaultWorkerSweepInterval     = 2 * time.Second
	defaultWorkerReapInterval      = 5 * time.Second
	defaultWorkerScanInterval      = time.Minute
	defaultWorkerReconcileInterval = time.Minute
	defaultWorkerOrgTimeout        = 10 * time.Second
	defaultWorkerSettleConcurrency = 8
	defaultWorkerPassInterval      = 20 * time.Millisecond
)

// withDefaults returns the config with every zero field set to its default; c may be nil.
func (c *WorkerConfig) withDefaults() WorkerConfig {
	var z WorkerConfig
	if c != nil {
		z = *c
	}
	z.AccountBatch = cmp.Or(z.AccountBatch, defaultWorkerAccountBatch)
	z.SettleBatch = cmp.Or(z.SettleBatch, defaultWorkerSettleBatch)
	z.SweepInterval = cmp.Or(z.SweepInterval, defaultWorkerSweepInterval)
	z.ReapInterval = cmp.Or(z.ReapInterval, defaultWorkerReapInterval)
	z.ScanInterval = cmp.Or(z.ScanInterval, defaultWorkerScanInterval)
	z.ReconcileInterval = cmp.Or(z.ReconcileInterval, defaultWorkerReconcileInterval)
	z.OrgTimeout = cmp.Or(z.OrgTimeout, defaultWorkerOrgTimeout)
	z.SettleConcurrency = cmp.Or(z.SettleConcurrency, defaultWorkerSettleConcurrency)
	z.PassInterval = cmp.Or(z.PassInterval, defaultWorkerPassInterval)
	z.GrantGrace = cmp.Or(z.GrantGrace, defaultGrantGrace)
	z.Logger = cmp.Or(z.Logger, slog.Default())
	return z
}

// validate refuses a config (after withDefaults) with a negative batch, concurrency or
// duration.
func (c *WorkerConfig) validate() error {
	switch {
	case c.AccountBatch < 0 || c.SettleBatch < 0 || c.SettleConcurrency < 0:
		return fmt.Errorf("%w: worker AccountBatch, SettleBatch and SettleConcurrency must be ≥ 0", ledger.ErrConfig)
	case c.SweepInterval < 0 || c.ReapInterval < 0 || c.ScanInterval < 0 || c.ReconcileInterval < 0 || c.OrgTimeout < 0 || c.PassInterval < 0 || c.GrantGrace < 0:
		return fmt.Errorf("%w: worker intervals and OrgTimeout must be ≥ 0", ledger.ErrConfig)
	}
	return nil
}

// WorkerStats are the worker's running totals, for metrics.
type WorkerStats struct {
	Accounted      int64 // usage events turned into ledger entries
	Settled        int64 // entries applied to (or confirmed in) the hot balance
	Seeds          int64 // cold orgs seeded by the worker
	Gaps           int64 // gaps healed by re-sending entries
	Reaped         int64 // expired holds released
	DriftRepairs   int64 // hot balances dropped by the reconciler
	Errors         int64 // failed passes (Redis or ledger trouble)
	LastDrift      int64 // the last drift found, micro-units (0 = none)
	LastBatchSize  int64 // events accounted by the last pass
	PendingBacklog int64 // orgs waiting to be settled after the last sweep
	GrantsExpired  int64 // expire entries written (docs/grants.md)
	GrantsWaiting  int64 // expiry passes of an org put off by holds reserved before the expiry
}

// Worker accounts pending usage, settles ledger entries into the hot balance, reaps holds of dead
// processes and reconciles warm orgs. Several workers (in one process or many) may run at once:
// accounting takes a per-org advisory lock, and settling is safe to repeat and to interleave
// because the settle script refuses entries out of order.
type Worker struct {
	ledger ledger.Ledger
	store  *balance.Store
	cfg    WorkerConfig
	log    *slog.Logger

	wake  chan struct{}
	mu    sync.Mutex
	dirty map[string]struct{}

	stats struct {
		accounted, settled, seeds, gaps, reaped, repairs, errors, lastDrift, lastBatch, backlog atomic.Int64
		grantsExpired, grantsWaiting                                                            atomic.Int64 // grants.go
	}
	lag lagHistogram

	run startstop.Base

	badOrgs sync.Map // org ids of old rows that break the org-id rule, logged once each

}

// NewWorker returns a worker over l and store; cfg may be nil for the defaults. A config
// field out of range is refused with an error wrapping ErrConfig.
func NewWorker(l ledger.Ledger, store *balance.Store, cfg *WorkerConfig) (*Worker, error) {
	if l == nil || store == nil {
		return nil, fmt.Errorf("%w: worker needs a ledger and a store", ledger.ErrConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &Worker{
		ledger: l,
		store:  store,
		cfg:    c,
		log:    c.Logger.With("component", "escrow.worker"),
		wake:   make(chan struct{}, 1),
		dirty:  make(map[string]struct{}),
	}, nil
}

// Stats returns the worker's running totals.
func (w *Worker) Stats() WorkerStats {
	s := &w.stats
	return WorkerStats{
		Accounted: s.accounted.Load(), Settled: s.settled.Load(), Seeds: s.seeds.Load(),
		Gaps: s.gaps.Load(), Reaped: s.reaped.Load(), DriftRepairs: s.repairs.Load(),
		Errors: s.errors.Load(), LastDrift: s.lastDrift.Load(), LastBatchSize: s.lastBatch.Load(),
		PendingBacklog: s.backlog.Load(), GrantsExpired: s.grantsExpired.Load(), GrantsWaiting: s.grantsWaiting.Load(),
	}
}

// Start runs the worker's loops until Stop, or until ctx ends (then the loops end without the
// last pass: call Stop for it). It returns at once. A second Start, or a Start after Stop,
// starts nothing.
func (w *Worker) Start(ctx context.Context) error {
	ctx, ok := w.run.Start(ctx)
	if !ok {
		return nil
	}
	notes, err := w.ledger.Subscribe(ctx)
	if err != nil {
		w.log.Warn("no ledger notifications; settling on the sweep only", "err", err)
		notes = nil
	}
	w.run.Go(func() { w.listen(ctx, notes) })
	w.run.Go(func() { w.settleLoop(ctx) })
	w.run.Go(func() { w.maintenanceLoop(ctx) })
	return nil
}

// Stop ends the loops and then makes a last accounting and settle pass, unless ctx ends first.
// Stop before Start does nothing; only the first Stop of a started worker makes the last pass
// (the others wait for the loops).
func (w *Worker) Stop(ctx context.Context) error {
	first, err := w.run.Stop(ctx)
	if err != nil || !first {
		return err
	}
	// Flush: what was recorded before Stop is accounted and settled before it returns.
	if err := w.Drain(ctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// Notify marks org as having new ledger entries and wakes the settle loop.
func (w *Worker) Notify(org string) {
	w.mu.Lock()
	w.dirty[org] = struct{}{}
	w.mu.Unlock()
	w.Wake()
}

// Wake wakes the settle loop for a pass, marking no org dirty: the pass accounts the pending
// usage and settles the orgs it charged. It is RecorderConfig.Wake for a recorder in the same
// process, whose batches then send no NOTIFY. It never blocks, and wake-ups do not add up: the
// pass starts no sooner than PassInterval after the previous one, and covers them all.
func (w *Worker) Wake() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *Worker) listen(ctx context.Context, notes <-chan string) {
	if notes == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case org, ok := <-notes:
			if !ok {
				return
			}
			w.Notify(org)
		}
	}
}

func (w *Worker) settleLoop(ctx context.Context) {
	sweep := time.NewTicker(w.cfg.SweepInterval)
	defer sweep.Stop()
	var last time.Time // when the last pass began
	for {
		full := false
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case <-sweep.C:
			full = true
			if _, err := w.ExpireGrants(ctx); err != nil && ctx.Err() == nil {
				w.log.Warn("grant expiry failed", "err", err)
			}
		}
		if !w.paced(ctx, last) {
			return
		}
		last = time.Now()
		if err := w.pass(ctx, full); err != nil && ctx.Err() == nil {
			w.stats.errors.Add(1)
			w.log.Warn("settle pass failed", "err", err)
		}
	}
}

// paced waits until PassInterval has passed since last (the start of the previous pass), while
// notifications gather in the dirty set; the wake-ups that came meanwhile are covered by the
// pass that follows. false: ctx ended.
func (w *Worker) paced(ctx context.Context, last time.Time) bool {
	wait := w.cfg.PassInterval - time.Since(last)
	if last.IsZero() || wait <= 0 {
		return true
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	}
	select { // the pass reads the dirty set after this: it covers that wake-up
	case <-w.wake:
	default:
	}
	return true
}

// pass accounts pending usage and settles the orgs that got entries or are dirty (and, on a
// sweep, every org the ledger says is behind). The orgs the account pass handed entries over
// for (AccountResult.Settle: they were fully settled before it) are settled from those entries;
// only the others are read back from the ledger.
func (w *Worker) pass(ctx context.Context, sweep bool) error {
	var errs []error
	// Taken before the account pass: these marks come from writes committed before it locked
	// any account, so an org it hands over has them among its settled entries.
	before := w.takeDirty()
	r, err := w.account(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	after := w.takeDirty()
	var behind []string
	if sweep {
		behind, err = w.ledger.OrgsToSettle(ctx, 10000)
		if err != nil {
			errs = append(errs, err)
		}
		w.stats.backlog.Store(int64(len(behind)))
	}
	read := w.toRead(r, before, after, behind)
	if err := w.settleOrgs(ctx, read, &handover{entries: r.Settle, epoch: r.Epoch}, true); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// takeDirty empties the dirty set and returns its orgs.
func (w *Worker) takeDirty() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	orgs := make([]string, 0, len(w.dirty))
	for o := range w.dirty {
		orgs = append(orgs, o)
	}
	clear(w.dirty)
	return orgs
}

// toRead returns the orgs a pass reads back: those it charged that were behind, the dirty ones
// and the sweep's, except the orgs r hands over. A mark taken before the account pass is
// covered by the hand-over. A mark taken after it, or a sweep (read after it), on a handed-over
// org may be a write that landed after the pass's lock (or the pass's own NOTIFY, from a ledger
// that cannot tell its own: pgledger.New): that org stays dirty for the next pass, which reads
// it back (cheaply: it is settled by then) unless it hands the org over again, which covers the
// write.
func (w *Worker) toRead(r ledger.AccountResult, before, after, behind []string) []string {
	read := make([]string, 0, len(before)+len(r.Orgs)+len(after)+len(behind))
	var carry []string
	for _, o := range append(before, r.Orgs...) {
		if _, ok := r.Settle[o]; !ok {
			read = append(read, o)
		}
	}
	for _, o := range append(after, behind...) {
		if _, ok := r.Settle[o]; ok {
			carry = append(carry, o)
		} else {
			read = append(read, o)
		}
	}
	if len(carry) > 0 {
		w.redirty(carry)
	}
	return read
}

// AccountAll accounts pending usage events until none is left (or only those of orgs locked by
// another worker), and raises the learned max cost of the models whose real costs beat it. It
// returns how many it accounted.
func (w *Worker) AccountAll(ctx context.Context) (int, error) {
	r, err := w.account(ctx)
	return r.Accounted, err
}

func (w *Worker) account(ctx context.Context) (ledger.AccountResult, error) {
	var total ledger.AccountResult
	var err error
	for {
		var r ledger.AccountResult
		r, err = w.ledger.AccountPass(ctx, w.cfg.AccountBatch)
		total.Merge(r)
		w.stats.accounted.Add(int64(r.Accounted))
		if r.Accounted > 0 {
			w.stats.lastBatch.Store(int64(r.Accounted))
		}
		if err != nil || r.Accounted < w.cfg.AccountBatch {
			break
		}
	}
	if len(total.MaxCost) > 0 {
		w.raiseMax(ctx, total.MaxCost)
	}
	if w.cfg.Charged != nil && len(total.Orgs) > 0 {
		w.cfg.Charged(total.Orgs)
	}
	return total, err
}

// raiseMax raises the learned max cost of each model of costs (the highest real cost of one
// choice the pass accounted) where it beats it, in Redis (which the next holds read) and in the
// ledger (which outlives Redis), capped at the model's bound (Model.CostBound). Raising is
// monotonic, so workers racing on it are harmless; trouble is logged and never fails the pass
// (a later cost raises it again).
func (w *Worker) raiseMax(ctx context.Context, costs map[string]int64) {
	for model, cost := range costs {
		// The store's in-process cache of the learned max (refreshed by RaiseModelMax) answers
		// most passes without a round trip.
		hot, err := w.store.ModelMax(ctx, model)
		if err == nil && cost <= hot {
			continue
		}
		m, err := w.ledger.Model(ctx, model)
		if err != nil {
			w.log.Warn("learned max cost not raised: model unknown to the ledger", "model", model, "err", err)
			continue
		}
		ceiling := learnedMaxCap(m)
		c := min(cost, ceiling)
		if c <= 0 {
			continue
		}
		if c > hot || hot < m.MaxCost {
			// The ledger's max cost is the floor: a key lost with Redis (hot reads 0) is rebuilt
			// at what the ledger learned, never at this pass's cost alone.
			if _, err := w.store.RaiseModelMax(ctx, model, c, m.MaxCost, ceiling); err != nil {
				w.log.Warn("learned max cost not raised in redis", "model", model, "cost", c, "err", err)
				continue
			}
		}
		if c > m.MaxCost {
			if err := w.ledger.RaiseMaxCost(ctx, model, c); err != nil {
				w.log.Warn("learned max cost not raised in the ledger", "model", model, "cost", c, "err", err)
				continue
			}
		}
	}
}

// SettleOrg applies the org's unsettled ledger entries to the hot balance, in sequence order,
// and marks them settled. A cold org is seeded from a fresh snapshot first; a gap is healed by
// re-sending the entries past the watermark. Safe to call from anywhere at any time.
func (w *Worker) SettleOrg(ctx context.Context, org string) error {
	for {
		entries, epoch, err := w.ledger.UnsettledEntries(ctx, org, w.cfg.SettleBatch)
		if err != nil {
			return err
		}
		if len(entries) == 0 {
			return nil
		}
		w.store.ObserveEpoch(epoch)
		statuses, err := w.settle(ctx, org, epoch, entries)
		n := settledPrefix(statuses)
		w.lag.observe(time.Now(), entries[:n])
		if n > 0 {
			if merr := w.ledger.MarkSettled(ctx, org, entries[n-1].Seq); merr != nil {
				return errors.Join(err, merr)
			}
			w.stats.settled.Add(int64(n))
		}
		if err != nil {
			return err
		}
		if n < len(entries) {
			return fmt.Errorf("accounting: settle of %s stopped at seq %d (%s)", org, entries[n].Seq, statuses[n])
		}
		if len(entries) < w.cfg.SettleBatch {
			return nil
		}
	}
}

// settle calls the settle script, healing a cold org or a gap once.
func (w *Worker) settle(ctx context.Context, org string, epoch balance.Epoch, entries []balance.Entry) ([]balance.SettleStatus, error) {
	for attempt := 0; ; attempt++ {
		statuses, err := w.store.Settle(ctx, org, epoch, entries)
		switch {
		case err == nil:
			return statuses, nil
		case attempt >= 2:
			return statuses, err
		case errors.Is(err, balance.ErrCold):
			// Seed from a fresh snapshot and catch up; the retry then answers ALREADY for
			// what the snapshot covered, which only gives holds back.
			if werr := w.store.Warm(ctx, org); werr != nil {
				return statuses, fmt.Errorf("seed: %w", werr)
			}
			w.stats.seeds.Add(1)
		case errors.Is(err, balance.ErrGap):
			// Entries wm+1 … seq are re-sent from the ledger, settled or not: always safe.
			if cerr := w.store.CatchUp(ctx, org); cerr != nil {
				return statuses, fmt.Errorf("catch up: %w", cerr)
			}
			w.stats.gaps.Add(1)
		default:
			return statuses, err
		}
	}
}

// settledPrefix is how many leading statuses allow marking the entries settled.
func settledPrefix(st []balance.SettleStatus) int {
	for i, s := range st {
		if !s.Settled() {
			return i
		}
	}
	return len(st)
}

// Drain accounts and settles everything pending now, for tests and shutdown. The orgs the
// account passes handed entries over for are settled from them, like a pass does; the others
// the ledger says are behind are read back.
func (w *Worker) Drain(ctx context.Context) error {
	r, err := w.account(ctx)
	if err != nil {
		return err
	}
	orgs, err := w.ledger.OrgsToSettle(ctx, 1_000_000)
	if err != nil {
		return err
	}
	return w.settleOrgs(ctx, orgs, &handover{entries: r.Settle, epoch: r.Epoch}, false)
}

// settleGroup bounds the orgs of one batched settle (one ledger read, one Redis pipeline).
const settleGroup = 256

// handover is what an account pass handed over for settling: orgs' unsettled entries
// (AccountResult.Settle) and the epoch read with them. Each org's entries are used once: an org
// that goes round again (a full batch) is read back.
type handover struct {
	entries map[string][]balance.Entry
	epoch   balance.Epoch
}

// orgs lists the orgs handed over (none for a nil handover).
func (h *handover) orgs() []string {
	if h == nil {
		return nil
	}
	return slices.Collect(maps.Keys(h.entries))
}

// take removes and returns org's entries, if they were handed over.
func (h *handover) take(org string) ([]balance.Entry, bool) {
	if h == nil {
		return nil, false
	}
	es, ok := h.entries[org]
	delete(h.entries, org)
	return es, ok
}

// settleOrgs settles each org once, and each org of h from its handed-over entries. The orgs go
// in groups: one ledger read for the unsettled entries of the group's orgs not handed over, one
// Redis pipeline of their settle scripts, one ledger write of their settled marks; an org whose
// settle did not go through (cold, a gap, a Redis error) is then settled on its own (SettleOrg
// seeds it or heals the gap), SettleConcurrency at a time, and an org with more entries than
// one batch goes round again (read back). With retry, an org that failed is marked dirty again
// for the next pass. h may be nil.
func (w *Worker) settleOrgs(ctx context.Context, orgs []string, h *handover, retry bool) error {
	orgs = w.settleable(append(h.orgs(), orgs...))
	var errs []error
	for len(orgs) > 0 {
		group := orgs[:min(settleGroup, len(orgs))]
		orgs = orgs[len(group):]
		more, slow, err := w.settleBatch(ctx, group, h)
		if err != nil {
			// The ledger read or the marks failed: nothing is lost (re-sending is safe).
			errs = append(errs, err)
			if retry {
				w.redirty(group)
			}
			continue
		}
		if len(slow) > 0 {
			if err := w.settleEach(ctx, slow, retry); err != nil {
				errs = append(errs, err)
			}
		}
		orgs = append(orgs, more...)
	}
	return errors.Join(errs...)
}

// settleable drops repeated orgs and those whose id breaks the org-id rule (logged once each).
func (w *Worker) settleable(orgs []string) []string {
	seen := make(map[string]bool, len(orgs))
	out := orgs[:0:0]
	for _, org := range orgs {
		if seen[org] {
			continue
		}
		seen[org] = true
		if err := balance.ValidateOrg(org); err != nil {
			// A row written before the one org-id rule: the hot balance cannot hold it, so
			// every pass would fail on it again. Say so once and leave it to the operator.
			if _, logged := w.badOrgs.LoadOrStore(org, true); !logged {
				w.log.Error("org id breaks the org-id rule; its ledger entries are not settled until it is renamed in the ledger", "org", org, "err", err)
			}
			continue
		}
		out = append(out, org)
	}
	return out
}

// settleBatch settles one batch of each org of group together. more: orgs that had a full
// batch (there may be more); slow: orgs whose settle stopped early, to settle on their own.
func (w *Worker) settleBatch(ctx context.Context, group []string, h *handover) (more, slow []string, err error) {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
	defer cancel()
	byOrg, epoch, err := w.batchEntries(ctx, group, h)
	if err != nil || len(byOrg) == 0 {
		return nil, nil, err
	}
	res := w.store.SettleMany(ctx, epoch, byOrg) // it observes the epoch
	marks := make(map[string]int64, len(byOrg))
	var settled int64
	now := time.Now()
	for org, es := range byOrg {
		r := res[org]
		n := settledPrefix(r.Statuses)
		w.lag.observe(now, es[:n])
		if n > 0 {
			marks[org] = es[n-1].Seq
			settled += int64(n)
		}
		switch {
		case r.Err != nil || n < len(es):
			slow = append(slow, org)
		case len(es) >= w.cfg.SettleBatch:
			more = append(more, org)
		}
	}
	if err := w.ledger.MarkSettledMany(ctx, marks); err != nil {
		return nil, nil, err
	}
	w.stats.settled.Add(settled)
	return more, slow, nil
}

// batchEntries returns a batch of unsettled entries of each org of group, and the epoch to
// settle them with: an org handed over in h gets its handed-over entries (at most SettleBatch:
// a full batch goes round again and reads the rest), the others are read from the ledger in one
// statement. The read's epoch, when there is a read, is the later one: settling the handed-over
// entries with it is what reading them back would have done.
func (w *Worker) batchEntries(ctx context.Context, group []string, h *handover) (map[string][]balance.Entry, balance.Epoch, error) {
	byOrg := make(map[string][]balance.Entry, len(group))
	var read []string
	var epoch balance.Epoch
	for _, org := range group {
		if es, ok := h.take(org); ok && len(es) > 0 {
			byOrg[org], epoch = es[:min(len(es), w.cfg.SettleBatch)], h.epoch
		} else {
			read = append(read, org)
		}
	}
	if len(read) == 0 {
		return byOrg, epoch, nil
	}
	got, epoch, err := w.ledger.UnsettledEntriesOf(ctx, read, w.cfg.SettleBatch)
	if err != nil {
		return nil, balance.Epoch{}, err
	}
	maps.Copy(byOrg, got)
	return byOrg, epoch, nil
}

func (w *Worker) redirty(orgs []string) {
	w.mu.Lock()
	for _, org := range orgs {
		w.dirty[org] = struct{}{} // retried on the next sweep or notification
	}
	w.mu.Unlock()
}

// settleEach settles each org on its own (SettleOrg), SettleConcurrency orgs at a time (orgs
// are independent: each org's entries still go in sequence order, by one caller). With retry,
// an org that failed is marked dirty again for the next pass.
func (w *Worker) settleEach(ctx context.Context, orgs []string, retry bool) error {
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
		sem  = make(chan struct{}, w.cfg.SettleConcurrency)
	)
	for _, org := range orgs {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			octx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
			err := w.SettleOrg(octx, org)
			cancel()
			if err == nil {
				return
			}
			mu.Lock()
			errs = append(errs, fmt.Errorf("org %s: %w", org, err))
			mu.Unlock()
			if retry {
				w.redirty([]string{org})
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Credit adds a recharge to the ledger (idempotent by ref) and returns once the credit is in the
// hot balance, so a blocked org passes on its very next request. If Redis cannot be reached the
// credit is durable all the same and the worker applies it later: the returned error then wraps
// the Redis error while the entry is valid.
func (w *Worker) Credit(ctx context.Context, org string, amount int64, ref string) (ledger.LedgerEntry, bool, error) {
	e, created, err := w.ledger.Credit(ctx, org, amount, ref)
	if err != nil {
		return e, created, err
	}
	if err := w.SettleOrg(ctx, org); err != nil {
		w.Notify(org)
		return e, created, fmt.Errorf("accounting: credit %s recorded, hot balance not yet updated: %w", ref, err)
	}
	return e, created, nil
}

func (w *Worker) maintenanceLoop(ctx context.Context) {
	reap := time.NewTicker(w.cfg.ReapInterval)
	defer reap.Stop()
	scan := time.NewTicker(w.cfg.ScanInterval)
	defer scan.Stop()
	recon := time.NewTicker(w.cfg.ReconcileInterval)
	defer recon.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-reap.C:
			w.ReapOrgs(ctx, w.store.HeldOrgs())
		case <-scan.C:
			var orgs []string
			if err := w.store.ScanOrgs(ctx, func(org string) error { orgs = append(orgs, org); return nil }); err != nil {
				w.log.Warn("hold scan failed", "err", err)
			}
			w.ReapOrgs(ctx, orgs)
		case <-recon.C:
			var orgs []string
			if err := w.store.ScanWarmOrgs(ctx, func(org string) error { orgs = append(orgs, org); return nil }); err != nil {
				w.log.Warn("reconcile scan failed", "err", err)
			}
			for _, org := range orgs {
				octx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
				_, err := w.Reconcile(octx, org)
				cancel()
				if err != nil && ctx.Err() == nil {
					w.log.Warn("reconcile failed", "org", org, "err", err)
				}
			}
		}
	}
}

// ReapOrgs releases the expired holds of orgs whose usage the ledger does not hold.
func (w *Worker) ReapOrgs(ctx context.Context, orgs []string) int {
	total := 0
	for _, org := range orgs {
		octx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
		n, err := w.store.Reap(octx, org)
		cancel()
		total += n
		if err != nil {
			if ctx.Err() == nil {
				w.log.Warn("reap failed", "org", org, "err", err)
			}
			continue
		}
		if n > 0 {
			w.log.Info("reaped expired holds", "org", org, "holds", n)
		}
	}
	w.stats.reaped.Add(int64(total))
	return total
}

// Drift is what the reconciler found for one org.
type Drift struct {
	Org      string `json:"org"`
	Warm     bool   `json:"warm"`      // the org has a hot balance of the current epoch
	Hot      int64  `json:"hot"`       // bal + Σ holds
	Expected int64  `json:"expected"`  // B(wm): the ledger balance up to the watermark
	Drift    int64  `json:"drift"`     // Hot − Expected
	Repaired bool   `json:"repaired"`  // the hot balance was dropped (reseeds on next use)
	CaughtUp bool   `json:"caught_up"` // the watermark lagged and entries were re-sent
	// LimitsPushed: the hot limits were older than the ledger's (a push that failed), so the
	// hot state was dropped to reseed with them.
	LimitsPushed bool `json:"limits_pushed"`
}

// Reconcile compares the org's hot balance with the ledger: bal + Σ holds (+ the expiries rolled
// over and not yet in the ledger, docs/grants.md) must equal B(wm), the
// ledger balance up to the watermark. A drift, a watermark above the ledger's sequence, or an
// acct of another epoch is repaired by dropping the hot balance; a lagging watermark is caught up.
func (w *Worker) Reconcile(ctx context.Context, org string) (Drift, error) {
	d := Drift{Org: org}
	st, err := w.store.State(ctx, org)
	if err != nil {
		return d, err
	}
	epoch, err := w.ledger.Epoch(ctx)
	if err != nil {
		return d, err
	}
	if !st.Exists {
		// A cold org (ScanWarmOrgs hands the reconciler those whose limits a data-plane store
		// found missing in Redis): push its limits, so that its next seed may run.
		pushed, err := w.pushOlderLimits(ctx, org, epoch)
		d.LimitsPushed = pushed
		return d, err
	}
	if st.Epoch != epoch {
		d.Repaired = true
		return d, w.store.Invalidate(ctx, org)
	}
	d.Warm = true
	if pushed, err := w.pushOlderLimits(ctx, org, epoch); err != nil || pushed {
		d.Repaired, d.LimitsPushed = pushed, pushed
		return d, err
	}
	expected, ledgerSeq, err := w.balanceAt(ctx, org, st.Watermark)
	if err != nil {
		return d, err
	}
	if st.Watermark > ledgerSeq {
		// A watermark the ledger never reached: an acct left by another ledger.
		w.log.Warn("stale hot balance: watermark above ledger", "org", org, "wm", st.Watermark, "ledger_seq", ledgerSeq)
		w.stats.repairs.Add(1)
		d.Repaired = true
		return d, w.store.Invalidate(ctx, org)
	}
	d.Hot = st.Balance + st.Held + st.Expired // grants: rolled-over rests are part of the invariant
	d.Expected = expected
	d.Drift = d.Hot - d.Expected
	if d.Drift != 0 {
		return w.repairDrift(ctx, st, d)
	}
	if st.Watermark < ledgerSeq {
		d.CaughtUp = true
		return d, w.store.CatchUp(ctx, org)
	}
	return d, nil
}

// pushOlderLimits compares the hot limits' version with the ledger's: an older one (a push that
// failed) is pushed again, which drops the org's hot state to reseed. It reports whether it
// pushed.
func (w *Worker) pushOlderLimits(ctx context.Context, org string, epoch balance.Epoch) (bool, error) {
	ls, err := w.ledger.Limits(ctx, org)
	if errors.Is(err, ledger.ErrUnknownOrg) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	w.store.ObserveEpoch(epoch) // the push's floor is kept per epoch
	pushed, err := w.store.PushLimits(ctx, org, ls)
	if errors.Is(err, balance.ErrConfig) {
		return false, nil // the admin plane's reconciler pushes them
	}
	if err != nil || !pushed {
		return false, err
	}
	w.stats.repairs.Add(1)
	w.log.Warn("hot limits older than the ledger's: pushed again", "org", org, "version", ls.Version)
	return true, nil
}

// balanceAt is B(wm), the org's ledger balance up to the watermark wm (the account's balance
// minus the deltas of the entries after wm), and the account's ledger_seq, from one consistent
// view: the account is read after the entries, and both are read again if an entry landed in
// between. A watermark above ledger_seq is returned at once (the caller drops that acct).
func (w *Worker) balanceAt(ctx context.Context, org string, wm int64) (expected, ledgerSeq int64, err error) {
	for attempt := 0; ; attempt++ {
		entries, _, err := w.ledger.EntriesAfter(ctx, org, wm, 1_000_000)
		if err != nil {
			return 0, 0, err
		}
		acct, err := w.ledger.Account(ctx, org)
		if err != nil {
			return 0, 0, err
		}
		if wm > acct.LedgerSeq {
			return 0, acct.LedgerSeq, nil
		}
		last := wm
		var after int64
		for _, e := range entries {
			after += e.Delta
			last = e.Seq
		}
		if last == acct.LedgerSeq {
			return acct.Balance - after, acct.LedgerSeq, nil
		}
		if attempt >= 3 {
			return 0, 0, errors.New("accounting: ledger kept moving during reconcile")
		}
	}
}

// repairDrift drops the hot balance of d's org when the drift holds on a second read. The state
// read and the ledger read are not one snapshot: a settle may have moved the watermark between
// them, so a changed state is no drift.
func (w *Worker) repairDrift(ctx context.Context, st balance.State, d Drift) (Drift, error) {
	st2, err := w.store.State(ctx, d.Org)
	if err != nil {
		return d, err
	}
	if st2.Watermark != st.Watermark || st2.Balance+st2.Held+st2.Expired != d.Hot {
		return d, nil
	}
	w.stats.lastDrift.Store(d.Drift)
	w.stats.repairs.Add(1)
	w.log.Warn("hot balance drift repaired", "org", d.Org, "hot", d.Hot, "expected", d.Expected, "drift", d.Drift)
	d.Repaired = true
	return d, w.store.Invalidate(ctx, d.Org)
}

// settleLagBounds are the upper bounds of the settle-lag histogram's buckets (the last bucket,
// above them all, is implicit). Read-only: every SettleLag shares it as Bounds.
var settleLagBounds = []time.Duration{
	time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond,
	20 * time.Millisecond, 35 * time.Millisecond, 50 * time.Millisecond, 75 * time.Millisecond,
	100 * time.Millisecond, 150 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond,
	400 * time.Millisecond, 500 * time.Millisecond, 750 * time.Millisecond, time.Second,
	1500 * time.Millisecond, 2 * time.Second, 3 * time.Second, 5 * time.Second, 10 * time.Second,
	30 * time.Second, time.Minute,
}

// SettleLag is the distribution of settle lag over the entries this worker settled: from the
// moment the entry's usage was recorded (Entry.Recorded: the usage event's created_at) to the
// moment the settle script put it in the hot balance. Entries with no Recorded time are not
// counted.
type SettleLag struct {
	Bounds []time.Duration // the buckets' upper bounds, ascending (read-only)
	Counts []uint64        // Counts[i]: lags ≤ Bounds[i] and above the bound before; the last one: above every bound
	Count  uint64          // entries observed
	Sum    time.Duration   // total lag
}

// Quantile estimates the q-quantile (0 < q ≤ 1) as the upper bound of the bucket that holds it
// (the largest bound when it falls above them all); 0 with no observation.
func (l SettleLag) Quantile(q float64) time.Duration {
	if l.Count == 0 {
		return 0
	}
	rank := uint64(q*float64(l.Count) + 0.999999)
	var seen uint64
	for i, c := range l.Counts {
		seen += c
		if seen >= rank && i < len(l.Bounds) {
			return l.Bounds[i]
		}
	}
	return l.Bounds[len(l.Bounds)-1]
}

// SettleLag returns the settle-lag histogram so far.
func (w *Worker) SettleLag() SettleLag {
	return w.lag.snapshot()
}

type lagHistogram struct {
	counts [24]atomic.Uint64 // len(settleLagBounds)+1
	count  atomic.Uint64
	sum    atomic.Int64
}

func (h *lagHistogram) observe(now time.Time, entries []balance.Entry) {
	for _, e := range entries {
		if e.Recorded.IsZero() {
			continue
		}
		d := max(now.Sub(e.Recorded), 0)
		i := 0
		for i < len(settleLagBounds) && d > settleLagBounds[i] {
			i++
		}
		h.counts[i].Add(1)
		h.count.Add(1)
		h.sum.Add(int64(d))
	}
}

func (h *lagHistogram) snapshot() SettleLag {
	l := SettleLag{Bounds: settleLagBounds, Counts: make([]uint64, len(settleLagBounds)+1)}
	for i := range l.Counts {
		l.Counts[i] = h.counts[i].Load()
	}
	l.Count = h.count.Load()
	l.Sum = time.Duration(h.sum.Load())
	return l
}

// learnedMaxCap is the most a model's learned max may be raised to: the model's bound (max
// input × input price + max output × output price), or MaxAmount when its token limits are
// unknown.
func learnedMaxCap(m ledger.Model) int64 {
	ceiling, ok, err := m.CostBound()
	if err != nil || !ok {
		return balance.MaxAmount
	}
	return ceiling
}
