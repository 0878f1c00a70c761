// Package startstop is the start/stop bookkeeping shared by escrow's background services (the
// accounting worker, the usage recorder and its journal fallback), so that each one starts and
// stops by the same rules:
//
//   - Start runs once: a second Start, or a Start after Stop, starts nothing.
//   - Stop cancels the context Start handed out and waits for every goroutine started with Go,
//     or for its own ctx, whichever comes first.
//   - Stop before Start does nothing (the service may still be started later).
//   - Both are safe to call concurrently and any number of times; exactly one Stop call is told
//     that it stopped a running service, so a last step (a final flush) runs once.
//
// A service holds a Base and writes its Start and Stop on top of it:
//
//	func (s *Service) Start(ctx context.Context) error {
//		ctx, ok := s.run.Start(ctx)
//		if !ok {
//			return nil
//		}
//		s.run.Go(func() { s.loop(ctx) })
//		return nil
//	}
//
//	func (s *Service) Stop(ctx context.Context) error {
//		first, err := s.run.Stop(ctx)
//		if err != nil || !first {
//			return err
//		}
//		return s.flush(ctx)
//	}
package startstop

import (
	"context"
	"errors"
	"sync"
)

// ErrStopped is the cause (context.Cause) of a run context cancelled by Stop, which tells a
// controlled stop from the end of the context given to Start.
var ErrStopped = errors.New("startstop: service stopped")

type state int

const (
	idle state = iota
	running
	stopped
)

// Base is the start/stop state of one service. The zero value is ready; a Base must not be
// copied after first use.
type Base struct {
	mu     sync.Mutex
	state  state
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup
	done   chan struct{} // closed once Stop was called and every goroutine has returned
}

// Start marks the service started. The first time it returns a context derived from ctx that
// Stop cancels (with cause ErrStopped), and ok = true: the caller then starts its goroutines
// with Go. Any later call (running or stopped) returns ctx unchanged and ok = false: start
// nothing.
func (b *Base) Start(ctx context.Context) (context.Context, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state != idle {
		return ctx, false
	}
	b.state = running
	ctx, b.cancel = context.WithCancelCause(ctx)
	return ctx, true
}

// Go runs fn in a goroutine that Stop waits for. It is meant for the Start that got ok = true;
// once Stop has begun, fn is not run and Go reports false.
func (b *Base) Go(fn func()) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.state != running {
		return false
	}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		fn()
	}()
	return true
}

// Stop cancels the run context and waits until every goroutine started with Go has returned,
// or until ctx ends (then it returns ctx's error; the goroutines are still told to stop).
//
// first is true for exactly one call: the one that stopped a running service. Calls before
// Start, and every call after (or alongside) that one, get false; those that come after Start
// still wait for the goroutines.
func (b *Base) Stop(ctx context.Context) (first bool, err error) {
	b.mu.Lock()
	switch b.state {
	case idle:
		b.mu.Unlock()
		return false, nil
	case running:
		first = true
		b.state = stopped
		b.cancel(ErrStopped)
		b.done = make(chan struct{})
		go func(done chan struct{}) {
			b.wg.Wait()
			close(done)
		}(b.done)
	}
	done := b.done
	b.mu.Unlock()
	select {
	case <-done:
		return first, nil
	case <-ctx.Done():
		return first, ctx.Err()
	}
}

// Running reports whether the service was started and Stop has not been called yet.
func (b *Base) Running() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state == running
}
