package pgledger_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/pricing"
)

// pendingEvents makes n usage events of the orgs in turn, each costing 1 … n.
func pendingEvents(n int, orgs ...string) []ledger.UsageEvent {
	evs := make([]ledger.UsageEvent, n)
	t0 := time.Now().Add(-time.Hour)
	for i := range evs {
		evs[i] = ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: orgs[i%len(orgs)], KeyID: "k", Model: "m",
			Usage: pricing.Usage{Prompt: 10, Completion: 5}, Cost: int64(i + 1), HoldAmount: 100, CreatedAt: t0.Add(time.Duration(i) * time.Millisecond)}
	}
	return evs
}

// accountAll runs account passes until one finds nothing pending.
func accountAll(t *testing.T, l *pgledger.Ledger) {
	t.Helper()
	for {
		r, err := l.AccountPass(context.Background(), 1000)
		if err != nil {
			t.Fatal(err)
		}
		if r.Accounted == 0 {
			return
		}
	}
}

// TestPendingOldestFirst: whichever way a batch is recorded (the statement below minCopy
// events, COPY from it on), the pass charges an org's events oldest first: seq follows
// created_at even for a batch sent newest first.
func TestPendingOldestFirst(t *testing.T) {
	t.Parallel()
	for _, n := range []int{5, 40} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			t.Parallel()
			l, _ := testutil.PostgresLedger(t)
			ctx := context.Background()
			if err := l.CreateOrg(ctx, "o"); err != nil {
				t.Fatal(err)
			}
			evs := pendingEvents(n, "o")
			newestFirst := slices.Clone(evs)
			slices.Reverse(newestFirst)
			if err := l.RecordUsage(ctx, newestFirst); err != nil {
				t.Fatal(err)
			}
			accountAll(t, l)
			for i, ev := range evs {
				if r, err := l.Request(ctx, ev.ID); err != nil || r.Seq != int64(i+1) {
					t.Fatalf("event %d of %d (oldest first): %+v, %v; want seq %d", i, n, r, err, i+1)
				}
			}
		})
	}
}

// checkExactlyOnce checks that every event of evs has exactly one charge entry, with its cost,
// that the accounts add up to their entries, that nothing is left in the queue, and that
// UnsettledUsage reports every event as unsettled until the marks (none were made here).
func checkExactlyOnce(t *testing.T, l *pgledger.Ledger, evs []ledger.UsageEvent) {
	t.Helper()
	ctx := context.Background()
	var entries, distinct, pending int64
	if err := l.Pool().QueryRow(ctx, `SELECT count(*), count(DISTINCT hold_id), (SELECT coalesce(sum(n), 0) FROM usage_pending)
		FROM ledger_entries WHERE kind = 'charge'`).Scan(&entries, &distinct, &pending); err != nil {
		t.Fatal(err)
	}
	if entries != int64(len(evs)) || distinct != entries || pending != 0 {
		t.Fatalf("%d charge entries (%d hold ids) for %d events, %d still queued", entries, distinct, len(evs), pending)
	}
	byOrg := map[string][]string{}
	want := map[string]int64{}
	for _, ev := range evs {
		byOrg[ev.Org] = append(byOrg[ev.Org], ev.ID)
		want[ev.Org] -= ev.Cost
		r, err := l.Request(ctx, ev.ID)
		if err != nil || r.Status != ledger.RequestAccounted || r.Seq == 0 {
			t.Fatalf("request %s: %+v, %v", ev.ID, r, err)
		}
	}
	for org, ids := range byOrg {
		a, err := l.Account(ctx, org)
		if err != nil || a.Balance != want[org] || a.LedgerSeq != int64(len(ids)) || a.Pending != 0 {
			t.Fatalf("account %s: %+v (%v), want balance %d, %d entries", org, a, err, want[org], len(ids))
		}
		un, err := l.UnsettledUsage(ctx, org, ids)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			if !un[id] {
				t.Fatalf("event %s accounted but not settled: not reported unsettled", id)
			}
		}
	}
}

