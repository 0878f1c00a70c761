package server

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestMigrateSwitch: with ESCROW_MIGRATE=false the proxy does not touch the schema and refuses
// to start on an empty database with a message that says why; with it (the default) it migrates.
func TestMigrateSwitch(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	cfg := DefaultConfig()
	cfg.Addr, cfg.RedisURL, cfg.DatabaseURL, cfg.Prefix = "127.0.0.1:0", env.URL, pg.URL, env.Prefix
	cfg.Migrate = false
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	upstream := WithUpstream(fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), "sk-fake-upstream")
	if a, err := New(context.Background(), cfg, upstream); err == nil {
		_ = a.Stop(context.Background())
		t.Fatal("started on an unmigrated database with ESCROW_MIGRATE=false")
	} else if !strings.Contains(err.Error(), "ESCROW_MIGRATE") {
		t.Fatalf("error does not say what to do: %v", err)
	}
	var tables int
	if err := pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.tables WHERE table_schema = $1`, pg.Schema).Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("ESCROW_MIGRATE=false created %d tables (%v)", tables, err)
	}
	cfg.Migrate = true
	a, err := New(context.Background(), cfg, upstream)
	if err != nil {
		t.Fatalf("with migrations: %v", err)
	}
	if err := a.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
}
