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
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// downLedger is a ledger that can be switched off: every call that would reach the database
// fails with ErrLedgerUnavailable, like Postgres stopped. It counts how often each usage event
// reached the ledger while it was up.
type downLedger struct {
	ledger.Ledger
	down atomic.Bool

	mu     sync.Mutex
	stored map[string]int // event id → RecordUsage calls that carried it and succeeded
}

func newDownLedger(l ledger.Ledger) *downLedger {
	return &downLedger{Ledger: l, stored: map[string]int{}}
}

func (d *downLedger) err() error {
	if d.down.Load() {
		return fmt.Errorf("injected outage: %w", ledger.ErrLedgerUnavailable)
	}
	return nil
}

func (d *downLedger) RecordUsage(ctx context.Context, events []ledger.UsageEvent) error {
	if err := d.err(); err != nil {
		return err
	}
	if err := d.Ledger.RecordUsage(ctx, events); err != nil {
		return err
	}
	d.mu.Lock()
	for _, ev := range events {
		d.stored[ev.ID]++
	}
	d.mu.Unlock()
	return nil
}

func (d *downLedger) UnsettledUsage(ctx context.Context, org string, ids []string) (map[string]bool, error) {
	if err := d.err(); err != nil {
		return nil, err
	}
	return d.Ledger.UnsettledUsage(ctx, org, ids)
}

func (d *downLedger) Snapshot(ctx context.Context, org string) (balance.Snapshot, error) {
	if err := d.err(); err != nil {
		return balance.Snapshot{}, err
	}
	return d.Ledger.Snapshot(ctx, org)
}

func (d *downLedger) SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error) {
	if err := d.err(); err != nil {
		return balance.Snapshot{}, err
	}
	return d.Ledger.SnapshotSince(ctx, org, since)
}

func (d *downLedger) timesStored(id string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.stored[id]
}

// waitLimit bounds a wait for something that must happen: it only ends a test that would hang,
// so it is far above what a loaded machine (race detector, two cores, other packages compiling)
// takes. waitFor returns as soon as its condition holds.
const waitLimit = time.Minute

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// journalSetup makes a funded org with n holds of 10 taken, and their usage events (cost 3).
func journalSetup(t *testing.T, store *balance.Store, w *accounting.Worker, l ledger.Ledger, org string, n int) []ledger.UsageEvent {
	t.Helper()
	ctx := context.Background()
	if err := l.CreateOrg(ctx, org); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.Credit(ctx, org, 1000, "init-"+org); err != nil {
		t.Fatal(err)
	}
	evs := make([]ledger.UsageEvent, n)
	for i := range evs {
		evs[i] = ledger.UsageEvent{ID: newID(), Org: org, Model: "m", Cost: 3, HoldAmount: 10}
		if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: evs[i].ID, Amount: 10}); err != nil {
			t.Fatal(err)
		}
	}
	return evs
}

