package testutil

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func pgConnect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

func TestPostgresServerLifecycle(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	s := StartPostgresServer(t)
	t.Logf("private postgres: initdb %v, start %v, total %v", s.InitTime(), s.StartTime(), time.Since(t0))
	if s.Port() == 5432 || !strings.Contains(s.URL(), "@127.0.0.1:") {
		t.Fatalf("private postgres at %s", s.URL())
	}
	ctx := context.Background()
	c := pgConnect(t, s.URL())
	var fsync string
	if err := c.QueryRow(ctx, "SHOW fsync").Scan(&fsync); err != nil || fsync != "off" {
		t.Fatalf("SHOW fsync = %q, %v", fsync, err)
	}
	if _, err := c.Exec(ctx, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}

	s.Stop()
	if s.Running() {
		t.Fatal("running after Stop")
	}
	if err := c.Ping(ctx); err == nil {
		t.Fatal("old connection still answers after Stop")
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	if c2, err := pgx.Connect(cctx, s.URL()); err == nil {
		_ = c2.Close(ctx)
		t.Fatal("connected while stopped")
	}
	cancel()

	s.Start()
	t.Logf("restart after fast shutdown: %v", s.StartTime())
	c = pgConnect(t, s.URL())
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM t").Scan(&n); err != nil || n != 1 {
		t.Fatalf("rows after restart: %d, %v", n, err)
	}
}

func TestPostgresServerKillKeepsCommittedOnly(t *testing.T) {
	t.Parallel()
	s := StartPostgresServer(t)
	ctx := context.Background()
	c := pgConnect(t, s.URL())
	if _, err := c.Exec(ctx, "CREATE TABLE t (v int)"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO t VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	s.Kill() // with the transaction open
	if s.Running() {
		t.Fatal("running after Kill")
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit succeeded on a killed server")
	}
	s.Start()
	t.Logf("start after kill (crash recovery): %v", s.StartTime())
	c2 := pgConnect(t, s.URL())
	var sum int
	if err := c2.QueryRow(ctx, "SELECT coalesce(sum(v), 0) FROM t").Scan(&sum); err != nil || sum != 1 {
		t.Fatalf("sum after crash = %d, %v; want 1 (committed row only)", sum, err)
	}
	s.Restart()
	c3 := pgConnect(t, s.URL())
	if err := c3.Ping(ctx); err != nil {
		t.Fatalf("after Restart: %v", err)
	}
}

func TestPostgresServerThroughFaultProxy(t *testing.T) {
	t.Parallel()
	s := StartPostgresServer(t)
	p := StartFaultProxy(t, "127.0.0.1:"+strconv.Itoa(s.Port()))
	url := strings.Replace(s.URL(), "127.0.0.1:"+strconv.Itoa(s.Port()), p.Addr(), 1)
	ctx := context.Background()
	c := pgConnect(t, url)
	if _, err := c.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	if err := c.Ping(ctx); err == nil {
		t.Fatal("ping on a cut connection succeeded")
	}
	p.Block()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if c2, err := pgx.Connect(cctx, url); err == nil {
		_ = c2.Close(ctx)
		t.Fatal("connected through a blocked proxy")
	}
	p.Unblock()
	pgConnect(t, url)
}
