package accounting_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// countingFinisher counts FinishEach calls and can fail them.
type countingFinisher struct {
	next  accounting.Finisher
	calls atomic.Int64
	holds atomic.Int64
	fail  atomic.Bool
}

func (c *countingFinisher) FinishEach(ctx context.Context, fs []balance.Finish) ([]balance.Finished, error) {
	c.calls.Add(1)
	c.holds.Add(int64(len(fs)))
	if c.fail.Load() {
		return nil, errors.New("redis down")
	}
	return c.next.FinishEach(ctx, fs)
}

// TestRecorderFinishReturnsUnusedHold: once Record returns, the unused part of each hold is back
// in the available balance and the hold no longer counts as in flight — before any worker runs;
// the worker's settle then ends at the ledger's balance exactly.
func TestRecorderFinishReturnsUnusedHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := memledger.New()
	store := newStore(t, env, mem, balance.Config{MaxInFlight: 3})
	w := newWorker(t, mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 3) // three holds of 10: the cap is full
	evs[0].Cost, evs[1].Cost, evs[2].Cost = 3, 0, 14 // the last costs more than its hold
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: newID(), Amount: 10}); !errors.Is(err, balance.ErrTooManyHolds) {
		t.Fatalf("4th reserve: %v, want ErrTooManyHolds", err)
	}
	r := startRecorder(t, mem, accounting.RecorderConfig{Finisher: store, Logger: quiet})
	failOpen := ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 2} // no hold
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

// TestRecorderReceipt: RecordReceipt answers the org's available balance right after the
// event's hold was finished, as the batch's finish call read it; the events of one batch (one
// org) each get the balance after their own finish, and the last one is the store's balance
// (nothing else in flight). No balance is claimed when it is unknown: an event with no hold
// (fail-open), a failed finish, a cold org, no Finisher.
func TestRecorderReceipt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := memledger.New()
	store := newStore(t, env, mem, balance.Config{})
	w := newWorker(t, mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 20) // 20 holds of 10, cost 3 each
	fin := &countingFinisher{next: store}
	h := &hookLedger{Ledger: mem, before: func([]ledger.UsageEvent) error {
		time.Sleep(5 * time.Millisecond) // callers pile up: batches of several events
		return nil
	}}
	r := startRecorder(t, h, accounting.RecorderConfig{Finisher: fin, Logger: quiet})
	recs := make([]accounting.Receipt, len(evs))
	errs := make([]error, len(evs))
	var wg sync.WaitGroup
	for i := range evs {
		wg.Go(func() { recs[i], errs[i] = r.RecordReceipt(ctx, evs[i]) })
	}
	wg.Wait()
	// Every event's balance is distinct and on the path 1000−200 → 1000−200+7·k (each finish
	// gives back 10−3), and the lowest one is the first finish's.
	seen := map[int64]bool{}
	for i, rc := range recs {
		if errs[i] != nil || !rc.HaveBalance {
			t.Fatalf("event %d: %+v %v", i, rc, errs[i])
		}
		k := (rc.Balance - 800) / 7
		if (rc.Balance-800)%7 != 0 || k < 1 || k > 20 || seen[rc.Balance] {
			t.Fatalf("event %d: balance %d is not after exactly one more finish", i, rc.Balance)
		}
		seen[rc.Balance] = true
	}
	st, err := store.State(ctx, "acme")
	if err != nil || st.Balance != 1000-20*3 || !seen[st.Balance] {
		t.Fatalf("store %+v %v; receipts %v", st, err, seen)
	}
	if fin.calls.Load() >= 20 {
		t.Fatalf("%d finish calls for 20 events: not batched", fin.calls.Load())
	}

	// Re-recorded: stored once, its hold already finished: the balance reflects it.
	if rc, err := r.RecordReceipt(ctx, evs[0]); err != nil || !rc.HaveBalance || rc.Balance != st.Balance {
		t.Fatalf("re-recorded: %+v %v, store %d", rc, err, st.Balance)
	}
	// Fail-open: no hold, no balance.
	if rc, err := r.RecordReceipt(ctx, ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 2}); err != nil || rc.HaveBalance {
		t.Fatalf("fail-open: %+v %v", rc, err)
	}
	// A failed finish: recorded, no balance.
	id := newID()
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 10}); err != nil {
		t.Fatal(err)
	}
	fin.fail.Store(true)
	if rc, err := r.RecordReceipt(ctx, ledger.UsageEvent{ID: id, Org: "acme", Model: "m", Cost: 4, HoldAmount: 10}); err != nil || rc.HaveBalance {
		t.Fatalf("failed finish: %+v %v", rc, err)
	}
	fin.fail.Store(false)
	// A cold org: the hold is finished, the balance unknown.
	id = newID()
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 10}); err != nil {
		t.Fatal(err)
	}
	if err := store.Invalidate(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if rc, err := r.RecordReceipt(ctx, ledger.UsageEvent{ID: id, Org: "acme", Model: "m", Cost: 4, HoldAmount: 10}); err != nil || rc.HaveBalance {
		t.Fatalf("cold org: %+v %v", rc, err)
	}
	// No Finisher: nothing known.
	r2 := startRecorder(t, mem, accounting.RecorderConfig{Logger: quiet})
	if rc, err := r2.RecordReceipt(ctx, ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 1, HoldAmount: 5}); err != nil || rc.HaveBalance {
		t.Fatalf("no finisher: %+v %v", rc, err)
	}
}

