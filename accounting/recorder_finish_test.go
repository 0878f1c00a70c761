package accounting_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// countingFinisher counts FinishBatch calls and can fail them.
type countingFinisher struct {
	next  accounting.Finisher
	calls atomic.Int64
	holds atomic.Int64
	fail  atomic.Bool
}

func (c *countingFinisher) FinishBatch(ctx context.Context, fs []balance.Finish) (int, error) {
	c.calls.Add(1)
	c.holds.Add(int64(len(fs)))
	if c.fail.Load() {
		return 0, errors.New("redis down")
	}
	return c.next.FinishBatch(ctx, fs)
}

// TestRecorderFinishReturnsUnusedHold: once Record returns, the unused part of each hold is back
// in the available balance and the hold no longer counts as in flight — before any worker runs;
// the worker's settle then ends at the ledger's balance exactly.
func TestRecorderFinishReturnsUnusedHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := accounting.NewMemory()
	store := newStore(t, env, mem, balance.Config{MaxInFlight: 3})
	w := accounting.NewWorker(mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 3) // three holds of 10: the cap is full
	evs[0].Cost, evs[1].Cost, evs[2].Cost = 3, 0, 14 // the last costs more than its hold
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 10}); !errors.Is(err, balance.ErrTooManyHolds) {
		t.Fatalf("4th reserve: %v, want ErrTooManyHolds", err)
	}
	r := startRecorder(t, mem, accounting.RecorderConfig{Finisher: store, Logger: quiet})
	failOpen := accounting.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 2} // no hold
	recordEach(t, r, append(evs, failOpen))

	st, err := store.State(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	// bal = 1000 − the three costs; the holds now hold the costs; none is in flight.
	if st.Balance != 1000-17 || st.Held != 17 || st.Holds != 3 || st.Finished != 3 || st.InFlight() != 0 {
		t.Fatalf("after the records, before any settle: %+v", st)
	}
	if s := r.Stats(); s.Finished != 3 || s.FinishErrors != 0 {
		t.Fatalf("stats: %+v", s)
	}
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 10}); err != nil {
		t.Fatalf("reserve after the finishes: %v", err)
	}
	// A retried Record of the same events finishes nothing more.
	recordEach(t, r, evs)
	if s := r.Stats(); s.Finished != 3 {
		t.Fatalf("re-recorded events finished again: %+v", s)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acct, err := mem.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	st, _ = store.State(ctx, "acme")
	if want := int64(1000 - 17 - 2); acct.Balance != want || st.Balance+st.Held != want || st.Holds != 1 || st.Finished != 0 {
		t.Fatalf("after the settle: ledger %d, hot %+v; want %d and the one new hold", acct.Balance, st, want)
	}
}

// TestRecorderFinishOnePerBatch: finish rides in the batch: one FinishBatch call per ledger
// batch, never one per request.
func TestRecorderFinishOnePerBatch(t *testing.T) {
	t.Parallel()
	env := testutil.Redis(t)
	mem := accounting.NewMemory()
	store := newStore(t, env, mem, balance.Config{MaxInFlight: 1000})
	w := accounting.NewWorker(mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 90)
	h := &hookLedger{Ledger: mem, before: func([]accounting.UsageEvent) error {
		time.Sleep(5 * time.Millisecond) // callers pile up behind each batch
		return nil
	}}
	fin := &countingFinisher{next: store}
	r := startRecorder(t, h, accounting.RecorderConfig{Finisher: fin, MaxBatch: 30, Logger: quiet})
	recordEach(t, r, evs)
	if fin.calls.Load() != h.calls.Load() || fin.holds.Load() != 90 || fin.calls.Load() >= 45 {
		t.Fatalf("%d finish calls for %d holds in %d ledger batches", fin.calls.Load(), fin.holds.Load(), h.calls.Load())
	}
	st, err := store.State(context.Background(), "acme")
	if err != nil || st.Finished != 90 || st.Balance != 1000-90*3 {
		t.Fatalf("state: %+v %v", st, err)
	}
}

// TestRecorderFinishBestEffort: a failed finish fails no Record and changes nothing; the settle
// gives the holds back as before.
func TestRecorderFinishBestEffort(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := accounting.NewMemory()
	store := newStore(t, env, mem, balance.Config{})
	w := accounting.NewWorker(mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 5)
	fin := &countingFinisher{next: store}
	fin.fail.Store(true)
	r := startRecorder(t, mem, accounting.RecorderConfig{Finisher: fin, Logger: quiet})
	recordEach(t, r, evs)
	if s := r.Stats(); s.FinishErrors == 0 || s.Finished != 0 {
		t.Fatalf("stats: %+v", s)
	}
	st, _ := store.State(ctx, "acme")
	if st.Balance != 1000-50 || st.Finished != 0 || st.Holds != 5 {
		t.Fatalf("after a failed finish: %+v", st)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	st, _ = store.State(ctx, "acme")
	if st.Balance != 1000-15 || st.Holds != 0 {
		t.Fatalf("after the settle: %+v", st)
	}
}

// TestRecorderFinishJournaled: usage that goes to the journal during a ledger outage is durable
// too: its holds are finished (and pinned); no reaper releases them; after the replay the settle
// ends exact.
func TestRecorderFinishJournaled(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := accounting.NewMemory()
	l := newDownLedger(mem)
	store := newStore(t, env, l, balance.Config{HoldTTL: 50 * time.Millisecond, SettleDeadline: 50 * time.Millisecond, PinTTL: time.Hour, ReapGrace: time.Millisecond})
	w := accounting.NewWorker(l, store, &accounting.WorkerConfig{Logger: quiet})
	const n = 10
	evs := journalSetup(t, store, w, l, "acme", n)
	j, err := accounting.OpenJournal(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, Pinner: store, Finisher: store, ReplayInterval: 50 * time.Millisecond,
		UnpinDelay: 20 * time.Millisecond, PinInterval: 100 * time.Millisecond, Logger: quiet})
	l.down.Store(true)
	recordEach(t, r, evs)
	st, err := store.State(ctx, "acme")
	if err != nil || st.Finished != n || st.Balance != 1000-3*n || st.Held != 3*n {
		t.Fatalf("journaled and finished: %+v %v", st, err)
	}
	waitFor(t, "every finished hold pinned", 5*time.Second, func() bool {
		st, err := store.State(ctx, "acme")
		return err == nil && st.Pinned == n
	})
	time.Sleep(150 * time.Millisecond)
	if got, err := store.Reap(ctx, "acme"); got != 0 {
		t.Fatalf("reaped %d finished holds whose usage waits in the journal (err %v)", got, err)
	}
	l.down.Store(false)
	waitFor(t, "the replay", 5*time.Second, func() bool { return j.Len() == 0 })
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acct, err := l.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	st, _ = store.State(ctx, "acme")
	if want := int64(1000 - 3*n); acct.Balance != want || st.Balance != want || st.Holds != 0 {
		t.Fatalf("after the drain: ledger %d, hot %+v; want %d and no holds", acct.Balance, st, want)
	}
}
