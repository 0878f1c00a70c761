package accounting_test

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// countingStore counts the recorder's writes by kind, each write slowed by delay so that
// concurrent events pile up into batches.
type countingStore struct {
	ledger.QuietUsageStore
	delay         time.Duration
	loud, quietly atomic.Int64
}

func (c *countingStore) RecordUsage(ctx context.Context, events []ledger.UsageEvent) error {
	c.loud.Add(1)
	time.Sleep(c.delay)
	return c.QuietUsageStore.RecordUsage(ctx, events)
}

func (c *countingStore) RecordUsageQuiet(ctx context.Context, events []ledger.UsageEvent) error {
	c.quietly.Add(1)
	time.Sleep(c.delay)
	return c.QuietUsageStore.RecordUsageQuiet(ctx, events)
}

// TestRecorderWakesWorker: a recorder with Wake writes every batch quietly and wakes the worker
// once per batch (not per event), and that wake alone gets the usage accounted and settled: the
// worker hears no NOTIFY of it and its sweep is an hour away.
func TestRecorderWakesWorker(t *testing.T) {
	t.Parallel()
	eachBackend(t, func(t *testing.T, env *testutil.RedisEnv, l ledger.Ledger) {
		ctx := context.Background()
		store := newStore(t, env, l, balance.Config{})
		w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet, SweepInterval: time.Hour})
		const org, n = "wakeme", 12
		// Funded and settled before the worker listens: no notification of it can start a pass.
		evs := journalSetup(t, store, w, l, org, n)
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = w.Stop(context.Background()) })
		var wakes atomic.Int64
		cs := &countingStore{QuietUsageStore: l.(ledger.QuietUsageStore), delay: 20 * time.Millisecond}
		r, err := accounting.NewRecorder(cs, &accounting.RecorderConfig{Logger: quiet, Wake: func() {
			wakes.Add(1)
			w.Wake()
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = r.Stop(context.Background()) })
		recordEach(t, r, evs)
		batches := cs.quietly.Load()
		if cs.loud.Load() != 0 || batches == 0 || batches >= n {
			t.Fatalf("%d notifying and %d quiet writes for %d events; want only quiet ones, in fewer batches than events", cs.loud.Load(), batches, n)
		}
		if got := wakes.Load(); got != batches {
			t.Fatalf("%d wakes for %d batches", got, batches)
		}
		waitFor(t, "the woken worker to settle the usage", func() bool {
			st, err := store.State(ctx, org)
			return err == nil && st.Watermark == n+1 && st.Holds == 0
		})
		if st, _ := store.State(ctx, org); st.Balance != 1000-3*n {
			t.Fatalf("hot balance %+v, want %d", st, 1000-3*n)
		}
	})
}

// TestRecorderWakeReplay: with Wake, a batch that goes straight to the journal (ledger down)
// wakes nothing, and the replay that stores it wakes the worker.
func TestRecorderWakeReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l := newDownLedger(memledger.New())
	j, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	var wakes atomic.Int64
	r := startRecorder(t, l, accounting.RecorderConfig{Journal: j, ReplayInterval: 20 * time.Millisecond, Logger: quiet,
		Wake: func() { wakes.Add(1) }})
	l.down.Store(true)
	if err := r.Record(ctx, usage("o")); err != nil { // the ledger fails it: journaled
		t.Fatal(err)
	}
	before := wakes.Load()
	ev := usage("o")
	if err := r.Record(ctx, ev); err != nil { // straight to the journal
		t.Fatal(err)
	}
	if j.Len() != 2 || wakes.Load() != before {
		t.Fatalf("journal %d events, wakes %d → %d: a journaled batch woke the worker", j.Len(), before, wakes.Load())
	}
	l.down.Store(false)
	waitFor(t, "the replay", func() bool { return j.Len() == 0 && l.timesStored(ev.ID) == 1 })
	waitFor(t, "the replay's wake", func() bool { return wakes.Load() > before })
}

