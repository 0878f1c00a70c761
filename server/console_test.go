package server

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestMigrateErrorSaysItOnce: a DATABASE_URL that cannot be reached names the migrations once,
// not "migrations: migrations: …".
func TestMigrateErrorSaysItOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := migrateDB(ctx, "postgres://nobody@127.0.0.1:1/x?connect_timeout=1", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err == nil || strings.Count(err.Error(), "migrations:") != 1 || !strings.HasPrefix(err.Error(), "database: ") {
		t.Fatalf("migrate on a closed port: %v", err)
	}
}
