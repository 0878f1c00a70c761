package migrations_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/migrations"
)

func TestLoadChecksTheSet(t *testing.T) {
	t.Parallel()
	ms, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) == 0 || ms[0].Version != 1 {
		t.Fatalf("embedded migrations: %+v", ms)
	}
	sql := &fstest.MapFile{Data: []byte("SELECT 1")}
	for name, fsys := range map[string]fstest.MapFS{
		"duplicate": {"001_a.up.sql": sql, "002_b.up.sql": sql, "02_c.up.sql": sql},
		"zero":      {"000_z.up.sql": sql, "001_a.up.sql": sql},
		"bad name":  {"001_a.up.sql": sql, "002-b.sql": sql},
	} {
		if _, err := migrations.Load(fsys); !errors.Is(err, migrations.ErrInvalidMigrations) {
			t.Errorf("%s: Load = %v, want ErrInvalidMigrations", name, err)
		}
	}
	if ms, err := migrations.Load(fstest.MapFS{"002_b.up.sql": sql, "001_a.up.sql": sql}); err != nil || len(ms) != 2 || ms[1].Name != "002_b.up.sql" {
		t.Errorf("valid set: %+v, %v", ms, err)
	}
	// A gap is allowed (migrations numbered ahead on parallel branches); order is kept.
	if ms, err := migrations.Load(fstest.MapFS{"004_d.up.sql": sql, "001_a.up.sql": sql}); err != nil || len(ms) != 2 || ms[1].Version != 4 {
		t.Errorf("set with a gap: %+v, %v", ms, err)
	}
}

func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	const runs = 5
	results := make([][]int, runs)
	errs := make([]error, runs)
	var wg sync.WaitGroup
	for i := range runs {
		wg.Go(func() { results[i], errs[i] = migrations.Up(ctx, env.Pool) })
	}
	wg.Wait()
	all, _ := migrations.All()
	var total []int
	for i := range runs {
		if errs[i] != nil {
			t.Fatalf("run %d: %v", i, errs[i])
		}
		total = append(total, results[i]...)
	}
	slices.Sort(total)
	want := make([]int, len(all))
	for i := range all {
		want[i] = all[i].Version
	}
	if !slices.Equal(total, want) {
		t.Fatalf("applied across runs = %v, want each of %v exactly once", total, want)
	}
	var n int
	if err := env.Pool.QueryRow(ctx, "SELECT count(*) FROM schema_migrations").Scan(&n); err != nil || n != len(all) {
		t.Fatalf("schema_migrations rows = %d, %v", n, err)
	}
	if err := env.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger_meta").Scan(&n); err != nil || n != 1 {
		t.Fatalf("ledger_meta rows = %d, %v", n, err)
	}
	again, err := migrations.Up(ctx, env.Pool)
	if err != nil || len(again) != 0 {
		t.Fatalf("second Up = %v, %v; want a no-op", again, err)
	}
}

func TestFailedMigrationRollsBack(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	ms := []migrations.Migration{
		{Version: 1, Name: "001_ok.up.sql", SQL: "CREATE TABLE a (x int)"},
		{Version: 2, Name: "002_bad.up.sql", SQL: "CREATE TABLE b (x int); SELECT 1/0"},
	}
	applied, err := migrations.Apply(ctx, env.Pool, ms)
	if err == nil || !slices.Equal(applied, []int{1}) {
		t.Fatalf("Apply = %v, %v; want [1] and an error", applied, err)
	}
	var b *string
	if err := env.Pool.QueryRow(ctx, "SELECT to_regclass('b')::text").Scan(&b); err != nil || b != nil {
		t.Fatalf("table b left behind by a failed migration: %v %v", b, err)
	}
	ms[1].SQL = "CREATE TABLE b (x int)"
	applied, err = migrations.Apply(ctx, env.Pool, ms)
	if err != nil || !slices.Equal(applied, []int{2}) {
		t.Fatalf("retry Apply = %v, %v; want [2]", applied, err)
	}
}
