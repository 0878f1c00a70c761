package startstop

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestDoubleStart(t *testing.T) {
	t.Parallel()
	var b Base
	ctx, ok := b.Start(context.Background())
	if !ok {
		t.Fatal("first Start: ok = false")
	}
	if _, ok := b.Start(context.Background()); ok {
		t.Fatal("second Start: ok = true; a service runs once")
	}
	var runs atomic.Int32
	b.Go(func() { runs.Add(1); <-ctx.Done() })
	first, err := b.Stop(context.Background())
	if !first || err != nil {
		t.Fatalf("Stop = %v, %v; want true, nil", first, err)
	}
	if runs.Load() != 1 {
		t.Fatalf("%d runs", runs.Load())
	}
	if !errors.Is(context.Cause(ctx), ErrStopped) {
		t.Fatalf("run context cause %v; want ErrStopped", context.Cause(ctx))
	}
	if _, ok := b.Start(context.Background()); ok {
		t.Fatal("Start after Stop: ok = true")
	}
	if b.Go(func() { t.Error("ran after Stop") }) {
		t.Fatal("Go after Stop reported true")
	}
}

func TestStopBeforeStart(t *testing.T) {
	t.Parallel()
	var b Base
	first, err := b.Stop(context.Background())
	if first || err != nil {
		t.Fatalf("Stop before Start = %v, %v; want false, nil", first, err)
	}
	if b.Running() {
		t.Fatal("running before Start")
	}
	// The service can still start afterwards.
	ctx, ok := b.Start(context.Background())
	if !ok {
		t.Fatal("Start after an early Stop: ok = false")
	}
	b.Go(func() { <-ctx.Done() })
	if !b.Running() {
		t.Fatal("not running after Start")
	}
	if first, err := b.Stop(context.Background()); !first || err != nil {
		t.Fatalf("Stop = %v, %v", first, err)
	}
	if b.Running() {
		t.Fatal("running after Stop")
	}
}

func TestStopWithDeadline(t *testing.T) {
	t.Parallel()
	var b Base
	_, ok := b.Start(context.Background())
	if !ok {
		t.Fatal("Start: ok = false")
	}
	release := make(chan struct{})
	b.Go(func() { <-release }) // ignores its context: only release ends it
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	// Stop returns on its deadline while the goroutine still runs (release is closed only
	// after): an ordering, not a measured time.
	first, err := b.Stop(ctx)
	if !first || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop = %v, %v; want true, DeadlineExceeded", first, err)
	}
	// A later Stop waits for the goroutine and is not the first.
	close(release)
	if first, err := b.Stop(context.Background()); first || err != nil {
		t.Fatalf("second Stop = %v, %v; want false, nil", first, err)
	}
}

func TestStopWaitsForGoroutines(t *testing.T) {
	t.Parallel()
	var b Base
	ctx, _ := b.Start(context.Background())
	var finished atomic.Int32
	for range 4 {
		b.Go(func() {
			<-ctx.Done()
			time.Sleep(10 * time.Millisecond)
			finished.Add(1)
		})
	}
	if _, err := b.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := finished.Load(); n != 4 {
		t.Fatalf("Stop returned with %d of 4 goroutines done", n)
	}
}

func TestConcurrentStartStop(t *testing.T) {
	t.Parallel()
	for range 50 {
		var b Base
		var starts, firsts atomic.Int32
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				if ctx, ok := b.Start(context.Background()); ok {
					starts.Add(1)
					b.Go(func() { <-ctx.Done() })
				}
			})
			wg.Go(func() {
				if first, err := b.Stop(context.Background()); err != nil {
					t.Error(err)
				} else if first {
					firsts.Add(1)
				}
			})
		}
		wg.Wait()
		if first, _ := b.Stop(context.Background()); first {
			firsts.Add(1)
		}
		if starts.Load() != 1 || firsts.Load() > 1 || (starts.Load() == 1 && firsts.Load() == 0 && b.Running()) {
			t.Fatalf("starts %d, first stops %d, running %v", starts.Load(), firsts.Load(), b.Running())
		}
	}
}

func TestStartContextEnds(t *testing.T) {
	t.Parallel()
	var b Base
	parent, cancel := context.WithCancel(context.Background())
	ctx, _ := b.Start(parent)
	b.Go(func() { <-ctx.Done() })
	cancel()
	<-ctx.Done()
	if errors.Is(context.Cause(ctx), ErrStopped) {
		t.Fatal("the end of Start's context reported as a Stop")
	}
	if first, err := b.Stop(context.Background()); !first || err != nil {
		t.Fatalf("Stop = %v, %v", first, err)
	}
}
