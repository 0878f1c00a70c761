package testutil

import (
	"context"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/migrations"
)

// PostgresEnv is a fresh, empty schema in the configured Postgres, dropped when the test ends.
type PostgresEnv struct {
	Pool   *pgxpool.Pool // connections whose search_path is Schema
	Schema string
	URL    string // a connection string whose search_path is Schema
}

// RealPostgresURL returns the configured Postgres URL, or "" when none is configured.
func RealPostgresURL() string { return os.Getenv("ESCROW_TEST_DATABASE_URL") }

// Postgres gives the test its own schema. It skips (or fails, under ESCROW_REQUIRE_SERVICES=1)
// when no Postgres is configured or it does not answer.
func Postgres(tb testing.TB) *PostgresEnv {
	tb.Helper()
	base := RealPostgresURL()
	if base == "" {
		unavailable(tb, "ESCROW_TEST_DATABASE_URL is not set")
	}
	// A bound on a Postgres that is not there, not a measure (see Redis).
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin, err := pgxpool.New(ctx, base)
	if err != nil {
		tb.Fatalf("ESCROW_TEST_DATABASE_URL: %v", err)
	}
	defer admin.Close()
	if err := admin.Ping(ctx); err != nil {
		unavailable(tb, "postgres: %v", err)
	}
	schema := RandomName("t_")
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		tb.Fatalf("create schema: %v", err)
	}
	u := WithSearchPath(base, schema)
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		tb.Fatalf("pool: %v", err)
	}
	tb.Cleanup(func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if a, err := pgxpool.New(ctx, base); err == nil {
			_, _ = a.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
			a.Close()
		}
	})
	return &PostgresEnv{Pool: pool, Schema: schema, URL: u}
}

// WithSearchPath returns the connection URL with search_path set to schema.
func WithSearchPath(dsn, schema string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return dsn
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

// PostgresLedger is a Postgres ledger on its own fresh schema (Postgres), migrated, closed
// when the test ends.
func PostgresLedger(tb testing.TB) (*pgledger.Ledger, *PostgresEnv) {
	tb.Helper()
	env := Postgres(tb)
	if _, err := migrations.Up(context.Background(), env.Pool); err != nil {
		tb.Fatal(err)
	}
	l, err := pgledger.New(env.Pool, nil)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(l.Close)
	return l, env
}