func recordEach(t *testing.T, r *accounting.Recorder, evs []ledger.UsageEvent) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(evs))
	for i := range evs {
		wg.Go(func() { errs[i] = r.Record(context.Background(), evs[i]) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
	}
}

// TestRecorderJournalOutage: with the ledger down, Record still returns nil (the events are in
// the journal), every hold is pinned and the reaper releases none; when the ledger is back the
// journal is replayed once, the holds are unpinned, and each event is charged exactly once.
func TestRecorderJournalOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	mem := memledger.New()
	l := newDownLedger(mem)
	store := newStore(t, env, l, balance.Config{HoldTTL: 50 * time.Millisecond, PinTTL: time.Hour, ReapGrace: time.Millisecond})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	const n = 40
	evs := journalSetup(t, store, w, l, "acme", n)

	j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	pins := &countingPinner{Pinner: store}
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, Pinner: pins, ReplayInterval: 50 * time.Millisecond, UnpinDelay: 20 * time.Millisecond,
		PinInterval: 100 * time.Millisecond, Logger: quiet})
	reserved := redisMillis(t, env) // every hold's own expiry is at most HoldTTL past this

	l.down.Store(true)
	recordEach(t, r, evs[:n/2])
	if !r.Journaling() || j.Len() != n/2 {
		t.Fatalf("journaling %v with %d events, want %d", r.Journaling(), j.Len(), n/2)
	}
	// While the journal holds events, new ones go straight there.
	recordEach(t, r, evs[n/2:])
	if j.Len() != n {
		t.Fatalf("journal has %d events, want %d", j.Len(), n)
	}
	waitFor(t, "every hold pinned", func() bool {
		st, err := store.State(ctx, "acme")
		return err == nil && st.Pinned == n
	})
	// Let the heartbeat renew every pin once, and the Redis clock pass every hold's own
	// expiry: an unpinned hold would be reaped now (HoldTTL 50ms, grace 1ms); pinned ones are
	// not, and with the ledger down nothing is reaped anyway.
	waitFor(t, "every pin renewed by the heartbeat", func() bool { return pins.least(evs) >= 2 })
	waitFor(t, "the Redis clock past every hold's expiry", func() bool { return redisMillis(t, env) > reserved+50+10 })
	if got, err := store.Reap(ctx, "acme"); got != 0 {
		t.Fatalf("reaped %d holds while their usage waits in the journal (err %v)", got, err)
	}
	if st := r.Stats(); st.Journaled != n || st.Pinned != n || st.Replays != 0 || st.JournalEvents != n || st.JournalBytes == 0 {
		t.Fatalf("stats during the outage: %+v", st)
	}
	for _, ev := range evs {
		if c := l.timesStored(ev.ID); c != 0 {
			t.Fatalf("event stored %d times while the ledger was down", c)
		}
	}

	l.down.Store(false)
	waitFor(t, "the replay", func() bool { return j.Len() == 0 && !r.Journaling() })
	waitFor(t, "every hold unpinned", func() bool {
		st, err := store.State(ctx, "acme")
		return err == nil && st.Pinned == 0
	})
	if st := r.Stats(); st.Replays != 1 || st.Replayed != n || st.Pinned != 0 {
		t.Fatalf("stats after the replay: %+v", st)
	}
	for _, ev := range evs {
		if c := l.timesStored(ev.ID); c != 1 {
			t.Fatalf("event %s replayed %d times, want 1", ev.ID, c)
		}
	}
	// A second replay of the same events (a crash between the ledger's commit and the
	// journal's truncation) charges nothing more.
	if err := l.RecordUsage(ctx, evs); err != nil {
		t.Fatal(err)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acct, err := l.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.State(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(1000 - 3*n); acct.Balance != want || st.Balance != want || st.Holds != 0 {
		t.Fatalf("after the drain: ledger %d, hot %+v; want %d and no holds", acct.Balance, st, want)
	}
}

// TestRecorderJournalSurvivesRestart: a recorder journals during an outage and stops; a new one
// over the same journal directory replays it when the ledger is back and unpins the holds.
func TestRecorderJournalSurvivesRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	l := newDownLedger(memledger.New())
	store := newStore(t, env, l, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	const n = 10
	evs := journalSetup(t, store, w, l, "acme", n)
	dir := t.TempDir()

	j1, err := accounting.OpenJournal(dir, &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	r1 := newRecorder(t, l, accounting.RecorderConfig{Journal: j1, Pinner: store, ReplayInterval: 20 * time.Millisecond, UnpinDelay: 20 * time.Millisecond, Logger: quiet})
	r1.Start(ctx)
	l.down.Store(true)
	recordEach(t, r1, evs)
	waitFor(t, "pins", func() bool { st, _ := store.State(ctx, "acme"); return st.Pinned == n })
	if err := r1.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := j1.Close(); err != nil {
		t.Fatal(err)
	}

	l.down.Store(false)
	j2, err := accounting.OpenJournal(dir, &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j2.Close()
	if j2.Len() != n {
		t.Fatalf("reopened journal has %d events, want %d", j2.Len(), n)
	}
	r2 := startRecorder(t, l, accounting.RecorderConfig{Journal: j2, Pinner: store, ReplayInterval: 20 * time.Millisecond, UnpinDelay: 20 * time.Millisecond, Logger: quiet})
	waitFor(t, "the replay at start", func() bool { return j2.Len() == 0 })
	waitFor(t, "unpins", func() bool { st, _ := store.State(ctx, "acme"); return st.Pinned == 0 })
	if st := r2.Stats(); st.Replays != 1 || st.Replayed != n {
		t.Fatalf("stats: %+v", st)
	}
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acct, _ := l.Account(ctx, "acme")
	if acct.Balance != 1000-3*n {
		t.Fatalf("ledger balance %d, want %d", acct.Balance, 1000-3*n)
	}
}

// TestRecorderJournalFull: Degraded turns on when the journal nears its cap, and a batch that
// does not fit fails Record (the caller must not serve the request unbilled).
func TestRecorderJournalFull(t *testing.T) {
	t.Parallel()
	l := newDownLedger(memledger.New())
	l.down.Store(true)
	ev := ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 3}
	size := func() int64 {
		j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		defer j.Close()
		if err := j.Append(context.Background(), []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
		return j.Size()
	}() + 8 // an event with another id of the same length, plus slack for created_at
	j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 10 * size})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, Flushers: 1, JournalReserve: 0.25, Logger: quiet})
	var err2 error
	recorded := 0
	for i := 0; i < 20; i++ {
		ev := ledger.UsageEvent{ID: newID(), Org: "acme", Model: "m", Cost: 3}
		if err2 = r.Record(context.Background(), ev); err2 != nil {
			break
		}
		recorded++
		if recorded <= 6 && r.Degraded() {
			t.Fatalf("degraded after %d of 10 events", recorded)
		}
	}
	if !errors.Is(err2, accounting.ErrJournalFull) || !errors.Is(err2, ledger.ErrLedgerUnavailable) {
		t.Fatalf("record into a full journal: %v", err2)
	}
	if !r.Degraded() || recorded < 8 || recorded > 10 {
		t.Fatalf("degraded %v after %d events recorded", r.Degraded(), recorded)
	}
	if st := r.Stats(); st.JournalFull != 1 || st.Journaled != int64(recorded) {
		t.Fatalf("stats: %+v", st)
	}
}

