package balance

import (
	"context"
	"sync"
	"time"
)

// Keep-alive: a hold lives HoldTTL unless its owner extends it. Rather than one timer per
// request, every Store keeps one queue of the holds it keeps alive and one goroutine that
// extends, in one pipeline, every hold whose last extension is a third of HoldTTL old. Every
// lease has the same period, so the order leases are queued in (at KeepAlive, and again after
// each extension) is the order they fall due: the queue is a doubly linked list, appended at the
// tail, popped at the head, unlinked anywhere by Stop, all in O(1). A request that ends before
// its first extension costs one small allocation and two short critical sections; no timer,
// no goroutine.

// maxKeepAliveBatch bounds the extensions of one pipeline.
const maxKeepAliveBatch = 256

// leaseState is where a Lease is.
type leaseState uint8

const (
	leaseQueued    leaseState = iota // in the queue, waiting for its turn
	leaseExtending                   // taken by the keeper: its extension is being sent
	leaseFiring                      // lost: onLost is being called
	leaseDone                        // stopped or lost: never touched again
)

// Lease keeps one hold alive until Stop (see Store.KeepAlive).
type Lease struct {
	k           *keeper
	org, holdID string
	onLost      func(error)

	// Guarded by k.mu.
	state      leaseState
	due        time.Time // the next extension
	lastOK     time.Time // when the last extension that succeeded was sent (or KeepAlive)
	prev, next *Lease
}

// keepAlives is the Store's keeper, made on first use.
type keepAlives struct {
	once sync.Once
	k    *keeper
}

func (ka *keepAlives) get(s *Store) *keeper {
	ka.once.Do(func() { ka.k = newKeeper(s) })
	return ka.k
}

// keeper is a Store's keep-alive queue and the goroutine that works it.
type keeper struct {
	s      *Store
	every  time.Duration // HoldTTL/3: the age at which a hold is extended again
	slack  time.Duration // the shortest pause between two passes, so that leases due close together go in one pipeline
	margin time.Duration // a hold not extended by its expiry minus this is given up

	mu         sync.Mutex
	fired      sync.Cond // signalled when a leaseFiring lease is done
	head, tail *Lease
	running    bool // the goroutine is alive
}

func newKeeper(s *Store) *keeper {
	every := max(s.cfg.HoldTTL/3, time.Millisecond)
	k := &keeper{s: s, every: every, slack: max(every/8, 100*time.Microsecond), margin: s.cfg.HoldTTL / 6}
	k.fired.L = &k.mu
	return k
}

// KeepAlive keeps the hold holdID of org alive until the Lease is stopped: once the hold's
// last extension is HoldTTL/3 old, the Store extends it (Extend; holds that fall due
// together are extended in one pipeline). Extending never lowers an expiry, so a hold pinned or
// finished meanwhile is left as it is. When the hold cannot be extended for so long that it
// would expire (less a margin of HoldTTL/6) before the next try, the Lease gives up and calls
// onLost (when not nil) once, with the last error, from the Store's keep-alive goroutine: the
// owner should then stop relying on the hold, since a reaper may release it. onLost must not
// block.
//
// The ids are those Reserve took (ErrInvalidOrg, ErrInvalidHoldID otherwise). A request that
// ends before its first extension costs no timer and no Redis call.
func (s *Store) KeepAlive(org, holdID string, onLost func(error)) (*Lease, error) {
	if err := checkOrg(org); err != nil {
		return nil, err
	}
	if err := checkHold(holdID); err != nil {
		return nil, err
	}
	k := s.keep.get(s)
	l := &Lease{k: k, org: org, holdID: holdID, onLost: onLost}
	k.mu.Lock()
	// The clock is read under the lock, so the queue stays in due order.
	l.lastOK = time.Now()
	l.due = l.lastOK.Add(k.every)
	k.push(l)
	if !k.running {
		k.running = true
		go k.run()
	}
	k.mu.Unlock()
	return l, nil
}

// Stop ends the keep-alive. After it returns the hold is not extended again by this Lease (an
// extension already sent may still land) and onLost is never called. Stopping twice, or a nil
// Lease, is fine.
func (l *Lease) Stop() {
	if l == nil {
		return
	}
	k := l.k
	k.mu.Lock()
	defer k.mu.Unlock()
	for l.state == leaseFiring {
		k.fired.Wait()
	}
	if l.state == leaseQueued {
		k.unlink(l)
	}
	l.state = leaseDone
}

