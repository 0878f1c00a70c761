package pgledger_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

func TestPostgresLedger(t *testing.T) {
	t.Parallel()
	ledgertest.Run(t, func(t *testing.T) ledger.Ledger {
		l, _ := testutil.PostgresLedger(t)
		return l
	})
}

func TestOpenPostgresMigrates(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	l, err := pgledger.Open(ctx, env.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	e1, err := l.Epoch(ctx)
	if err != nil || e1.Gen != 1 || len(e1.ID) != 32 {
		t.Fatalf("epoch %+v, %v", e1, err)
	}
	// A second ledger on the same schema is the same ledger: same epoch, migrations a no-op.
	l2, err := pgledger.Open(ctx, env.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if e2, _ := l2.Epoch(ctx); e2 != e1 {
		t.Fatalf("epochs %v and %v", e1, e2)
	}
	// Another schema is another ledger with its own random epoch.
	l3, _ := testutil.PostgresLedger(t)
	if e3, _ := l3.Epoch(ctx); e3 == e1 {
		t.Fatalf("two schemas share epoch %v", e1)
	}
}

func TestPostgresUnavailable(t *testing.T) {
	t.Parallel()
	// Nothing listens on port 1: no Postgres is needed until the last check.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := pgledger.Open(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2", nil)
	if !errors.Is(err, ledger.ErrLedgerUnavailable) {
		t.Fatalf("Open on a closed port: %v; want ErrLedgerUnavailable", err)
	}
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	l, err := pgledger.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Snapshot(ctx, "o"); !errors.Is(err, ledger.ErrLedgerUnavailable) {
		t.Fatalf("Snapshot: %v; want ErrLedgerUnavailable", err)
	}
	if err := l.RecordUsage(ctx, []ledger.UsageEvent{{ID: ledgertest.NewEventID(), Org: "o", Model: "m"}}); !errors.Is(err, ledger.ErrLedgerUnavailable) ||
		!errors.Is(err, ledger.ErrNotRecorded) {
		t.Fatalf("RecordUsage: %v; want ErrLedgerUnavailable and ErrNotRecorded (no connection: certainly not stored)", err)
	}
	// A query error is not unavailability.
	good, _ := testutil.PostgresLedger(t)
	if _, err := good.Pool().Exec(ctx, "SELECT 1/0"); ledger.Unavailable(err) {
		t.Fatalf("division by zero counted as unavailable: %v", err)
	}
}

// TestPostgresQueryPlans checks with EXPLAIN that the worker's and the seeder's queries use the
// indexes (no sequential scan of usage_events or ledger_entries), on a table big enough that the
// planner prefers them.
func TestPostgresQueryPlans(t *testing.T) {
	t.Parallel()
	l, env := testutil.PostgresLedger(t)
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, `
INSERT INTO accounts (org_id, ledger_seq, settled_seq) SELECT 'o' || g, 100, 100 FROM generate_series(1, 200) g;
INSERT INTO ledger_entries (org_id, seq, delta, kind)
	SELECT 'o' || (g % 200 + 1), g / 200 + 1, -1, 'charge' FROM generate_series(0, 19999) g;
INSERT INTO usage_events (id, org_id, model, cost, status, seq)
	SELECT gen_random_uuid(), 'o' || (g % 200 + 1), 'm', 1, 'accounted', g FROM generate_series(1, 20000) g;
ANALYZE accounts, ledger_entries, usage_events`) // this schema's tables only: a bare ANALYZE reaches every test's schema
	if err != nil {
		t.Fatal(err)
	}
	_ = l
	for name, q := range map[string]string{
		"entries after":   `SELECT seq, delta, hold_id FROM ledger_entries WHERE org_id = 'o7' AND seq > 50 ORDER BY seq LIMIT 100`,
		"unsettled usage": `SELECT l.hold_id::text FROM accounts a JOIN ledger_entries l ON l.org_id = a.org_id AND l.seq > a.settled_seq WHERE a.org_id = 'o7' AND l.kind = 'charge' AND l.hold_id = ANY ('{0192f0c4-0000-7000-8000-000000000001,0192f0c4-0000-7000-8000-000000000002}'::uuid[])`,
		"pending rows":    strings.ReplaceAll(pgledger.SQLPendingRows, "$1", "1000"),
		// both its reads of an end user's charges (the tail, and the sum without a window row)
		"end user used": strings.NewReplacer("$1", "'o7'", "$2", "'alice'", "$3::bigint[]", "'{1}'::bigint[]", "$4::text[]", "'{money}'::text[]",
			"$5", "50").Replace(pgledger.SQLEndUserUsed),
	} {
		p := explain(ctx, t, env.Pool, name, q)
		if strings.Contains(p, "Seq Scan on usage_events") || strings.Contains(p, "Seq Scan on ledger_entries") {
			t.Errorf("%s: sequential scan:\n%s", name, p)
		}
	}
	// The account pass's and the batched settle's statements, with literal arguments.
	orgs := `'{o7,o8,o9}'::text[]`
	for name, q := range map[string]string{
		"unsettled of": strings.NewReplacer("$1::text[]", orgs, "$2", "500").Replace(pgledger.SQLUnsettledOf),
		"lock":         strings.NewReplacer("$1::text[]", orgs).Replace(pgledger.SQLLockAccounts),
		"claim":        strings.NewReplacer("$1::bigint[]", `'{1,2,3}'::bigint[]`, "$2::text[]", orgs).Replace(pgledger.SQLClaimPass),
		"claim of org": strings.NewReplacer("$1::text[]", `'{o7}'::text[]`, "$2::text[]", `'{o7}'::text[]`).Replace(pgledger.SQLClaimOrg),
		"limits":       strings.NewReplacer("$1::text[]", orgs).Replace(pgledger.SQLChargeLimits),
	} {
		tx, err := env.Pool.Begin(ctx) // the lock and the claim lock rows: roll them back
		if err != nil {
			t.Fatal(err)
		}
		p := explain(ctx, t, tx, name, q)
		_ = tx.Rollback(ctx)
		if strings.Contains(p, "Seq Scan on usage_events") || strings.Contains(p, "Seq Scan on ledger_entries") {
			t.Errorf("%s: sequential scan:\n%s", name, p)
		}
	}
}

// TestPostgresWritePlansWithoutStats checks the account pass's and the batched settle's writes
// on the plans a new deployment caches: generic plans made while the tables are small and never
// analyzed, then run after the tables grew. Each must still find its rows by primary key, not
// by reading the whole table (which costs a pass a full scan of usage_events until autovacuum
// first analyzes it). Autovacuum is kept off these tables, so no analyze of the small tables
// (after which a sequential scan IS the right plan for three rows, and the plan is made again
// at the next analyze) changes what is tested. The pass's and the snapshot's statements are
// planned as their transactions plan them, after SQLKeyedPlans: without it the planner caches a
// sequential scan of api_keys and usage_events here (their "= ANY" alone did not prevent it).
func TestPostgresWritePlansWithoutStats(t *testing.T) {
	t.Parallel()
	_, env := testutil.PostgresLedger(t)
	ctx := context.Background()
	conn, err := env.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	stmts := map[string]string{
		"write charges": pgledger.SQLWriteCharges,
		"mark settled":  pgledger.SQLMarkSettled,
		"low balance":   pgledger.SQLLowBalance,
		"claim":         pgledger.SQLClaimPass,
	}
	// Generic plans, made now, on tables of a few rows with no statistics.
	if _, err := conn.Exec(ctx, `
ALTER TABLE accounts SET (autovacuum_enabled = off);
ALTER TABLE api_keys SET (autovacuum_enabled = off);
ALTER TABLE usage_events SET (autovacuum_enabled = off);
INSERT INTO accounts (org_id) SELECT 'o' || g FROM generate_series(1, 3) g;
INSERT INTO api_keys (id, hash, org_id) SELECT 'k' || g, sha256(('k' || g)::bytea), 'o1' FROM generate_series(1, 3) g;
INSERT INTO usage_events (id, org_id, model, cost) SELECT gen_random_uuid(), 'o1', 'm', 1 FROM generate_series(1, 3);
INSERT INTO usage_pending (n, ids, orgs) SELECT 3, array_agg(id), array_agg(org_id) FROM usage_events;
SET plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "RESET plan_cache_mode") //nolint:errcheck // the connection goes back to a test pool
	args := map[string]string{
		"plan_write_charges": `('{o1}', '{1}', '{1}', '{o1}', '{1}', '{1}', '{0192f0c4-0000-7000-8000-000000000001}', '{k1}', '{""}', '{""}', '{2026-01-01}', '{0}', '{k1}', '{2026-01-01}', '{1}', '{k1}', '{2026-01-01}', '{1}')`,
		"plan_claim":         `('{1}', '{o1}')`,
		"plan_mark_settled":  `('{o1}', '{1}')`,
		"plan_low_balance":   `('{o1}', '{1}')`,
	}
	// The statements run in a pass's or a snapshot's transaction; mark settled and low balance
	// run alone (autocommit).
	keyed := map[string]bool{"plan_write_charges": true, "plan_claim": true}
	plan := func(id string) string {
		if !keyed[id] {
			return explain(ctx, t, conn, id, "EXECUTE "+id+args[id])
		}
		if _, err := conn.Exec(ctx, "BEGIN; "+pgledger.SQLKeyedPlans); err != nil {
			t.Fatal(err)
		}
		defer conn.Exec(ctx, "ROLLBACK") //nolint:errcheck // EXPLAIN wrote nothing
		return explain(ctx, t, conn, id, "EXECUTE "+id+args[id])
	}
	var names []string
	for name, q := range stmts {
		id := "plan_" + strings.ReplaceAll(name, " ", "_")
		names = append(names, id)
		if _, err := conn.Exec(ctx, "PREPARE "+id+" AS "+q); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		plan(id) // makes and caches the generic plan
	}
	defer conn.Exec(ctx, "DEALLOCATE ALL") //nolint:errcheck
	// The tables grow; the cached plans stay.
	if _, err := conn.Exec(ctx, `
INSERT INTO accounts (org_id) SELECT 'p' || g FROM generate_series(1, 20000) g;
INSERT INTO api_keys (id, hash, org_id) SELECT 'kk' || g, sha256(('kk' || g)::bytea), 'o1' FROM generate_series(1, 20000) g;
INSERT INTO usage_events (id, org_id, model, cost) SELECT gen_random_uuid(), 'o1', 'm', 1 FROM generate_series(1, 20000);
INSERT INTO usage_pending (n, ids, orgs) SELECT count(*), array_agg(id), array_agg(org_id) FROM usage_events GROUP BY hashtext(id::text) & 2047`); err != nil {
		t.Fatal(err)
	}
	// Nothing analyzed these tables meanwhile (a database-wide ANALYZE from a test running
	// beside this one did, and the plans made again from its statistics of three rows rightly
	// read the whole table: the test must not depend on who else runs).
	var analyzed int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE relnamespace = current_schema()::regnamespace
		AND relname IN ('accounts', 'api_keys', 'usage_events') AND reltuples >= 0`).Scan(&analyzed); err != nil {
		t.Fatal(err)
	} else if analyzed != 0 {
		t.Fatalf("%d of the tables were analyzed during the test: it no longer tests plans made without statistics", analyzed)
	}
	for _, id := range names {
		p := plan(id)
		for _, table := range []string{"usage_events", "accounts", "api_keys", "key_days"} {
			if strings.Contains(p, "Seq Scan on "+table) {
				t.Errorf("%s: the cached plan reads all of %s:\n%s", id, table, p)
			}
		}
	}
	// No statement of those transactions is compiled with JIT, however low the deployment's
	// jit_above_cost: the setting that keeps the plans on the keys priced the one sequential scan
	// left (ledger_meta) past the threshold, and each pass spent 100 ms compiling its lock.
	if _, err := conn.Exec(ctx, "SET jit_above_cost = 0"); err != nil {
		t.Fatal(err)
	}
	defer conn.Exec(ctx, "RESET jit_above_cost") //nolint:errcheck
	if _, err := conn.Exec(ctx, "BEGIN; "+pgledger.SQLKeyedPlans); err != nil {
		t.Fatal(err)
	}
	p := explain(ctx, t, conn, "lock", "(ANALYZE) "+strings.NewReplacer("$1::text[]", `'{o1,o2}'::text[]`).Replace(pgledger.SQLLockAccounts))
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(p, "JIT:") {
		t.Errorf("the pass's lock statement was compiled with JIT:\n%s", p)
	}
}

// TestPostgresSubscribeReconnects kills the LISTEN connection; the subscription comes back by
// itself and delivers later notifications.
func TestPostgresSubscribeReconnects(t *testing.T) {
	t.Parallel()
	l, env := testutil.PostgresLedger(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := l.CreateOrg(ctx, "o"); err != nil {
		t.Fatal(err)
	}
	ch, err := l.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var channel string
	if err := env.Pool.QueryRow(ctx, `SELECT 'escrow_' || left(md5(current_schema()), 16)`).Scan(&channel); err != nil {
		t.Fatal(err)
	}
	var killed int
	err = env.Pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = 'escrow-listen' AND query LIKE '%' || $1 || '%'`, channel).Scan(&killed)
	if err != nil || killed != 1 {
		t.Fatalf("terminated %d listeners (%v), want 1", killed, err)
	}
	for i := 0; ; i++ {
		if _, _, err := l.Credit(ctx, "o", 1, fmt.Sprint("r", i)); err != nil {
			t.Fatal(err)
		}
		select {
		case org, ok := <-ch:
			if !ok {
				t.Fatal("subscription closed after its connection was killed")
			}
			if org == "o" {
				cancel()
				for range ch { // closes with its context
				}
				return
			}
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			t.Fatal("no notification after the listener was killed")
		}
	}
}