// TestPendingCutBetweenSteps cuts the write path of usage between each two of its steps — the
// events written / their queue row / the entries / the accounts / the queue row taken out / the
// commit — in the recorder's statement, the account pass (large and small: COPY and INSERT) and a
// seed's snapshot, by a fault that fails that step (the transaction is cut there, as when the
// process or its connection dies). After each cut the ledger is as before the cut transaction,
// and the next attempt accounts every event exactly once.
func TestPendingCutBetweenSteps(t *testing.T) {
	t.Parallel()
	cuts := []struct {
		name, sql string
	}{
		// The recorder's statement: the events are written, then their queue row.
		{"queue row", `CREATE TRIGGER cut BEFORE INSERT ON usage_pending FOR EACH ROW EXECUTE FUNCTION cut()`},
		// The pass: entries, then accounts, then the queue rows, then the commit.
		{"entry", `CREATE TRIGGER cut AFTER INSERT ON ledger_entries FOR EACH ROW EXECUTE FUNCTION cut()`},
		{"account", `CREATE TRIGGER cut BEFORE UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION cut()`},
		{"dequeue", `CREATE TRIGGER cut BEFORE DELETE OR UPDATE ON usage_pending FOR EACH ROW EXECUTE FUNCTION cut()`},
		{"commit", `CREATE CONSTRAINT TRIGGER cut AFTER INSERT ON ledger_entries DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION cut()`},
	}
	for _, size := range []int{5, 80} { // below and above minCopy
		for _, snapshot := range []bool{false, true} {
			for _, cut := range cuts {
				name := fmt.Sprintf("%s/size=%d/snapshot=%v", cut.name, size, snapshot)
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					l, env := testutil.PostgresLedger(t)
					ctx := context.Background()
					for _, o := range []string{"a", "b", "c"} {
						if err := l.CreateOrg(ctx, o); err != nil {
							t.Fatal(err)
						}
					}
					if _, err := env.Pool.Exec(ctx, `CREATE FUNCTION cut() RETURNS trigger LANGUAGE plpgsql AS $$
						BEGIN RAISE EXCEPTION 'cut here'; END $$`); err != nil {
						t.Fatal(err)
					}
					fault := func(on bool) {
						t.Helper()
						q := `DROP TRIGGER IF EXISTS cut ON usage_pending; DROP TRIGGER IF EXISTS cut ON ledger_entries; DROP TRIGGER IF EXISTS cut ON accounts`
						if on {
							q = cut.sql
						}
						if _, err := env.Pool.Exec(ctx, q); err != nil {
							t.Fatal(err)
						}
					}
					evs := pendingEvents(size, "a", "b", "c")
					if cut.name == "queue row" {
						// The events and their queue row are one statement: cut, neither is there.
						fault(true)
						if err := l.RecordUsage(ctx, evs); err == nil || !strings.Contains(err.Error(), "cut here") {
							t.Fatalf("record with the cut: %v", err)
						}
						var n int
						if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM usage_events`).Scan(&n); err != nil || n != 0 {
							t.Fatalf("%d events stored by a cut record (%v)", n, err)
						}
						fault(false)
						if err := l.RecordUsage(ctx, evs); err != nil {
							t.Fatal(err)
						}
						if err := l.RecordUsage(ctx, evs); err != nil { // the retry of a record that did land
							t.Fatal(err)
						}
					} else {
						if err := l.RecordUsage(ctx, evs); err != nil {
							t.Fatal(err)
						}
						fault(true)
						var err error
						if snapshot {
							_, err = l.Snapshot(ctx, "b")
						} else {
							_, err = l.AccountPass(ctx, 1000)
						}
						if err == nil || !strings.Contains(err.Error(), "cut here") {
							t.Fatalf("cut pass: %v", err)
						}
						if a, err := l.Account(ctx, "b"); err != nil || a.LedgerSeq != 0 || a.Pending == 0 {
							t.Fatalf("after the cut: %+v, %v", a, err)
						}
						fault(false)
					}
					if snapshot {
						if _, err := l.Snapshot(ctx, "b"); err != nil {
							t.Fatal(err)
						}
					}
					accountAll(t, l)
					checkExactlyOnce(t, l, evs)
				})
			}
		}
	}
}

// TestPendingConcurrentPassesAndSnapshots: account passes (of a few events each, so that they
// take part of a queue row and rewrite the rest) and snapshots of single orgs (which wait for
// the passes' claims and read the rows the passes rewrote) run together while batches are
// recorded; every event is accounted exactly once.
func TestPendingConcurrentPassesAndSnapshots(t *testing.T) {
	t.Parallel()
	l, _ := testutil.PostgresLedger(t)
	ctx := context.Background()
	orgs := []string{"a", "b", "c", "d", "e"}
	for _, o := range orgs {
		if err := l.CreateOrg(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	evs := pendingEvents(2000, orgs...)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	done := make(chan struct{})
	wg.Add(1)
	go func() { // the recorder: batches of 1 to 60 (INSERT and COPY)
		defer wg.Done()
		defer close(done)
		for i := 0; i < len(evs); {
			n := min(1+rand.IntN(60), len(evs)-i)
			if err := l.RecordUsage(ctx, evs[i:i+n]); err != nil {
				errs <- err
				return
			}
			i += n
		}
	}()
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				var err error
				if w == 0 {
					_, err = l.Snapshot(ctx, orgs[rand.IntN(len(orgs))])
				} else {
					_, err = l.AccountPass(ctx, 1+rand.IntN(40))
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	accountAll(t, l)
	checkExactlyOnce(t, l, evs)
}

// TestPendingMigration: events pending when migration 016 runs stay pending (queued) and are
// accounted once; events accounted before it keep their status and seq; an event a process
// still running the code from before the migration inserts as 'pending' is queued by the trigger.
func TestPendingMigration(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	migrateBefore(t, env.Pool, "_usage_pending.up.sql")
	// The old shape: two accounted events of org a (seq 1, 2) with their entries, three pending
	// ones of a and b, and a voided one.
	if _, err := env.Pool.Exec(ctx, `
INSERT INTO accounts (org_id, balance, ledger_seq, settled_seq) VALUES ('a', -3, 2, 2), ('b', 0, 0, 0);
INSERT INTO usage_events (id, org_id, model, cost, status, seq, created_at) VALUES
	('0192f0c4-0000-7000-8000-000000000001', 'a', 'm', 1, 'accounted', 1, now() - interval '5 min'),
	('0192f0c4-0000-7000-8000-000000000002', 'a', 'm', 2, 'accounted', 2, now() - interval '4 min'),
	('0192f0c4-0000-7000-8000-000000000003', 'a', 'm', 4, 'pending', NULL, now() - interval '3 min'),
	('0192f0c4-0000-7000-8000-000000000004', 'b', 'm', 8, 'pending', NULL, now() - interval '2 min'),
	('0192f0c4-0000-7000-8000-000000000005', 'a', 'm', 16, 'pending', NULL, now() - interval '1 min'),
	('0192f0c4-0000-7000-8000-000000000006', 'a', 'm', 32, 'voided', NULL, now());
INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id) VALUES
	('a', 1, -1, 'charge', '0192f0c4-0000-7000-8000-000000000001'), ('a', 2, -2, 'charge', '0192f0c4-0000-7000-8000-000000000002')`); err != nil {
		t.Fatal(err)
	}
	l := migrateRest(t, env.Pool)
	// The code from before: a plain insert of a pending event.
	if _, err := env.Pool.Exec(ctx, `INSERT INTO usage_events (id, org_id, model, cost, status) VALUES
		('0192f0c4-0000-7000-8000-000000000007', 'b', 'm', 64, 'pending')`); err != nil {
		t.Fatal(err)
	}
	if a, err := l.Account(ctx, "a"); err != nil || a.Pending != 2 {
		t.Fatalf("a after the migration: %+v, %v; want 2 pending", a, err)
	}
	if r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000002"); err != nil || r.Status != ledger.RequestAccounted || r.Seq != 2 {
		t.Fatalf("an event accounted before: %+v, %v", r, err)
	}
	if r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000003"); err != nil || r.Status != ledger.RequestPending {
		t.Fatalf("an event pending before: %+v, %v", r, err)
	}
	if n, err := l.AccountPending(ctx, 100); err != nil || n != 4 {
		t.Fatalf("AccountPending = %d, %v; want 4", n, err)
	}
	if n, err := l.AccountPending(ctx, 100); err != nil || n != 0 {
		t.Fatalf("second AccountPending = %d, %v", n, err)
	}
	a, _ := l.Account(ctx, "a")
	b, _ := l.Account(ctx, "b")
	if a.Balance != -23 || a.LedgerSeq != 4 || b.Balance != -72 || b.LedgerSeq != 2 {
		t.Fatalf("after accounting: a %+v b %+v", a, b)
	}
	if r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000005"); err != nil || r.Status != ledger.RequestAccounted || r.Seq != 4 {
		t.Fatalf("an event pending before, accounted after: %+v, %v", r, err)
	}
	if r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000006"); err != nil || r.Status != ledger.RequestVoided {
		t.Fatalf("the voided event: %+v, %v", r, err)
	}
}

// migrateBefore applies every migration before the one whose file name ends in suffix (a test
// of that migration writes the old shape, then migrates the rest with migrations.Up).
func migrateBefore(t *testing.T, pool *pgxpool.Pool, suffix string) {
	t.Helper()
	all, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(all, func(m migrations.Migration) bool { return strings.HasSuffix(m.Name, suffix) })
	if i < 0 {
		t.Fatalf("no migration named *%s", suffix)
	}
	if _, err := migrations.Apply(context.Background(), pool, all[:i]); err != nil {
		t.Fatal(err)
	}
}

// migrateRest applies the migrations migrateBefore left out (and any other pending) and opens a
// ledger on the migrated schema.
func migrateRest(t *testing.T, pool *pgxpool.Pool) *pgledger.Ledger {
	t.Helper()
	if _, err := migrations.Up(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	l, err := pgledger.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
