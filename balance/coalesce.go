package balance

import (
	"context"
	"runtime"
	"slices"
	"sync"
	"time"
)

// coalescer sends reserves that arrive together as one Redis pipeline (unless
// Config.NoCoalesce).
//
// It is a group commit with no goroutine of its own: at most MaxPipelines reserve round trips
// are in flight at once. A reserve that finds a free slot and nobody waiting goes straight to
// Redis, alone, exactly as without coalescing (nothing waits at low load). A reserve that finds
// every slot busy queues; when a round trip ends, its sender (or, once its own reply is in, a
// queued caller it hands the slot to) takes everything queued, up to MaxBatch, into one
// pipeline. Each reserve gets its own reply, so DUP, GONE, COLD, INSUFFICIENT… mean exactly what
// they mean for a lone call.
type coalescer struct {
	s        *Store
	window   time.Duration
	maxBatch int
	maxPipes int

	mu       sync.Mutex
	queue    []*rcall
	inflight int
}

// rcall is one queued reserve.
type rcall struct {
	keys []string
	args []any
	res  []any
	err  error
	// Guarded by coalescer.mu.
	sent    bool // taken into a batch: its reply will come
	replied bool // res and err are set
	lead    bool // handed a pipeline slot it has not used yet
	// done carries at most two signals: the slot hand-off and the reply.
	done chan struct{}
}

var rcallPool = sync.Pool{New: func() any { return &rcall{done: make(chan struct{}, 2)} }}

func newCoalescer(s *Store, cfg Config) *coalescer {
	return &coalescer{s: s, window: cfg.BatchWindow, maxBatch: cfg.MaxBatch, maxPipes: cfg.MaxPipelines}
}

// reserve runs the reserve script with keys and args, alone or in a pipeline with others.
func (co *coalescer) reserve(ctx context.Context, keys []string, args []any) ([]any, error) {
	co.mu.Lock()
	if co.inflight < co.maxPipes && len(co.queue) == 0 {
		// A free slot and nobody waiting: one plain EVALSHA, as without coalescing.
		co.inflight++
		co.mu.Unlock()
		res, err := co.s.reserveOne(ctx, keys, args)
		co.mu.Lock()
		co.inflight--
		co.handOff()
		co.mu.Unlock()
		return res, err
	}
	c := rcallPool.Get().(*rcall)
	c.keys, c.args = keys, args
	co.queue = append(co.queue, c)
	if co.inflight < co.maxPipes {
		co.inflight++
		co.mu.Unlock()
		co.lead(c)
	} else {
		co.mu.Unlock()
	}
	for {
		co.mu.Lock()
		if c.replied {
			co.giveBack(c) // a slot handed over after another sender took our call
			co.mu.Unlock()
			return c.finish()
		}
		co.mu.Unlock()
		select {
		case <-c.done:
			co.mu.Lock()
			lead := c.lead
			c.lead = false
			co.mu.Unlock()
			if lead {
				co.lead(c)
			}
		case <-ctx.Done():
			co.mu.Lock()
			sent := c.sent
			if !sent {
				co.remove(c) // never sent: nothing was debited
			}
			co.giveBack(c)
			co.mu.Unlock()
			if !sent {
				c.recycle()
			}
			// A sent call may commit unseen, like any reserve that times out; it is left to
			// its sender (not recycled).
			return nil, ctx.Err()
		}
	}
}

func (c *rcall) finish() ([]any, error) {
	res, err := c.res, c.err
	c.recycle()
	return res, err
}

func (c *rcall) recycle() {
	c.keys, c.args, c.res, c.err = nil, nil, nil, nil
	c.sent, c.replied, c.lead = false, false, false
	for len(c.done) > 0 { // signals nobody waited for
		<-c.done
	}
	rcallPool.Put(c)
}

// remove drops c from the queue (mu held).
func (co *coalescer) remove(c *rcall) {
	if i := slices.Index(co.queue, c); i >= 0 {
		co.queue = slices.Delete(co.queue, i, i+1)
	}
}

// giveBack (mu held) passes on a slot handed to c that c will not use.
func (co *coalescer) giveBack(c *rcall) {
	if c.lead {
		c.lead = false
		co.inflight--
		co.handOff()
	}
}

// handOff (mu held) gives a free slot to the first queued caller that has none; it then sends
// the queue.
func (co *coalescer) handOff() {
	if co.inflight >= co.maxPipes {
		return
	}
	for _, c := range co.queue {
		if !c.lead {
			c.lead = true
			co.inflight++
			c.done <- struct{}{}
			return
		}
	}
}

// lead holds a slot: it sends batches from the queue until own is sent (in its batch or
// another's); then it gives the slot back, or on to the next queued caller.
func (co *coalescer) lead(own *rcall) {
	for {
		if batch := co.take(); len(batch) > 0 {
			co.send(batch)
		}
		co.mu.Lock()
		if own.sent || len(co.queue) == 0 {
			co.inflight--
			co.handOff()
			co.mu.Unlock()
			return
		}
		co.mu.Unlock()
	}
}

// take removes up to maxBatch calls from the front of the queue. With a BatchWindow, while other
// pipelines are in flight, it waits up to the window for more calls to fill the batch.
func (co *coalescer) take() []*rcall {
	var deadline time.Time
	for {
		co.mu.Lock()
		n := min(len(co.queue), co.maxBatch)
		if co.window > 0 && n < co.maxBatch && co.inflight > 1 {
			now := time.Now()
			if deadline.IsZero() {
				deadline = now.Add(co.window)
			}
			if now.Before(deadline) {
				co.mu.Unlock()
				runtime.Gosched()
				continue
			}
		}
		batch := make([]*rcall, n)
		copy(batch, co.queue[:n])
		for _, c := range batch {
			c.sent = true
		}
		rest := copy(co.queue, co.queue[n:])
		clear(co.queue[rest:])
		co.queue = co.queue[:rest]
		co.mu.Unlock()
		return batch
	}
}

// send runs the batch: one EVALSHA alone, or a pipeline. On NOSCRIPT the scripts are loaded again
// and the calls that met it (and only those: they ran nothing) are sent again. Every call of the
// batch is then signalled.
func (co *coalescer) send(batch []*rcall) {
	// The batch outlives any one caller's context; the client's timeouts bound it.
	ctx := context.Background()
	if len(batch) == 1 {
		c := batch[0]
		c.res, c.err = co.s.reserveOne(ctx, c.keys, c.args)
	} else {
		co.pipeline(ctx, batch)
	}
	co.mu.Lock()
	for _, c := range batch {
		c.replied = true
		c.done <- struct{}{}
	}
	co.mu.Unlock()
}

func (co *coalescer) pipeline(ctx context.Context, batch []*rcall) {
	keys := make([][]string, len(batch))
	args := make([][]any, len(batch))
	for i, c := range batch {
		keys[i], args[i] = c.keys, c.args
	}
	for i, cmd := range co.s.reserveMany(ctx, keys, args) {
		batch[i].res, batch[i].err = cmd.Slice()
	}
}
