package accounting

import (
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

// Pinner pins and unpins holds (*balance.Store implements it). Pin pushes a hold's expiry far out
// so that no reaper releases it while its usage waits in the local journal; Unpin gives it its
// normal expiry back. Both act only on an existing hold and report whether it existed.
type Pinner interface {
	Pin(ctx context.Context, org, holdID string) (bool, error)
	Unpin(ctx context.Context, org, holdID string) (bool, error)
}

// RecorderStats are the recorder's running totals and its journal's state, for metrics.
type RecorderStats struct {
	JournalBytes    int64 // size of the local journal now
	JournalEvents   int64 // events waiting in the local journal now
	JournalMaxBytes int64 // the journal's cap (0: no journal)
	Journaled       int64 // events written to the journal because the ledger was unavailable
	Replays         int64 // successful journal replays into the ledger
	Replayed        int64 // events replayed into the ledger
	ReplayErrors    int64 // failed replay attempts
	Pinned          int64 // holds pinned now (their usage waits in the journal)
	PinErrors       int64 // pin or unpin calls that failed (they are retried)
	JournalFull     int64 // batches refused because the journal was full
	Finished        int64 // holds finished right after their usage was durable
	FinishErrors    int64 // finish calls (one per batch and shard) that failed; their holds wait for the settle
	FinishSkipped   int64 // holds not finished because their shard had too many finish calls in flight (a slow or dead Redis node); they wait for the settle
}

// pinState is one hold whose usage is in the journal (or was just replayed and waits to be
// unpinned).
type pinState struct {
	org    string
	ok     bool      // the last pin (or unpin) succeeded
	next   time.Time // when to try (again)
	wait   time.Duration
	cancel bool // replayed: unpin instead of pin
	tries  int  // failed unpins
}

// fallback is the Recorder's local-journal side: it appends batches the ledger could not take,
// pins their holds, re-pins them on a heartbeat, replays the journal when the ledger is back and
// then unpins the holds.
type fallback struct {
	j      *Journal
	ledger ledger.UsageStore
	pin    Pinner
	log    *slog.Logger
	// woken is RecorderConfig.Wake (nil: none), called after a replay that stored events. The
	// replay notifies as well (RecordUsage): the listeners may have missed much while the
	// ledger was away, and the woken worker may not be this process's only one.
	woken func()

	replayEvery time.Duration
	pinEvery    time.Duration
	unpinDelay  time.Duration
	timeout     time.Duration
	batch       int
	nearFree    float64

	mu    sync.Mutex
	holds map[string]*pinState // hold id → state
	wake  chan struct{}

	// down: the ledger failed the last batch (or replay) and no replay has succeeded since; new
	// batches go straight to the journal meanwhile. Logged once per outage.
	down atomic.Bool

	journaled, replays, replayed, replayErrs, pinErrs, full atomic.Int64

	run startstop.Base
}

// pinRetryMax bounds the wait between two tries of a pin or unpin that failed.
const pinRetryMax = 5 * time.Second

func newFallback(l ledger.UsageStore, cfg RecorderConfig) *fallback {
	return &fallback{
		j: cfg.Journal, ledger: l, pin: cfg.Pinner, log: cfg.Logger, woken: cfg.Wake,
		replayEvery: cfg.ReplayInterval, pinEvery: cfg.PinInterval, unpinDelay: cfg.UnpinDelay,
		timeout: cfg.Timeout, batch: cfg.MaxBatch,
		nearFree: cfg.JournalReserve,
		holds:    make(map[string]*pinState), wake: make(chan struct{}, 1),
	}
}

// start loads what a previous process left in the journal (its holds are pinned again, then
// unpinned after the replay) and starts the loops, which replay at once. They outlive ctx: only
// stop ends them.
func (f *fallback) start(ctx context.Context) {
	ctx, ok := f.run.Start(context.WithoutCancel(ctx))
	if !ok {
		return
	}
	if evs, err := f.j.Events(); err != nil {
		f.log.Error("escrow: cannot read the local journal", "err", err)
	} else if len(evs) > 0 {
		f.log.Warn("escrow: the local journal holds usage from an earlier run; replaying it", "events", len(evs), "bytes", f.j.Size())
		f.track(evs)
	}
	// The replay loop and the pin loop run side by side, so that a replay waiting for a slow
	// ledger never delays a pin.
	f.run.Go(func() { f.replayLoop(ctx) })
	f.run.Go(func() { f.pinLoop(ctx) })
}

// stop ends the loops, then makes one last replay attempt (the journal stays on disk otherwise).
func (f *fallback) stop(ctx context.Context) error {
	first, err := f.run.Stop(ctx)
	if err != nil || !first {
		return err
	}
	if f.j.Len() > 0 {
		f.replay(ctx)
	}
	// Holds replayed get one unpin try now; the pins of the rest expire by themselves, or are
	// renewed by the next process that opens the journal.
	f.pinDue(ctx, time.Now().Add(f.unpinDelay), true)
	return nil
}

// ledgerDown reports whether new batches should go straight to the journal: the ledger failed
// and no replay has succeeded since, so each batch need not wait for an unreachable ledger.
func (f *fallback) ledgerDown() bool { return f.down.Load() }

// nearFull reports whether new holds should be refused.
func (f *fallback) nearFull() bool { return f.j.NearFull(f.nearFree) }

// append writes events to the journal and schedules their holds' pins.
func (f *fallback) append(ctx context.Context, events []ledger.UsageEvent, cause error) error {
	if err := f.j.Append(ctx, events); err != nil {
		if errors.Is(err, ErrJournalFull) {
			f.full.Add(1)
			f.log.Error("escrow: ledger unavailable and local journal full: usage refused", "events", len(events), "bytes", f.j.Size(), "cause", cause)
		}
		return fmt.Errorf("accounting: ledger unavailable (%w) and local journal refused the batch: %w", cause, err)
	}
	f.journaled.Add(int64(len(events)))
	if f.down.CompareAndSwap(false, true) {
		f.log.Warn("escrow: ledger unavailable; usage goes to the local journal until it is back", "cause", cause)
	}
	f.track(events)
	return nil
}

func (f *fallback) track(events []ledger.UsageEvent) {
	now := time.Now()
	f.mu.Lock()
	for _, ev := range events {
		if ev.HoldAmount <= 0 || f.pin == nil {
			continue // fail-open requests have no hold
		}
		f.holds[ev.ID] = &pinState{org: ev.Org, next: now}
	}
	f.mu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// replayLoop replays a non-empty journal every replayEvery until ctx ends.
func (f *fallback) replayLoop(ctx context.Context) {
	tick := time.NewTicker(f.replayEvery)
	defer tick.Stop()
	for {
		if f.j.Len() > 0 {
			f.replay(ctx)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// pinLoop pins (and unpins) the holds whose turn it is, on a short tick or when woken, until
// ctx ends.
func (f *fallback) pinLoop(ctx context.Context) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		f.pinDue(ctx, time.Now(), false)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-f.wake:
		}
	}
}

// replay hands the journal to the ledger; on success its holds get their normal expiry back.
func (f *fallback) replay(ctx context.Context) {
	var ids []string
	n, err := f.j.Replay(ctx, f.batch, func(ctx context.Context, events []ledger.UsageEvent) error {
		rctx, cancel := context.WithTimeout(ctx, f.timeout)
		defer cancel()
		if err := f.ledger.RecordUsage(rctx, events); err != nil {
			return err
		}
		for _, ev := range events {
			ids = append(ids, ev.ID)
		}
		return nil
	})
	if err != nil {
		f.replayErrs.Add(1)
		if ledger.Unavailable(err) {
			f.down.Store(true)
		}
		if !ledger.Unavailable(err) {
			f.log.Error("escrow: journal replay failed", "replayed", n, "err", err)
		}
		return
	}
	if n == 0 {
		return
	}
	f.replays.Add(1)
	f.replayed.Add(int64(n))
	if f.woken != nil {
		f.woken()
	}
	if f.down.CompareAndSwap(true, false) {
		f.log.Info("escrow: the ledger answers again; usage goes to it directly")
	}
	f.log.Info("escrow: local journal replayed into the ledger", "events", n, "left", f.j.Len())
	// The worker settles the replayed usage within moments, which drops most of these holds; the
	// unpin, a moment later, is for the rest (their usage must not keep them pinned for PinTTL).
	// Unpinning at once would count them against the org's cap on requests in flight meanwhile.
	next := time.Now().Add(f.unpinDelay)
	f.mu.Lock()
	for _, id := range ids {
		if st, ok := f.holds[id]; ok {
			st.cancel, st.next, st.wait = true, next, 0
		}
	}
	f.mu.Unlock()
}

// pinDue pins (or, once replayed, unpins) the holds whose turn it is. A hold that no longer
// exists (settled, released, or lost with Redis) is dropped; a Redis error backs off the rest
// of the round.
func (f *fallback) pinDue(ctx context.Context, now time.Time, unpinOnly bool) {
	type item struct {
		id string
		st pinState
	}
	var due []item
	f.mu.Lock()
	for id, st := range f.holds {
		if !st.next.After(now) && (!unpinOnly || st.cancel) {
			due = append(due, item{id, *st})
		}
	}
	f.mu.Unlock()
	if len(due) == 0 {
		return
	}
	const parallel = 32
	var (
		wg     sync.WaitGroup
		sem    = make(chan struct{}, parallel)
		failed atomic.Int64 // past a few errors, Redis is down: the rest of the round waits
	)
	for _, it := range due {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			var exists bool
			var err error
			if failed.Load() >= parallel {
				err = errors.New("skipped after errors in this round")
			} else {
				cctx, cancel := context.WithTimeout(ctx, time.Second)
				if it.st.cancel {
					exists, err = f.pin.Unpin(cctx, it.st.org, it.id)
				} else {
					exists, err = f.pin.Pin(cctx, it.st.org, it.id)
				}
				cancel()
				if err != nil {
					if failed.Add(1) == 1 {
						f.log.Warn("escrow: cannot pin or unpin a journaled request's hold; retrying", "hold_id", it.id, "org", it.st.org, "err", err)
					}
					f.pinErrs.Add(1)
				}
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			st, ok := f.holds[it.id]
			if !ok || st.cancel != it.st.cancel {
				return // replayed meanwhile: the unpin is scheduled already
			}
			switch {
			case err != nil && st.cancel:
				// An unpin that fails is retried, but only for a while: the pin expires anyway.
				st.wait = min(max(2*st.wait, 50*time.Millisecond), pinRetryMax)
				st.next = time.Now().Add(st.wait)
				if st.tries++; st.tries > 100 {
					delete(f.holds, it.id)
				}
			case err != nil:
				st.wait = min(max(2*st.wait, 50*time.Millisecond), pinRetryMax)
				st.next = time.Now().Add(st.wait)
			case !exists || st.cancel:
				delete(f.holds, it.id) // gone, or unpinned: nothing more to do
			default:
				st.ok, st.wait = true, 0
				st.next = time.Now().Add(f.pinEvery) // the heartbeat re-pins it
			}
		}()
	}
	wg.Wait()
}

func (f *fallback) pinnedNow() int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	var n int64
	for _, st := range f.holds {
		if st.ok && !st.cancel {
			n++
		}
	}
	return n
}