// TestRecorderJournalPostgresOutage: the same outage on a real, private Postgres that is
// stopped and started: its errors are recognised as ErrLedgerUnavailable, the batch is
// journaled, and it is replayed exactly once when the server is back.
func TestRecorderJournalPostgresOutage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testutil.StartPostgresServer(t)
	pg, err := pgledger.Open(ctx, srv.URL(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	env := testutil.Redis(t)
	l := newDownLedger(pg) // never switched off: the outage is the real server's
	store := newStore(t, env, l, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	const n = 20
	evs := journalSetup(t, store, w, l, "acme", n)
	j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, Pinner: store, ReplayInterval: 100 * time.Millisecond, UnpinDelay: 20 * time.Millisecond,
		Timeout: 2 * time.Second, Logger: quiet})

	srv.Stop()
	recordEach(t, r, evs)
	if j.Len() != n {
		t.Fatalf("journal has %d events, want %d", j.Len(), n)
	}
	waitFor(t, "pins", func() bool { st, _ := store.State(ctx, "acme"); return st.Pinned == n })
	srv.Start()
	waitFor(t, "the replay", func() bool { return j.Len() == 0 })
	waitFor(t, "unpins", func() bool { st, _ := store.State(ctx, "acme"); return st.Pinned == 0 })
	if err := w.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	acct, err := pg.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	st, _ := store.State(ctx, "acme")
	if want := int64(1000 - 3*n); acct.Balance != want || st.Balance != want || st.Holds != 0 {
		t.Fatalf("ledger %d, hot %+v; want %d", acct.Balance, st, want)
	}
	for _, ev := range evs {
		if c := l.timesStored(ev.ID); c != 1 {
			t.Fatalf("event stored %d times, want 1", c)
		}
	}
}

// countingPinner counts the pins of each hold (the first, then the heartbeat's).
type countingPinner struct {
	accounting.Pinner
	mu   sync.Mutex
	pins map[string]int
}

func (p *countingPinner) Pin(ctx context.Context, org, holdID string) (bool, error) {
	ok, err := p.Pinner.Pin(ctx, org, holdID)
	if err == nil {
		p.mu.Lock()
		if p.pins == nil {
			p.pins = map[string]int{}
		}
		p.pins[holdID]++
		p.mu.Unlock()
	}
	return ok, err
}

// least returns the fewest pins of any of evs' holds.
func (p *countingPinner) least(evs []ledger.UsageEvent) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	least := -1
	for _, ev := range evs {
		if n := p.pins[ev.ID]; least < 0 || n < least {
			least = n
		}
	}
	return least
}

// redisMillis reads the Redis server's clock (the one the scripts' expiries are on), in ms.
func redisMillis(t *testing.T, env *testutil.RedisEnv) int64 {
	t.Helper()
	now, err := env.Client.Time(context.Background()).Result()
	if err != nil {
		t.Fatalf("redis TIME: %v", err)
	}
	return now.UnixMilli()
}
