package pgledger_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestPostgresConsolePlans checks with EXPLAIN that the console's reads use indexes (no
// sequential scan of usage_events, ledger_entries or api_keys) on tables big enough that the
// planner prefers them, as TestPostgresQueryPlans does for the worker's queries.
func TestPostgresConsolePlans(t *testing.T) {
	t.Parallel()
	_, env := testutil.PostgresLedger(t)
	ctx := context.Background()
	_, err := env.Pool.Exec(ctx, `
INSERT INTO accounts (org_id, ledger_seq, settled_seq) SELECT 'o' || g, 100, 100 FROM generate_series(1, 20000) g;
INSERT INTO api_keys (id, hash, org_id, created_at)
	SELECT 'key_' || g, sha256(g::text::bytea), 'o' || (g % 200 + 1), now() - g * interval '1 s' FROM generate_series(1, 20000) g;
INSERT INTO usage_events (id, org_id, model, key_id, cost, status, seq, created_at)
	SELECT gen_random_uuid(), 'o' || (g % 200 + 1), 'm' || (g % 5), 'key_' || (g % 7), 1, 'accounted', g / 200 + 1,
	       now() - g * interval '1 min' FROM generate_series(0, 19999) g;
INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id)
	SELECT org_id, seq, -cost, 'charge', id FROM usage_events;
ANALYZE accounts, api_keys, usage_events, ledger_entries`) // this schema's tables only: a bare ANALYZE reaches every test's schema
	if err != nil {
		t.Fatal(err)
	}
	conn, err := env.Pool.Acquire(ctx) // one session: the prepared statement lives there
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "PREPARE list_entries AS "+pgledger.SQLListEntries); err != nil {
		t.Fatal(err)
	}
	for name, q := range map[string]string{
		"list orgs":    `SELECT org_id, name, balance FROM accounts WHERE org_id > 'o5' ORDER BY org_id LIMIT 101`,
		"list keys":    `SELECT id, name, created_at, revoked_at FROM api_keys WHERE org_id = 'o7' AND (created_at, id) > (now() - interval '1 day', 'key_1') ORDER BY created_at, id LIMIT 101`,
		"list entries": `EXECUTE list_entries('o7', 50, '', NULL, NULL, 101)`,
		"usage report": `SELECT model, count(*), sum(cost) FROM usage_events WHERE org_id = 'o7' AND status = 'accounted' AND coalesce(reserved_at, created_at) >= now() - interval '3 days' AND coalesce(reserved_at, created_at) < now() GROUP BY model`,
		"request":      `SELECT id, org_id, cost, status FROM usage_events WHERE id = '0192f0c4-0000-7000-8000-000000000001'`,
		"top spenders": strings.ReplaceAll(pgledger.SQLTopSpenders(`status = 'accounted' AND coalesce(reserved_at, created_at) >= now() - interval '3 hours' AND coalesce(reserved_at, created_at) < now()`), "$1", "10"),
	} {
		p := explain(ctx, t, conn, name, q)
		for _, table := range []string{"usage_events", "ledger_entries", "api_keys", "accounts"} {
			if strings.Contains(p, "Seq Scan on "+table) {
				t.Errorf("%s: sequential scan:\n%s", name, p)
			}
		}
	}
}

// explain returns the plan Postgres would use for q, one line per node.
func explain(ctx context.Context, t *testing.T, q querier, name, sql string) string {
	t.Helper()
	rows, err := q.Query(ctx, "EXPLAIN "+sql)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		plan = append(plan, line)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return strings.Join(plan, "\n")
}

// querier is a pool or one of its connections.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}
