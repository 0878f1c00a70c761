package accounting_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/migrations"
)

// stmtCounter is a pgx tracer that counts the ledger's statements by kind and its round trips
// (a query, or a whole pipelined batch).
type stmtCounter struct {
	mu         sync.Mutex
	on         bool
	byKind     map[string]int
	roundTrips int
	statements int
}

func (c *stmtCounter) count(sql string, batch bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.on {
		return
	}
	c.byKind[stmtKind(sql)]++
	c.statements++
	if !batch {
		c.roundTrips++
	}
}

func (c *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.count(d.SQL, false)
	return ctx
}
func (c *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *stmtCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.mu.Lock()
	if c.on {
		c.roundTrips++
	}
	c.mu.Unlock()
	return ctx
}
func (c *stmtCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.count(d.SQL, true)
}
func (c *stmtCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// stmtKind names a statement by what it does, for the table.
func stmtKind(sql string) string {
	s := strings.Join(strings.Fields(sql), " ")
	for _, k := range []struct{ sub, name string }{
		{"hashtext(l.org_id)", "record: lock orgs (rows, advisory)"},
		{"INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id) SELECT org, seq", "record: events + entries + accounts + notify"},
		{"INSERT INTO usage_events", "record (event insert)"},
		{"SET settled_seq", "mark settled"},
		{"UPDATE accounts a SET balance", "account: write charges (entries, accounts, events)"},
		{"status = 'pending' ORDER BY created_at LIMIT", "account: discover pending"},
		{"FOR UPDATE SKIP LOCKED", "account: lock/claim"},
		{"pg_try_advisory_xact_lock", "account: advisory locks"},
		{"FROM unnest($1::text[]) AS o WHERE", "account: advisory locks"},
		{"pg_notify", "notify"},
		{"settled_seq < ledger_seq", "orgs to settle"},
		{"FROM ledger_entries l LEFT JOIN usage_events", "unsettled entries"},
		{"FROM ledger_entries", "entries"},
		{"FOR UPDATE", "lock accounts"},
	} {
		if strings.Contains(s, k.sub) {
			return k.name
		}
	}
	if len(s) > 40 {
		s = s[:40]
	}
	return strings.ToLower(s)
}

// TestLedgerStatementsPerEvent counts the Postgres statements and round trips the ledger path
// (recorder → accounting → settle, with the worker woken by NOTIFY) spends per usage event, one
// request at a time and at load, on real Redis and Postgres. The counts are logged (see
// docs/performance.md) and bounded, so a change that brings back per-event statements fails.
func TestLedgerStatementsPerEvent(t *testing.T) {
	if testing.Short() {
		t.Skip("counts statements on real services")
	}
	for _, tc := range []struct {
		name       string
		orgs, conc int
		events     int
		maxStmts   float64 // statements per event, at most
		maxRTs     float64 // round trips per event, at most
	}{
		// Before the recorder wrote entries itself: c1 7.5 statements and 7.1 round trips per
		// event (three write transactions); c32 0.77 and 0.77. After: c1 3.2 and 2.2 (one write
		// transaction, plus a grouped mark every 100 ms); c32 0.20 and 0.14.
		{"c1", 10, 1, 200, 3.5, 2.5},
		{"c32-100orgs", 100, 32, 3000, 0.5, 0.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			env := testutil.RealRedis(t)
			pg := testutil.Postgres(t)
			if _, err := migrations.Up(ctx, pg.Pool); err != nil {
				t.Fatal(err)
			}
			cfg, err := pgxpool.ParseConfig(pg.URL)
			if err != nil {
				t.Fatal(err)
			}
			ctr := &stmtCounter{byKind: map[string]int{}}
			cfg.ConnConfig.Tracer = ctr
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			l := accounting.NewPostgres(pool, nil)
			defer l.Close()
			store := newStore(t, env, l, balance.Config{MaxInFlight: 1 << 20})
			w := accounting.NewWorker(l, store, &accounting.WorkerConfig{Logger: quiet})
			orgs := make([]string, tc.orgs)
			for i := range orgs {
				orgs[i] = fmt.Sprintf("org%d", i)
				if err := l.CreateOrg(ctx, orgs[i]); err != nil {
					t.Fatal(err)
				}
				if _, _, err := w.Credit(ctx, orgs[i], 1e12, "seed-"+orgs[i]); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer w.Stop(ctx)
			r := startRecorder(t, l, accounting.RecorderConfig{Finisher: store, Logger: quiet})
			time.Sleep(50 * time.Millisecond) // the LISTEN connection is up
			ctr.mu.Lock()
			ctr.on = true
			ctr.mu.Unlock()

			var wg sync.WaitGroup
			next := make(chan int)
			for range tc.conc {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range next {
						ev := accounting.UsageEvent{ID: newID(), Org: orgs[i%len(orgs)], Model: "m", Cost: 7, HoldAmount: 10}
						if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: ev.Org, HoldID: ev.ID, Amount: 10}); err != nil {
							t.Error(err)
							return
						}
						if err := r.Record(ctx, ev); err != nil {
							t.Error(err)
							return
						}
						if tc.conc == 1 {
							// One request at a time, as with wrk -c1: the worker keeps up.
							time.Sleep(2 * time.Millisecond)
						}
					}
				}()
			}
			for i := range tc.events {
				next <- i
			}
			close(next)
			wg.Wait()
			// Settled by the worker's own loop (NOTIFY), not by a Drain.
			deadline := time.Now().Add(30 * time.Second)
			for _, o := range orgs {
				for {
					st, err := store.State(ctx, o)
					if err != nil {
						t.Fatal(err)
					}
					if st.Holds == 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("org %s not settled: %+v", o, st)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			time.Sleep(20 * time.Millisecond) // the last marks
			ctr.mu.Lock()
			ctr.on = false
			kinds := slices.Sorted(maps.Keys(ctr.byKind))
			var b strings.Builder
			for _, k := range kinds {
				fmt.Fprintf(&b, "\n  %-45s %6d  %.3f/event", k, ctr.byKind[k], float64(ctr.byKind[k])/float64(tc.events))
			}
			stmts := float64(ctr.statements) / float64(tc.events)
			rts := float64(ctr.roundTrips) / float64(tc.events)
			ctr.mu.Unlock()
			t.Logf("%s: %d events: %.2f statements/event, %.2f round trips/event%s", tc.name, tc.events, stmts, rts, b.String())
			if stmts > tc.maxStmts || rts > tc.maxRTs {
				t.Fatalf("%.2f statements and %.2f round trips per event, want ≤ %.1f and ≤ %.1f", stmts, rts, tc.maxStmts, tc.maxRTs)
			}
		})
	}
}

var _ pgx.BatchTracer = (*stmtCounter)(nil)