// push appends l at the tail of the queue (k.mu held).
func (k *keeper) push(l *Lease) {
	l.state = leaseQueued
	l.prev, l.next = k.tail, nil
	if k.tail != nil {
		k.tail.next = l
	} else {
		k.head = l
	}
	k.tail = l
}

// unlink takes l out of the queue (k.mu held).
func (k *keeper) unlink(l *Lease) {
	if l.prev != nil {
		l.prev.next = l.next
	} else {
		k.head = l.next
	}
	if l.next != nil {
		l.next.prev = l.prev
	} else {
		k.tail = l.prev
	}
	l.prev, l.next = nil, nil
}

// run extends due leases until the queue has stayed empty for a whole period; then it ends (a
// later KeepAlive starts it again), so an idle Store holds no goroutine.
func (k *keeper) run() {
	t := time.NewTimer(k.every)
	defer t.Stop()
	var batch []*Lease
	var idleSince time.Time
	for {
		now := time.Now()
		k.mu.Lock()
		var wait time.Duration
		switch {
		case k.head == nil:
			if idleSince.IsZero() {
				idleSince = now
			}
			if now.Sub(idleSince) >= k.every {
				k.running = false
				k.mu.Unlock()
				return
			}
			wait = k.every - now.Sub(idleSince)
		case k.head.due.After(now):
			idleSince = time.Time{}
			wait = k.head.due.Sub(now)
		default:
			idleSince = time.Time{}
			batch = k.takeDue(now.Add(k.slack), batch[:0])
		}
		k.mu.Unlock()
		if len(batch) > 0 {
			k.extend(batch)
			clear(batch)
			batch = batch[:0]
			wait = k.slack // let the next due leases gather
		}
		t.Reset(wait)
		<-t.C
	}
}

// takeDue moves up to maxKeepAliveBatch leases due by until from the head of the queue into
// batch (k.mu held). until is a little past now, so that leases falling due together share a
// pipeline: a hold is extended at most slack (HoldTTL/24) before a third of HoldTTL.
func (k *keeper) takeDue(until time.Time, batch []*Lease) []*Lease {
	for l := k.head; l != nil && !l.due.After(until) && len(batch) < maxKeepAliveBatch; l = k.head {
		k.unlink(l)
		l.state = leaseExtending
		batch = append(batch, l)
	}
	return batch
}

// extend sends the batch's extensions in one pipeline, then queues each lease again, or gives
// it up when its hold could not be extended in time. Leases stopped meanwhile are dropped.
func (k *keeper) extend(batch []*Lease) {
	s := k.s
	sent := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), max(k.every/2, time.Millisecond))
	errs := make([]error, len(batch))
	if len(batch) == 1 {
		l := batch[0]
		_, errs[0] = s.Extend(ctx, l.org, l.holdID)
	} else {
		keys := make([][]string, len(batch))
		args := make([][]any, len(batch))
		for i, l := range batch {
			keys[i] = s.keys(l.org).expiryKeys()
			args[i] = []any{l.holdID, s.holdTTL, "0"}
		}
		for i, cmd := range s.pipelined(ctx, scExtend, keys, args) {
			errs[i] = cmd.Err()
		}
	}
	cancel()
	var lost []int // indexes in batch
	k.mu.Lock()
	now := time.Now()
	for i, l := range batch {
		switch {
		case l.state != leaseExtending: // stopped while its extension was on the way
			l.state = leaseDone
			continue
		case errs[i] == nil:
			l.lastOK = sent
		case now.Add(k.every).After(l.lastOK.Add(s.cfg.HoldTTL - k.margin)):
			// The next try would come too late: the hold may expire before it.
			l.state = leaseFiring
			lost = append(lost, i)
			continue
		}
		l.due = now.Add(k.every)
		k.push(l)
	}
	k.mu.Unlock()
	if len(lost) == 0 {
		return
	}
	// A firing lease is the keeper's alone: Stop waits until it is done.
	for _, i := range lost {
		l := batch[i]
		if l.onLost != nil {
			l.onLost(errs[i])
		} else {
			s.log.Warn("balance: hold not extended in time; keep-alive given up", "org", l.org, "hold_id", l.holdID, "err", errs[i])
		}
	}
	k.mu.Lock()
	for _, i := range lost {
		batch[i].state = leaseDone
	}
	k.fired.Broadcast()
	k.mu.Unlock()
}