// TestRecorderFinishOnePerBatch: finish rides in the batch: at most one FinishBatch call per
// ledger batch, never one per request (fewer when the finish calls in flight are at their cap
// and the next batches' holds wait for one, together: a loaded machine).
func TestRecorderFinishOnePerBatch(t *testing.T) {
	t.Parallel()
	env := testutil.Redis(t)
	mem := memledger.New()
	store := newStore(t, env, mem, balance.Config{MaxInFlight: 1000})
	w := newWorker(t, mem, store, &accounting.WorkerConfig{Logger: quiet})
	evs := journalSetup(t, store, w, mem, "acme", 90)
	h := &hookLedger{Ledger: mem, before: func([]ledger.UsageEvent) error {
		time.Sleep(5 * time.Millisecond) // callers pile up behind each batch
		return nil
	}}
	fin := &countingFinisher{next: store}
	r := startRecorder(t, h, accounting.RecorderConfig{Finisher: fin, MaxBatch: 30, Logger: quiet})
	recordEach(t, r, evs)
	if fin.calls.Load() > h.calls.Load() || fin.holds.Load() != 90 || fin.calls.Load() >= 45 {
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
	mem := memledger.New()
	store := newStore(t, env, mem, balance.Config{})
	w := newWorker(t, mem, store, &accounting.WorkerConfig{Logger: quiet})
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
	mem := memledger.New()
	l := newDownLedger(mem)
	store := newStore(t, env, l, balance.Config{HoldTTL: 50 * time.Millisecond, SettleDeadline: 50 * time.Millisecond, PinTTL: time.Hour, ReapGrace: time.Millisecond})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	const n = 10
	evs := journalSetup(t, store, w, l, "acme", n)
	j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, Pinner: store, Finisher: store, ReplayInterval: 50 * time.Millisecond,
		UnpinDelay: 20 * time.Millisecond, PinInterval: 100 * time.Millisecond, Logger: quiet})
	l.down.Store(true)
	recordEach(t, r, evs)
	finished := redisMillis(t, env) // every hold's own expiry (HoldTTL, SettleDeadline) is at most 50 ms past this
	st, err := store.State(ctx, "acme")
	if err != nil || st.Finished != n || st.Balance != 1000-3*n || st.Held != 3*n {
		t.Fatalf("journaled and finished: %+v %v", st, err)
	}
	waitFor(t, "every finished hold pinned", func() bool {
		st, err := store.State(ctx, "acme")
		return err == nil && st.Pinned == n
	})
	// On the Redis clock, every hold's own expiry has passed: only its pin keeps it.
	waitFor(t, "the Redis clock past every hold's expiry", func() bool { return redisMillis(t, env) > finished+50+10 })
	if got, err := store.Reap(ctx, "acme"); got != 0 {
		t.Fatalf("reaped %d finished holds whose usage waits in the journal (err %v)", got, err)
	}
	l.down.Store(false)
	waitFor(t, "the replay", func() bool { return j.Len() == 0 })
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

// countingLedger counts the events of org it stored.
type countingLedger struct {
	*memledger.Ledger
	org string
	n   atomic.Int64
}

func (c *countingLedger) RecordUsage(ctx context.Context, evs []ledger.UsageEvent) error {
	err := c.Ledger.RecordUsage(ctx, evs)
	if err == nil {
		for _, ev := range evs {
			if ev.Org == c.org {
				c.n.Add(1)
			}
		}
	}
	return err
}

// stuckFinisher names one shard per org and never answers for one of them (a Redis node that
// died) until released; the others' holds it finishes at once.
type stuckFinisher struct {
	stuck   string
	release chan struct{}
	calls   atomic.Int64 // calls that met the stuck org
}

func (f *stuckFinisher) FinishShard(org string) string { return "node-of-" + org }

