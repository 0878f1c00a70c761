package pgledger_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/migrations"
)

// viewLedger is a ledger on a fresh schema whose customer views read on their own pool (conns
// connections, each connection prepared by setup), with an org "v", a key, and charges.
func viewLedger(t *testing.T, conns int32, timeout time.Duration, setup func(ctx context.Context, c *pgx.Conn) error) (*pgledger.Ledger, *testutil.PostgresEnv, ledger.APIKey, string) {
	t.Helper()
	env := testutil.Postgres(t)
	ctx := context.Background()
	if _, err := migrations.Up(ctx, env.Pool); err != nil {
		t.Fatal(err)
	}
	pc, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	pc.MaxConns, pc.AfterConnect = conns, setup
	views, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(views.Close)
	l, err := pgledger.New(env.Pool, &pgledger.Config{ViewPool: views, ViewTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	if err := l.CreateOrg(ctx, "v"); err != nil {
		t.Fatal(err)
	}
	k, secret, err := l.CreateKey(ctx, "v")
	if err != nil {
		t.Fatal(err)
	}
	var evs []ledger.UsageEvent
	for i := range 50 {
		evs = append(evs, ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: "v", KeyID: k.ID, Model: "m", Cost: int64(i + 1),
			CreatedAt: time.Now().Add(-time.Duration(i) * time.Hour)})
	}
	if err := l.RecordUsage(ctx, evs); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := l.AccountPending(ctx, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	return l, env, k, secret
}

// TestSpendReadsNoCharges: the views' reads (Spend, LimitWindows) never touch the charges. A
// ledger's connections run as a role that may read accounts, api_keys, key_days, limits and
// limit_windows and nothing else (not
// ledger_entries, not usage_events): a read of the charges fails with permission denied,
// whatever plan the planner picks. Before migration 021 Spend summed ledger_entries.
func TestSpendReadsNoCharges(t *testing.T) {
	t.Parallel()
	role := testutil.RandomName("view_")
	setup := func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+role)
		return err
	}
	admin := testutil.Postgres(t) // any schema: roles are the cluster's
	ctx := context.Background()
	if _, err := admin.Pool.Exec(ctx, "CREATE ROLE "+role+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = admin.Pool.Exec(context.Background(), "DROP ROLE "+role)
	})
	_, env, k, _ := viewLedger(t, 2, 10*time.Second, nil)
	if _, err := env.Pool.Exec(ctx, "GRANT USAGE ON SCHEMA "+env.Schema+" TO "+role+
		"; GRANT SELECT ON "+env.Schema+".accounts, "+env.Schema+".api_keys, "+env.Schema+".key_days, "+
		env.Schema+".limits, "+env.Schema+".limit_windows TO "+role); err != nil {
		t.Fatal(err)
	}
	// A ledger whose every connection runs as the role (its views read on that pool too).
	pc, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	pc.AfterConnect = setup
	restricted, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restricted.Close)
	l, err := pgledger.New(restricted, nil)
	if err != nil {
		t.Fatal(err)
	}
	day := time.Now().UTC().Truncate(24 * time.Hour)
	s, err := l.Spend(ctx, "v", k.ID, []time.Time{day, day.Add(-24 * time.Hour)})
	if err != nil {
		t.Fatalf("Spend on a role that cannot read the charges: %v", err)
	}
	if s.Charged != 50*51/2 || s.Key.Charged != s.Charged || s.Key.Since[1] < s.Key.Since[0] || s.Key.Since[1] == 0 {
		t.Fatalf("Spend = %+v", s)
	}
	// The limits' windows too (the views' limit numbers): what the account pass keeps.
	if _, err := l.LimitWindows(ctx, "v"); err != nil {
		t.Fatalf("LimitWindows on a role that cannot read the charges: %v", err)
	}
	// The role really cannot read them: the check above would pass vacuously otherwise.
	conn, err := env.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	_, err = conn.Exec(ctx, "SET ROLE "+role+"; SELECT count(*) FROM ledger_entries")
	_, _ = conn.Exec(ctx, "RESET ROLE")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42501" {
		t.Fatalf("the view role read ledger_entries: err = %v, want permission denied", err)
	}
}

