// Package migrations holds escrow's SQL schema, embedded, and a small strict runner that applies
// it.
//
// The runner is written here rather than taken from a library on purpose: jackc/tern, pressly/goose
// and golang-migrate each bring a CLI, a driver matrix or a template engine (and their
// dependencies) to do what fits in a hundred lines for one database. It follows river's
// rivermigrate: migrations are files named NNN_name.up.sql, numbered upwards from 1 with no
// duplicate (anything else is an error before anything runs); each one runs in its own
// transaction together with the row that records it in schema_migrations; the whole run holds a
// Postgres advisory lock keyed by the current schema, so several processes starting at once apply
// every migration exactly once, while tests in different schemas do not wait for each other.
// Running Up again is a no-op. There are no down migrations: a ledger is rolled forward.
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed *.up.sql
var files embed.FS

// FS is the embedded migration files (NNN_name.up.sql).
var FS fs.FS = files

// Migration is one schema change.
type Migration struct {
	Version int
	Name    string // the file name
	SQL     string
}

// ErrInvalidMigrations is returned when the migration files have a gap, a duplicate version or a
// malformed name.
var ErrInvalidMigrations = errors.New("migrations: invalid migration set")

var fileName = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.up\.sql$`)

// All returns the embedded migrations in version order, checked: versions are positive and have
// no duplicate. A gap is allowed: migrations are written on parallel branches, each numbered
// ahead of the others (a later-merged lower version is applied when it arrives, since every
// version is recorded on its own).
func All() ([]Migration, error) { return Load(FS) }

// Load reads and checks a migration set from fsys (its root directory).
func Load(fsys fs.FS) ([]Migration, error) {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	var ms []Migration
	for _, name := range names {
		m := fileName.FindStringSubmatch(path.Base(name))
		if m == nil {
			return nil, fmt.Errorf("%w: file %q is not NNN_name.up.sql", ErrInvalidMigrations, name)
		}
		v, err := strconv.Atoi(m[1])
		if err != nil {
			return nil, fmt.Errorf("%w: file %q: %v", ErrInvalidMigrations, name, err)
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("migrations: %w", err)
		}
		ms = append(ms, Migration{Version: v, Name: name, SQL: string(b)})
	}
	slices.SortFunc(ms, func(a, b Migration) int { return a.Version - b.Version })
	for i, m := range ms {
		if i > 0 && m.Version == ms[i-1].Version {
			return nil, fmt.Errorf("%w: duplicate version %d (%s, %s)", ErrInvalidMigrations, m.Version, ms[i-1].Name, m.Name)
		}
		if m.Version < 1 {
			return nil, fmt.Errorf("%w: version %d of %s is below 1", ErrInvalidMigrations, m.Version, m.Name)
		}
	}
	return ms, nil
}

// Up applies the embedded migrations that the database (the pool's current schema) does not
// have yet, and returns the versions it applied (none when the schema is current).
func Up(ctx context.Context, pool *pgxpool.Pool) (applied []int, err error) {
	ms, err := All()
	if err != nil {
		return nil, err
	}
	return Apply(ctx, pool, ms)
}

// lockKey is the advisory lock's first key; the second is hashtext(current_schema()). Ledger
// code locks orgs with (hashtext(current_schema()), hashtext(org)), a different key space.
const lockKey = 0x65736331 // "esc1"

// Apply applies ms (as returned by Load) like Up.
func Apply(ctx context.Context, pool *pgxpool.Pool, ms []Migration) (applied []int, err error) {
	for i, m := range ms {
		if m.Version < 1 || (i > 0 && m.Version <= ms[i-1].Version) {
			return nil, fmt.Errorf("%w: version %d out of order", ErrInvalidMigrations, m.Version)
		}
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	locked := false
	defer func() {
		if locked {
			// A session lock outlives a failed unlock: close the connection then, which
			// releases it, rather than returning it to the pool.
			uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if _, uerr := conn.Exec(uctx, "SELECT pg_advisory_unlock($1, hashtext(current_schema()))", lockKey); uerr != nil {
				_ = conn.Conn().Close(uctx)
			}
		}
		conn.Release()
	}()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1, hashtext(current_schema()))", lockKey); err != nil {
		return nil, fmt.Errorf("migrations: lock: %w", err)
	}
	locked = true
	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    bigint      PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("migrations: create schema_migrations: %w", err)
	}
	rows, err := conn.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return nil, fmt.Errorf("migrations: read schema_migrations: %w", err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return nil, fmt.Errorf("migrations: read schema_migrations: %w", err)
	}
	// Versions above ours come from a newer release (a rolling deploy): they are left alone.
	for _, m := range ms {
		if slices.Contains(done, int64(m.Version)) {
			continue
		}
		if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		}); err != nil {
			return applied, fmt.Errorf("migrations: apply %s: %w", m.Name, err)
		}
		applied = append(applied, m.Version)
	}
	return applied, nil
}