func (f *stuckFinisher) FinishEach(_ context.Context, fs []balance.Finish) ([]balance.Finished, error) {
	for _, x := range fs {
		if x.Org == f.stuck {
			f.calls.Add(1)
			<-f.release
			return nil, errors.New("redis node down")
		}
	}
	out := make([]balance.Finished, len(fs))
	for i := range out {
		out[i] = balance.Finished{Done: true, Balance: 7, HaveBalance: true}
	}
	return out, nil
}

// TestRecorderFinishStallsNoOne (issue 22 item 10): a finish that hangs (its Redis node died;
// FinishTimeout is a minute here) holds up only the callers whose holds are on that node: the
// next batches are written and other orgs' callers are answered, finished, while it hangs, in
// batches of their own or in the hanging one's; once maxFinishing calls hang on the node, its
// next holds wait in one batch, and past maxFinishPending they are left to the settle (answered
// at once, FinishSkipped) instead of piling up.
func TestRecorderFinishStallsNoOne(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fin := &stuckFinisher{stuck: "dead", release: make(chan struct{})}
	l := &countingLedger{Ledger: memledger.New(), org: "dead"}
	r := startRecorder(t, l, accounting.RecorderConfig{Finisher: fin, FinishTimeout: time.Minute,
		FlushInterval: 50 * time.Millisecond, Logger: quiet})
	// recorded is how many of the dead node's events are durable (their callers wait for the finish).
	recorded := func(n int) func() bool {
		return func() bool { return l.n.Load() >= int64(n) }
	}
	ev := func(org string) ledger.UsageEvent {
		return ledger.UsageEvent{ID: newID(), Org: org, Model: "m", Cost: 1, HoldAmount: 5}
	}
	var stuck sync.WaitGroup
	var once sync.Once
	release := func() { once.Do(func() { close(fin.release) }) }
	t.Cleanup(release) // before the recorder's Stop, which waits for the finishes
	// startStuck records one event of the dead node's org, which hangs in its finish;
	// hanging(n) waits for the n-th such finish call.
	startStuck := func() {
		stuck.Go(func() {
			if err := r.Record(ctx, ev("dead")); err != nil {
				t.Errorf("record on the dead node: %v (a failed finish fails no Record)", err)
			}
		})
	}
	hanging := func(n int64) {
		t.Helper()
		waitFor(t, fmt.Sprintf("finish call %d on the dead node", n), func() bool { return fin.calls.Load() == n })
	}
	// healthy records one event of a healthy org: it must be answered, finished, while the dead
	// node's finish hangs.
	healthy := func(what string) {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, waitLimit)
		defer cancel()
		rc, err := r.RecordReceipt(rctx, ev("alive"))
		if err != nil || !rc.HaveBalance || rc.Balance != 7 {
			t.Fatalf("%s: %+v %v while a finish on another node hangs", what, rc, err)
		}
	}
	startStuck()
	hanging(1)
	healthy("a later batch")

	// Both in one batch (the flush interval gathers them), or not: the healthy one is answered.
	startStuck()
	healthy("alongside a hanging one")
	hanging(2)

	// Up to maxFinishing (4) calls hang on the dead node. The holds that come next there wait
	// for one of them, all in one batch (a busy node is not skipped: an unfinished hold counts in
	// flight until the settle, a false 429 at the cap); healthy orgs are still answered.
	startStuck()
	hanging(3)
	startStuck()
	hanging(4)
	const queued = 50
	for range queued {
		startStuck()
	}
	healthy("with the dead node's slots full")
	waitFor(t, "the queued holds", recorded(4+queued))
	if st := r.Stats(); st.FinishSkipped != 0 || fin.calls.Load() != 4 {
		t.Fatalf("stats %+v, %d calls: the queued holds must wait, not be skipped or sent", st, fin.calls.Load())
	}
	// Once maxFinishPending holds wait, the next ones are not finished: answered at once.
	for range 4096 - queued {
		startStuck()
	}
	waitFor(t, "a full queue", recorded(4+4096))
	rctx, cancel := context.WithTimeout(ctx, waitLimit)
	rc, err := r.RecordReceipt(rctx, ev("dead"))
	cancel()
	if err != nil || rc.HaveBalance || r.Stats().FinishSkipped != 1 || fin.calls.Load() != 4 {
		t.Fatalf("record past the queue on the dead node: %+v %v, stats %+v, %d calls", rc, err, r.Stats(), fin.calls.Load())
	}
	healthy("with the dead node's queue full")

	release()
	stuck.Wait()
	// The first of the four to fail takes the queue as one call (it fails too: the node is dead).
	if st := r.Stats(); st.FinishErrors != 5 || st.Finished != 4 || fin.calls.Load() != 5 {
		t.Fatalf("stats %+v, %d calls: want 5 failed finishes (the queue in one), 4 holds finished", st, fin.calls.Load())
	}
}