// TestRecordUsageQuietSendsNoNotify listens on the ledger's channel itself: a recorder without
// Wake notifies the usage's org; with Wake the insert sends nothing, while a credit still does.
func TestRecordUsageQuietSendsNoNotify(t *testing.T) {
	t.Parallel()
	l, env := testutil.PostgresLedger(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*waitLimit) // bounds a hang of the whole test
	defer cancel()
	conn := listenRaw(ctx, t, env)
	for _, org := range []string{"loud", "quiet", "c1", "c2"} {
		if err := l.CreateOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
	}
	record := func(org string, wake func()) {
		r := startRecorder(t, l, accounting.RecorderConfig{Logger: quiet, Wake: wake})
		recordAll(t, r, 5, org)
		if err := r.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// The control: without Wake the usage's NOTIFY arrives before the credit's.
	record("loud", nil)
	credit(ctx, t, l, "c1")
	if got := nextNotes(ctx, t, conn, "c1"); len(got) == 0 || got[0] != "loud" {
		t.Fatalf("notifications %q, want loud before c1", got)
	}
	var wakes atomic.Int64
	record("quiet", func() { wakes.Add(1) })
	credit(ctx, t, l, "c2")
	if got := nextNotes(ctx, t, conn, "c2"); len(got) != 0 {
		t.Fatalf("notifications %q before the credit's: the quiet usage notified", got)
	}
	if wakes.Load() == 0 {
		t.Fatal("the recorder never called Wake")
	}
	if n, err := l.AccountPending(ctx, 100); err != nil || n != 10 {
		t.Fatalf("accounted %d events (%v), want 10", n, err)
	}
}

// TestPostgresDropsOwnPassNotify: two ledgers opened on one schema (two processes). The NOTIFY
// of an account pass reaches the other ledger's Subscribe, with the org first in its payload,
// but not the subscription of the ledger that ran the pass; a seed's, a credit's and a usage
// NOTIFY reach both.
func TestPostgresDropsOwnPassNotify(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*waitLimit) // bounds a hang of the whole test
	defer cancel()
	open := func() *pgledger.Ledger {
		l, err := pgledger.Open(ctx, env.URL, &pgledger.Config{Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		return l
	}
	l1, l2 := open(), open()
	raw := listenRaw(ctx, t, env)
	sub1, err := l1.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	sub2, err := l2.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, org := range []string{"pass", "seed", "done"} {
		if err := l1.CreateOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
	}
	quietUsage := func(org string) {
		ev := ledger.UsageEvent{ID: newID(), Org: org, Model: "m", Cost: 1}
		if err := l1.RecordUsageQuiet(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
	}
	quietUsage("pass")
	if r, err := l1.AccountPass(ctx, 10); err != nil || r.Accounted != 1 {
		t.Fatalf("pass %+v, %v", r, err)
	}
	quietUsage("seed")
	if _, err := l1.Snapshot(ctx, "seed"); err != nil { // accounts the pending usage: the seed's charge
		t.Fatal(err)
	}
	if err := l1.RecordUsage(ctx, []ledger.UsageEvent{{ID: newID(), Org: "seed", Model: "m", Cost: 1}}); err != nil {
		t.Fatal(err)
	}
	credit(ctx, t, l1, "done")

	raws := nextNotes(ctx, t, raw, "done")
	if len(raws) != 3 || !strings.HasPrefix(raws[0], "pass ") || raws[1] != "seed" || raws[2] != "seed" {
		t.Fatalf("raw payloads %q: want the pass's tagged (\"pass <tag>\"), then the seed's and the usage's plain", raws)
	}
	if got := drainUntil(ctx, t, sub1, "done"); strings.Join(got, ",") != "seed,seed" {
		t.Fatalf("the pass's own ledger heard %q before the credit, want seed,seed (its pass left out)", got)
	}
	if got := drainUntil(ctx, t, sub2, "done"); strings.Join(got, ",") != "pass,seed,seed" {
		t.Fatalf("the other ledger heard %q before the credit, want pass,seed,seed", got)
	}
	// A ledger on a pool of the caller's (no tag) still hears its own passes.
	l3, err := pgledger.New(env.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	sub3, err := l3.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := l3.RecordUsageQuiet(ctx, []ledger.UsageEvent{{ID: newID(), Org: "pass", Model: "m", Cost: 1}}); err != nil {
		t.Fatal(err)
	}
	// The pass also accounts the (loud) usage of "seed" that no pass has taken yet.
	if n, err := l3.AccountPending(ctx, 10); err != nil || n != 2 {
		t.Fatalf("accounted %d, %v", n, err)
	}
	credit(ctx, t, l3, "done")
	got := drainUntil(ctx, t, sub3, "done")
	if slices.Sort(got); strings.Join(got, ",") != "pass,seed" {
		t.Fatalf("an untagged ledger heard %q before the credit, want its own pass's orgs", got)
	}
}

// credit credits org 1 with a new reference.
func credit(ctx context.Context, t *testing.T, l ledger.Ledger, org string) {
	t.Helper()
	if _, _, err := l.Credit(ctx, org, 1, newID()); err != nil {
		t.Fatal(err)
	}
}

// listenRaw LISTENs, on a connection of its own, on the channel of env's schema.
func listenRaw(ctx context.Context, t *testing.T, env *testutil.PostgresEnv) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, env.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	var channel string
	if err := conn.QueryRow(ctx, `SELECT 'escrow_' || left(md5(current_schema()), 16)`).Scan(&channel); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	return conn
}

// nextNotes returns the payloads conn receives before the first that is last (Postgres delivers
// in commit order).
func nextNotes(ctx context.Context, t *testing.T, conn *pgx.Conn, last string) []string {
	t.Helper()
	var got []string
	for {
		wctx, cancel := context.WithTimeout(ctx, waitLimit)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		if err != nil {
			t.Fatalf("after %q, waiting for %q: %v", got, last, err)
		}
		if n.Payload == last {
			return got
		}
		got = append(got, n.Payload)
	}
}

// drainUntil returns the orgs a subscription delivers before the first that is last.
func drainUntil(ctx context.Context, t *testing.T, ch <-chan string, last string) []string {
	t.Helper()
	var got []string
	for {
		select {
		case org, ok := <-ch:
			if !ok {
				t.Fatalf("subscription closed after %q", got)
			}
			if org == last {
				return got
			}
			got = append(got, org)
		case <-time.After(waitLimit):
			t.Fatalf("after %q: no notification for %q", got, last)
		case <-ctx.Done():
			t.Fatal(ctx.Err())
		}
	}
}