// lockViews takes, in a transaction it returns, locks that block every read the views make (and
// the charges, which they read before issue 34), not the key look-up's tables.
func lockViews(t *testing.T, env *testutil.PostgresEnv) pgx.Tx {
	t.Helper()
	tx, err := env.Pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // before the pools close
	if _, err := tx.Exec(context.Background(), "LOCK TABLE key_days, ledger_entries IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	return tx
}

// waitLockWaiters waits until n sessions wait for a lock in the schema's database.
func waitLockWaiters(t *testing.T, env *testutil.PostgresEnv, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		var got int
		if err := env.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE NOT l.granted AND c.relnamespace = $1::regnamespace`, env.Schema).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions wait for the lock, want %d", got, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestViewPoolSeparate: views blocked by a lock (every connection of their pool waiting, more
// queued behind) leave the request path's key look-up its own connections: it answers while they
// still wait. The request pool here has as few connections as the views that are waiting.
func TestViewPoolSeparate(t *testing.T) {
	t.Parallel()
	l, env, k, secret := viewLedger(t, 2, time.Minute, nil)
	tx := lockViews(t, env)
	done := make(chan error, 6)
	for range 6 {
		go func() {
			_, err := l.Spend(context.Background(), "v", k.ID, []time.Time{time.Now()})
			done <- err
		}()
	}
	waitLockWaiters(t, env, 2)                                               // the view pool's two connections wait; four more queue for them
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second) // a guard, not a measure
	defer cancel()
	got, err := l.LookupKey(ctx, secret)
	if err != nil || got.ID != k.ID {
		t.Fatalf("key look-up while the views wait: %+v, %v", got, err)
	}
	select {
	case err := <-done:
		t.Fatalf("a view answered while its table was locked: %v", err)
	default:
	}
	if err := tx.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
	for range 6 {
		if err := <-done; err != nil {
			t.Fatalf("view after the lock: %v", err)
		}
	}
}

// TestViewTimeout: a view read that waits longer than ViewTimeout fails (the pool's
// statement_timeout, the read's deadline) instead of holding its connection.
func TestViewTimeout(t *testing.T) {
	t.Parallel()
	l, env, k, _ := viewLedger(t, 1, 50*time.Millisecond, nil)
	lockViews(t, env)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a guard, far above ViewTimeout
	defer cancel()
	_, err := l.Spend(ctx, "v", k.ID, nil)
	if err == nil || ctx.Err() != nil || !(errors.Is(err, context.DeadlineExceeded) || strings.Contains(err.Error(), "57014")) {
		t.Fatalf("Spend behind a lock: err = %v, want a timeout", err)
	}
}

// TestViewTotalsMigrationBackfills: migration 021 fills the sums from the entries written before
// it (an upgrade keeps the views' numbers).
func TestViewTotalsMigrationBackfills(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	migrateBefore(t, env.Pool, "_view_totals.up.sql")
	if _, err := env.Pool.Exec(ctx, `
INSERT INTO accounts (org_id, balance, ledger_seq, settled_seq) VALUES ('b', 1000 - 5 - 7 - 11 - 13, 5, 0);
INSERT INTO api_keys (id, hash, org_id) VALUES ('kb', sha256('kb'::bytea), 'b');
INSERT INTO ledger_entries (org_id, seq, delta, kind, key_id, reserved_at, ref) VALUES
	('b', 1, 1000, 'credit', NULL, NULL, 'pay'),
	('b', 2, -5, 'charge', 'kb', '2026-01-01 23:00+00', NULL),
	('b', 3, -7, 'charge', 'kb', '2026-01-02 01:00+00', NULL),
	('b', 4, -11, 'charge', NULL, '2026-01-02 01:00+00', NULL),
	('b', 5, -13, 'charge', 'kb', NULL, NULL)`); err != nil {
		t.Fatal(err)
	}
	l := migrateRest(t, env.Pool)
	s, err := l.Spend(ctx, "b", "kb", []time.Time{time.Date(2026, 1, 2, 12, 0, 0, 0, time.UTC), time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)})
	if err != nil {
		t.Fatal(err)
	}
	// Entry 5 has no reserve time: its creation (now) is its day.
	if s.Charged != 36 || s.Balance+s.Charged != 1000 || s.Key.Charged != 25 || s.Key.Since[0] != 20 || s.Key.Since[1] != 25 {
		t.Fatalf("Spend after the backfill = %+v", s)
	}
}
