package accounting

import (
	"cmp"
	"context"
	"errors"
	"sync"
	"time"
)

// ErrRecorderClosed is returned by Record when the recorder is not running (before Start, after
// Stop).
var ErrRecorderClosed = errors.New("accounting: recorder not running")

// RecorderConfig configures a Recorder. The zero value is ready to use.
type RecorderConfig struct {
	// MaxBatch is the most events one RecordUsage call carries. Default 500.
	MaxBatch int
	// FlushInterval is how long a batch that is not full may wait for more events before it is
	// written. Default 0: a batch is written as soon as a flusher is free, with every event that
	// arrived meanwhile (group commit: under load, batches grow by themselves while the previous
	// ones are being written; at low load nothing waits).
	FlushInterval time.Duration
	// Flushers is how many batches may be in flight at once. Default 2.
	Flushers int
	// Timeout bounds one batch's RecordUsage call. Default 5 s. A Record that fails with it may
	// still have been stored: recording again is safe (events are idempotent by id).
	Timeout time.Duration
	// QueueSize is how many events may wait for a flusher; Record blocks (within its context)
	// when the queue is full. Default 4 × MaxBatch.
	QueueSize int
}

// Recorder writes usage events to the ledger durably, group-committing concurrent calls: each
// Record returns only when its event is stored (or with the error of the batch it was in), and
// all events that arrive while a batch is being written go together in the next RecordUsage
// call, one round trip for the lot.
//
// The local journal (the fallback for a ledger outage, DESIGN.md "Failure policy") plugs in at
// one place: Recorder.commit, which today returns the ledger's error to every caller of the
// batch; with a journal it appends the batch there when the error wraps ErrLedgerUnavailable.
type Recorder struct {
	ledger Ledger
	cfg    RecorderConfig

	mu      sync.RWMutex
	running bool
	stopped bool
	queue   chan *recordReq
	wg      sync.WaitGroup
	stopCtx func() bool // unregisters Start's context hook
}

type recordReq struct {
	ev   UsageEvent
	done chan error
}

// NewRecorder returns a recorder writing to l. Call Start before Record.
func NewRecorder(l Ledger, cfg RecorderConfig) *Recorder {
	cfg.MaxBatch = cmp.Or(max(cfg.MaxBatch, 0), 500)
	cfg.Flushers = cmp.Or(max(cfg.Flushers, 0), 2)
	cfg.Timeout = cmp.Or(max(cfg.Timeout, 0), 5*time.Second)
	cfg.QueueSize = cmp.Or(max(cfg.QueueSize, 0), 4*cfg.MaxBatch)
	cfg.FlushInterval = max(cfg.FlushInterval, 0)
	return &Recorder{ledger: l, cfg: cfg, queue: make(chan *recordReq, cfg.QueueSize)}
}

// Start starts the flushers. They run until Stop, or until ctx ends, which stops the recorder
// like Stop (events already queued are still written).
func (r *Recorder) Start(ctx context.Context) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running || r.stopped {
		return
	}
	r.running = true
	for range r.cfg.Flushers {
		r.wg.Add(1)
		go r.flusher()
	}
	r.stopCtx = context.AfterFunc(ctx, r.close)
}

// Stop stops accepting events, writes every event already queued and waits for the flushers
// (or for ctx, whichever ends first).
func (r *Recorder) Stop(ctx context.Context) error {
	r.close()
	r.mu.RLock()
	stop := r.stopCtx
	r.mu.RUnlock()
	if stop != nil {
		stop()
	}
	done := make(chan struct{})
	go func() {
		r.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *Recorder) close() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return
	}
	r.stopped = true
	close(r.queue)
}

// Record stores ev durably and returns nil only once it is stored. An event already stored is
// not stored again (its id makes recording idempotent), so a Record that failed may be retried.
// Invalid events are refused at once (ErrInvalidUsage, ErrInvalidAmount, balance.ErrInvalidOrg)
// and never spoil the batch of others. When ctx ends first, Record returns ctx.Err() but the
// event may still be written.
func (r *Recorder) Record(ctx context.Context, ev UsageEvent) error {
	ev, err := normalizeEvent(ev)
	if err != nil {
		return err
	}
	req := &recordReq{ev: ev, done: make(chan error, 1)}
	r.mu.RLock()
	if !r.running || r.stopped {
		r.mu.RUnlock()
		return ErrRecorderClosed
	}
	select {
	case r.queue <- req:
		r.mu.RUnlock()
	case <-ctx.Done():
		r.mu.RUnlock()
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *Recorder) flusher() {
	defer r.wg.Done()
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
			select {
			case req, ok := <-r.queue:
				if !ok {
					open = false
					break fill
				}
				batch = append(batch, req)
				continue
			default:
			}
			if deadline == nil {
				break
			}
			select {
			case req, ok := <-r.queue:
				if !ok {
					open = false
					break fill
				}
				batch = append(batch, req)
			case <-deadline:
				deadline = nil
				break fill
			}
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
	events := make([]UsageEvent, len(batch))
	for i, req := range batch {
		events[i] = req.ev
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.Timeout)
	err := r.ledger.RecordUsage(ctx, events)
	cancel()
	for _, req := range batch {
		req.done <- err
	}
}
