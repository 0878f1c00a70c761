package accounting_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

// hookLedger counts and optionally slows down or fails RecordUsage calls.
type hookLedger struct {
	ledger.Ledger
	calls    atomic.Int64
	maxBatch atomic.Int64
	before   func(events []ledger.UsageEvent) error
}

func (h *hookLedger) RecordUsage(ctx context.Context, events []ledger.UsageEvent) error {
	h.calls.Add(1)
	for {
		m := h.maxBatch.Load()
		if int64(len(events)) <= m || h.maxBatch.CompareAndSwap(m, int64(len(events))) {
			break
		}
	}
	if h.before != nil {
		if err := h.before(events); err != nil {
			return err
		}
	}
	return h.Ledger.RecordUsage(ctx, events)
}

func usage(org string) ledger.UsageEvent {
	return ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: org, Model: "m", Cost: 3, HoldAmount: 10}
}

func startRecorder(t *testing.T, l ledger.Ledger, cfg accounting.RecorderConfig) *accounting.Recorder {
	t.Helper()
	r := newRecorder(t, l, cfg)
	r.Start(context.Background())
	t.Cleanup(func() { _ = r.Stop(context.Background()) })
	return r
}

// newRecorder is accounting.NewRecorder, failing the test on a config error.
func newRecorder(t testing.TB, l ledger.Ledger, cfg accounting.RecorderConfig) *accounting.Recorder {
	t.Helper()
	r, err := accounting.NewRecorder(l, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func recordAll(t *testing.T, r *accounting.Recorder, n int, org string) ([]ledger.UsageEvent, []error) {
	t.Helper()
	evs := make([]ledger.UsageEvent, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		evs[i] = usage(org)
		wg.Go(func() { errs[i] = r.Record(context.Background(), evs[i]) })
	}
	wg.Wait()
	return evs, errs
}

func TestRecorderGroupCommits(t *testing.T) {
	t.Parallel()
	mem := memledger.New()
	h := &hookLedger{Ledger: mem, before: func([]ledger.UsageEvent) error {
		time.Sleep(10 * time.Millisecond) // a slow ledger: callers pile up behind each batch
		return nil
	}}
	r := startRecorder(t, h, accounting.RecorderConfig{MaxBatch: 50, Flushers: 1})
	const n = 400
	_, errs := recordAll(t, r, n, "o")
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got, err := mem.AccountPending(context.Background(), 10_000)
	if err != nil || got != n {
		t.Fatalf("stored %d events (%v), want %d", got, err, n)
	}
	if c := h.calls.Load(); c > n/10 {
		t.Fatalf("%d RecordUsage calls for %d concurrent events: not group-committed", c, n)
	}
	if m := h.maxBatch.Load(); m > 50 || m < 2 {
		t.Fatalf("largest batch %d; want 2…MaxBatch(50)", m)
	}
}

func TestRecorderReturnsOnlyWhenDurable(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	mem := memledger.New()
	h := &hookLedger{Ledger: mem, before: func([]ledger.UsageEvent) error { <-release; return nil }}
	r := startRecorder(t, h, accounting.RecorderConfig{})
	done := make(chan error, 1)
	go func() { done <- r.Record(context.Background(), usage("o")) }()
	select {
	case err := <-done:
		t.Fatalf("Record returned (%v) before the ledger stored the event", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n, _ := mem.AccountPending(context.Background(), 10); n != 1 {
		t.Fatalf("stored %d events", n)
	}
}

func TestRecorderBatchErrorReachesEveryCaller(t *testing.T) {
	t.Parallel()
	boom := errors.New("disk on fire")
	h := &hookLedger{Ledger: memledger.New(), before: func([]ledger.UsageEvent) error {
		time.Sleep(5 * time.Millisecond)
		return boom
	}}
	r := startRecorder(t, h, accounting.RecorderConfig{Flushers: 1})
	_, errs := recordAll(t, r, 50, "o")
	for i, err := range errs {
		if !errors.Is(err, boom) {
			t.Fatalf("caller %d: %v, want the batch's error", i, err)
		}
	}
}

func TestRecorderRejectsInvalidEventAlone(t *testing.T) {
	t.Parallel()
	mem := memledger.New()
	r := startRecorder(t, mem, accounting.RecorderConfig{})
	bad := usage("bad{org}")
	if err := r.Record(context.Background(), bad); !errors.Is(err, balance.ErrInvalidOrg) {
		t.Fatalf("invalid org: %v", err)
	}
	bad = usage("o")
	bad.ID = "not-a-uuid"
	if err := r.Record(context.Background(), bad); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Fatalf("invalid id: %v", err)
	}
	if err := r.Record(context.Background(), usage("o")); err != nil {
		t.Fatal(err)
	}
}

func TestRecorderStopFlushes(t *testing.T) {
	t.Parallel()
	mem := memledger.New()
	entered := make(chan struct{}) // closed when the first batch reaches the (slow) ledger
	var once sync.Once
	h := &hookLedger{Ledger: mem, before: func([]ledger.UsageEvent) error {
		once.Do(func() { close(entered) })
		time.Sleep(20 * time.Millisecond)
		return nil
	}}
	r := newRecorder(t, h, accounting.RecorderConfig{Flushers: 1, MaxBatch: 10})
	if err := r.Record(context.Background(), usage("o")); !errors.Is(err, accounting.ErrRecorderClosed) {
		t.Fatalf("Record before Start: %v", err)
	}
	r.Start(context.Background())
	const n = 60
	errs := make(chan error, n)
	for range n {
		go func() { errs <- r.Record(context.Background(), usage("o")) }()
	}
	<-entered // a batch is on its way to the ledger, the others queue behind it: Stop now
	if err := r.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	ok := 0
	for range n {
		switch err := <-errs; {
		case err == nil:
			ok++
		case errors.Is(err, accounting.ErrRecorderClosed):
			// arrived after Stop: refused, never silently dropped
		default:
			t.Fatal(err)
		}
	}
	stored, _ := mem.AccountPending(context.Background(), 10_000)
	if stored != ok || ok == 0 {
		t.Fatalf("%d Records succeeded but %d events stored", ok, stored)
	}
	if err := r.Record(context.Background(), usage("o")); !errors.Is(err, accounting.ErrRecorderClosed) {
		t.Fatalf("Record after Stop: %v", err)
	}
}

func TestRecorderStopsWithStartContext(t *testing.T) {
	t.Parallel()
	r := newRecorder(t, memledger.New(), accounting.RecorderConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	r.Start(ctx)
	if err := r.Record(context.Background(), usage("o")); err != nil {
		t.Fatal(err)
	}
	cancel()
	deadline := time.Now().Add(waitLimit)
	for r.Record(context.Background(), usage("o")) == nil {
		if time.Now().After(deadline) {
			t.Fatal("recorder still accepting events after its context ended")
		}
		time.Sleep(time.Millisecond)
	}
	if err := r.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestRecorderFlushInterval(t *testing.T) {
	t.Parallel()
	h := &hookLedger{Ledger: memledger.New()}
	r := startRecorder(t, h, accounting.RecorderConfig{FlushInterval: 50 * time.Millisecond, Flushers: 1})
	// Ten callers arriving within the interval share one batch.
	_, errs := recordAll(t, r, 10, "o")
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if c := h.calls.Load(); c > 2 {
		t.Fatalf("%d RecordUsage calls for 10 events within one flush interval", c)
	}
}

func TestRecorderPostgres(t *testing.T) {
	t.Parallel()
	l, env := testutil.PostgresLedger(t)
	r := startRecorder(t, l, accounting.RecorderConfig{})
	evs, errs := recordAll(t, r, 500, "o")
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Recording the same events again stores nothing new.
	for _, ev := range evs[:50] {
		if err := r.Record(context.Background(), ev); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := env.Pool.QueryRow(context.Background(), "SELECT count(*) FROM usage_events").Scan(&n); err != nil || n != 500 {
		t.Fatalf("usage_events rows = %d, %v; want 500", n, err)
	}
}
