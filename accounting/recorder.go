package accounting

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/internal/startstop"
	"github.com/llmescrow/escrow/ledger"
)

// ErrRecorderClosed is returned by Record when the recorder is not running (before Start, after
// Stop).
var ErrRecorderClosed = errors.New("accounting: recorder not running")

// RecorderConfig configures a Recorder. The zero value of every field means its documented
// default; a negative value is refused (ErrConfig).
type RecorderConfig struct {
	// MaxBatch is the most events one RecordUsage call carries. Default 500.
	MaxBatch int
	// FlushInterval is how long a batch that is not full may wait for more events before it is
	// written. Default 0: a batch is written as soon as a flusher is free, with every event that
	// arrived meanwhile (group commit: under load, batches grow by themselves while the previous
	// ones are being written; at low load nothing waits).
	FlushInterval time.Duration
	// Flushers is how many batches may be in flight at once. Default 1: with Postgres on the
	// same two cores, one flusher gave the highest throughput (BenchmarkRecorder); more help
	// when the round trip, not the server, is the bottleneck (a remote database).
	Flushers int
	// Timeout bounds one batch's RecordUsage call. Default 5 s. A Record that fails with it may
	// still have been stored: recording again is safe (events are idempotent by id).
	Timeout time.Duration
	// QueueSize is how many events may wait for a flusher; Record blocks (within its context)
	// when the queue is full. Default 4 × MaxBatch.
	QueueSize int

	// Journal, when set, is the local fallback for a ledger outage: a batch whose RecordUsage
	// fails with ErrLedgerUnavailable is appended (fsynced) there instead, and its callers get
	// nil. Until a replay succeeds, new batches go straight there too; every ReplayInterval a
	// non-empty journal is replayed into the ledger (idempotently). When it is full, Record
	// fails. The caller owns the journal (opens and closes it). Default nil: ledger errors reach
	// Record.
	Journal *Journal
	// Pinner pins the hold of every journaled event (HoldAmount > 0), so that no reaper releases
	// it while its usage waits, re-pins it every PinInterval, and unpins it after the replay.
	// Failed calls are retried with backoff (up to 5 s apart) until Redis answers, the hold is
	// gone, or the event is replayed. *balance.Store implements it. Default nil: no pins.
	Pinner Pinner
	// PinInterval is the pin heartbeat; keep it well under the store's PinTTL (PinTTL/4).
	// Default 6h (the store's default PinTTL of 24h / 4).
	PinInterval time.Duration
	// ReplayInterval is how often a non-empty journal is replayed into the ledger. Default 1s.
	ReplayInterval time.Duration
	// UnpinDelay is how long after a replay the replayed holds are unpinned: by then the worker
	// has usually settled them (which drops them), and the few left get their normal expiry
	// back. Default 5s.
	UnpinDelay time.Duration
	// JournalReserve is the fraction of the journal's cap kept for requests already in flight:
	// Degraded reports true once less than this is free, so that new holds are refused while
	// the requests that hold one can still be journaled. Default 0.1.
	JournalReserve float64
	// Finisher, when set, finishes the holds of every batch right after it is durable (in the
	// ledger or the journal), in one pipelined call per batch (per shard of a FinishSharder:
	// per master of a Redis Cluster), before the batch's Record calls return: the unused part of
	// each hold is available again at once, and the hold no longer counts against the per-org
	// cap on requests in flight. Best effort: a failed finish changes nothing (the settle does
	// the same later). The finish never holds up the next batch, and a shard that does not
	// answer holds up only the callers whose holds it has (at most FinishTimeout; with
	// maxFinishing calls stuck on it, its holds are left to the settle).
	// *balance.Store implements it. Default nil: holds stay whole and in flight until the worker
	// settles them.
	Finisher Finisher
	// FinishTimeout bounds one finish call. Default 1s.
	FinishTimeout time.Duration
	// Wake, when set, is called once per batch right after the batch is in the ledger, and after
	// each journal replay that stored events: it wakes the worker of this process for an
	// account pass (*Worker.Wake), and a ledger that can (QuietUsageStore: both can) stores the
	// batch without notifying its listeners. Without it, every batch's NOTIFY wakes every
	// listener of the database — every proxy's worker, which then race for the same events —
	// when the worker that should account them is right here. Events no worker is woken for
	// (the process died first) are accounted by any worker's sweep. A batch that went to the
	// journal wakes nothing: the worker could not see it. Default nil: batches notify.
	Wake func()
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Recorder writes usage events to the ledger durably, group-committing concurrent calls: each
// Record returns only when its event is stored (or with the error of the batch it was in), and
// all events that arrive while a batch is being written go together in the next RecordUsage
// call, one round trip for the lot.
//
// With a Journal (DESIGN.md "Failure policy"), a ledger outage does not fail Record: the batch
// goes to the fsynced local journal, its holds are pinned, and the journal is replayed when the
// ledger answers again; Degraded tells the caller to stop taking new holds when the journal
// nears its cap.
type Recorder struct {
	ledger ledger.UsageStore
	cfg    RecorderConfig
	fb     *fallback // nil without a journal

	run    startstop.Base
	mu     sync.RWMutex // orders Record's sends before the queue's close
	open   bool         // between Start and the queue's close: Record may queue
	closed bool         // the queue is closed
	queue  chan *recordReq

	finished, finishErrs, finishSkipped atomic.Int64
	finishing                           sync.WaitGroup // finish calls in flight (Stop waits for them once the flushers are done)
	finishShards                        sync.Map       // shard → *finishShard: its finish calls in flight and the holds waiting
}

type recordReq struct {
	ev   ledger.UsageEvent
	done chan recordDone
}

type recordDone struct {
	err     error
	receipt Receipt
}

// The Recorder's defaults, used for the zero value of the RecorderConfig field they name.
const (
	defaultRecorderMaxBatch       = 500
	defaultRecorderFlushers       = 1
	defaultRecorderTimeout        = 5 * time.Second
	defaultRecorderQueuePerBatch  = 4 // QueueSize = 4 × MaxBatch
	defaultRecorderPinInterval    = 6 * time.Hour
	defaultRecorderReplayInterval = time.Second
	defaultRecorderUnpinDelay     = 5 * time.Second
	defaultRecorderJournalReserve = 0.1
	defaultRecorderFinishTimeout  = time.Second
)

// withDefaults returns the config with every zero field set to its default; c may be nil.
func (c *RecorderConfig) withDefaults() RecorderConfig {
	var z RecorderConfig
	if c != nil {
		z = *c
	}
	z.MaxBatch = cmp.Or(z.MaxBatch, defaultRecorderMaxBatch)
	z.Flushers = cmp.Or(z.Flushers, defaultRecorderFlushers)
	z.Timeout = cmp.Or(z.Timeout, defaultRecorderTimeout)
	z.QueueSize = cmp.Or(z.QueueSize, defaultRecorderQueuePerBatch*z.MaxBatch)
	z.PinInterval = cmp.Or(z.PinInterval, defaultRecorderPinInterval)
	z.ReplayInterval = cmp.Or(z.ReplayInterval, defaultRecorderReplayInterval)
	z.UnpinDelay = cmp.Or(z.UnpinDelay, defaultRecorderUnpinDelay)
	z.JournalReserve = cmp.Or(z.JournalReserve, defaultRecorderJournalReserve)
	z.FinishTimeout = cmp.Or(z.FinishTimeout, defaultRecorderFinishTimeout)
	z.Logger = cmp.Or(z.Logger, slog.Default())
	return z
}

// validate refuses a config (after withDefaults) that no default can mend: a negative size or
// duration, a journal reserve outside (0, 1).
func (c *RecorderConfig) validate() error {
	switch {
	case c.MaxBatch < 0 || c.Flushers < 0 || c.QueueSize < 0:
		return fmt.Errorf("%w: recorder MaxBatch, Flushers and QueueSize must be ≥ 0", ledger.ErrConfig)
	case c.FlushInterval < 0 || c.Timeout < 0 || c.PinInterval < 0 || c.ReplayInterval < 0 ||
		c.UnpinDelay < 0 || c.FinishTimeout < 0:
		return fmt.Errorf("%w: recorder durations must be ≥ 0", ledger.ErrConfig)
	case c.JournalReserve <= 0 || c.JournalReserve >= 1:
		return fmt.Errorf("%w: recorder JournalReserve %v is outside (0, 1)", ledger.ErrConfig, c.JournalReserve)
	}
	return nil
}

// NewRecorder returns a recorder writing to l; cfg may be nil for the defaults. A config field
// out of range is refused with an error wrapping ErrConfig. Call Start before Record.
func NewRecorder(l ledger.UsageStore, cfg *RecorderConfig) (*Recorder, error) {
	if l == nil {
		return nil, fmt.Errorf("%w: recorder needs a ledger", ledger.ErrConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	r := &Recorder{ledger: l, cfg: c, queue: make(chan *recordReq, c.QueueSize)}
	if c.Journal != nil {
		r.fb = newFallback(l, c)
	}
	return r, nil
}

// Degraded reports whether new holds should be refused (503) because the local journal is
// nearly full: less than JournalReserve of its cap is free. Always false without a journal.
func (r *Recorder) Degraded() bool { return r.fb != nil && r.fb.nearFull() }

// Journaling reports whether the local journal holds usage that waits for the ledger.
func (r *Recorder) Journaling() bool { return r.fb != nil && r.fb.j.Len() > 0 }

// Stats returns the recorder's running totals and its journal's state.
func (r *Recorder) Stats() RecorderStats {
	st := RecorderStats{Finished: r.finished.Load(), FinishErrors: r.finishErrs.Load(), FinishSkipped: r.finishSkipped.Load()}
	f := r.fb
	if f == nil {
		return st
	}
	st.JournalBytes, st.JournalEvents, st.JournalMaxBytes = f.j.Size(), int64(f.j.Len()), f.j.Max()
	st.Journaled, st.Replays, st.Replayed = f.journaled.Load(), f.replays.Load(), f.replayed.Load()
	st.ReplayErrors, st.Pinned, st.PinErrors = f.replayErrs.Load(), f.pinnedNow(), f.pinErrs.Load()
	st.JournalFull = f.full.Load()
	return st
}

// Start starts the flushers. They run until Stop, or until ctx ends, which stops the recorder
// like Stop (events already queued are still written). With a journal, Start also replays what
// an earlier run left in it (in the background), pinning those holds until it succeeds; the
// journal's loops run until Stop, whatever becomes of ctx. A second Start, or a Start after
// Stop, starts nothing.
func (r *Recorder) Start(ctx context.Context) error {
	runCtx, ok := r.run.Start(ctx)
	if !ok {
		return nil
	}
	if r.fb != nil {
		r.fb.start(ctx)
	}
	for range r.cfg.Flushers {
		if !r.run.Go(r.flusher) {
			return nil // stopped meanwhile
		}
	}
	r.mu.Lock()
	r.open = !r.closed
	r.mu.Unlock()
	// Stop, or the end of ctx, closes the queue: the flushers write what it holds and return.
	context.AfterFunc(runCtx, r.close)
	return nil
}

// Stop stops accepting events, writes every event already queued and waits for the flushers
// and their finish calls (or for ctx, whichever ends first). With a journal it then tries one
// last replay; what the journal still holds stays on disk for the next run. Stop before Start
// does nothing.
func (r *Recorder) Stop(ctx context.Context) error {
	first, err := r.run.Stop(ctx)
	if err != nil {
		return err
	}
	// The flushers have returned: no finish call starts any more.
	finished := make(chan struct{})
	go func() { r.finishing.Wait(); close(finished) }()
	select {
	case <-finished:
	case <-ctx.Done():
		return ctx.Err()
	}
	if !first {
		return nil
	}
	if r.fb != nil {
		return r.fb.stop(ctx)
	}
	return nil
}

// close closes the queue (once): Record refuses new events from then on.
func (r *Recorder) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return
	}
	r.closed, r.open = true, false
	close(r.queue)
}

// Record stores ev durably and returns nil only once it is stored. An event already stored is
// not stored again (its id makes recording idempotent), so a Record that failed may be retried.
// Invalid events are refused at once (ErrInvalidUsage, ErrInvalidAmount, balance.ErrInvalidOrg)
// and never spoil the batch of others. When ctx ends first, Record returns ctx.Err() but the
// event may still be written.
func (r *Recorder) Record(ctx context.Context, ev ledger.UsageEvent) error {
	_, err := r.RecordReceipt(ctx, ev)
	return err
}

// RecordReceipt is Record, also answering the org's available balance right after the event's
// hold was finished (see Receipt), as the batch's finish call read it: no extra round trip.
func (r *Recorder) RecordReceipt(ctx context.Context, ev ledger.UsageEvent) (Receipt, error) {
	ev, err := ledger.NormalizeEvent(ev)
	if err != nil {
		return Receipt{}, err
	}
	req := &recordReq{ev: ev, done: make(chan recordDone, 1)}
	r.mu.RLock()
	if !r.open {
		r.mu.RUnlock()
		return Receipt{}, ErrRecorderClosed
	}
	select {
	case r.queue <- req:
		r.mu.RUnlock()
	case <-ctx.Done():
		r.mu.RUnlock()
		return Receipt{}, ctx.Err()
	}
	select {
	case d := <-req.done:
		return d.receipt, d.err
	case <-ctx.Done():
		return Receipt{}, ctx.Err()
	}
}

func (r *Recorder) flusher() {
	batch := make([]*recordReq, 0, r.cfg.MaxBatch)
	var timer *time.Timer
	for {
		first, ok := <-r.queue
		if !ok {
			return
		}
		batch = append(batch[:0], first)
		open := true
		var deadline <-chan time.Time
		if r.cfg.FlushInterval > 0 {
			if timer == nil {
				timer = time.NewTimer(r.cfg.FlushInterval)
			} else {
				timer.Reset(r.cfg.FlushInterval)
			}
			deadline = timer.C
		}
	fill:
		for len(batch) < r.cfg.MaxBatch {
			// What is queued already joins the batch; with a flush interval, so does what comes
			// before the deadline.
			var req *recordReq
			var ok bool
			select {
			case req, ok = <-r.queue:
			default:
				if deadline == nil {
					break fill
				}
				select {
				case req, ok = <-r.queue:
				case <-deadline:
					break fill
				}
			}
			if !ok {
				open = false
				break fill
			}
			batch = append(batch, req)
		}
		if timer != nil {
			timer.Stop() // since Go 1.23 a stopped timer's channel holds no stale tick
		}
		r.commit(batch)
		clear(batch)
		if !open {
			return
		}
	}
}

// commit writes one batch and answers each of its callers.
func (r *Recorder) commit(batch []*recordReq) {
	events := make([]ledger.UsageEvent, len(batch))
	for i, req := range batch {
		events[i] = req.ev
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.Timeout)
	defer cancel()
	var err error
	if r.fb != nil && r.fb.ledgerDown() {
		// The ledger was down a moment ago and no replay has succeeded since: keep appending
		// (the replay loop finds out when the ledger is back) instead of waiting for it.
		err = r.fb.append(ctx, events, ledger.ErrLedgerUnavailable)
	} else {
		err = r.record(ctx, events)
		if err != nil && r.fb != nil && errors.Is(err, ledger.ErrLedgerUnavailable) {
			actx, acancel := context.WithTimeout(context.Background(), r.cfg.Timeout)
			err = r.fb.append(actx, events, err)
			acancel()
		}
	}
	if err == nil {
		// Finished before the callers hear back: a client that saw its request end must not
		// meet its hold in the in-flight count on its next request. The flusher goes on with
		// the next batch meanwhile.
		r.answer(batch)
		return
	}
	for _, req := range batch {
		req.done <- recordDone{err: err}
	}
}

// record writes a batch to the ledger: with a Wake, quietly when the ledger can, and then wakes
// the worker, also after an error that leaves the outcome unknown (the events may be stored; a
// pass that finds nothing costs little). A batch surely not stored wakes nothing.
func (r *Recorder) record(ctx context.Context, events []ledger.UsageEvent) error {
	if r.cfg.Wake == nil {
		return r.ledger.RecordUsage(ctx, events)
	}
	var err error
	if q, ok := r.ledger.(ledger.QuietUsageStore); ok {
		err = q.RecordUsageQuiet(ctx, events)
	} else {
		err = r.ledger.RecordUsage(ctx, events)
	}
	if !errors.Is(err, ledger.ErrNotRecorded) {
		r.cfg.Wake()
	}
	return err
}

// Void makes sure ev is never charged, for a caller whose Record failed or timed out and that
// is about to tell its client the request failed. It voids ev.ID in the ledger directly, not
// through the queue: a stalled batch must not delay it, and the ledger's primary key orders it
// against any write of the same event still in flight. nil: voided, so a later write of the
// event (a queued batch, a journal replay) is a no-op. ErrUsageRecorded: the event was stored
// first and is charged. Any other error: still unknown; Void may be retried.
func (r *Recorder) Void(ctx context.Context, ev ledger.UsageEvent) error {
	ev, err := ledger.NormalizeEvent(ev)
	if err != nil {
		return err
	}
	return r.ledger.VoidUsage(ctx, ev)
}
