package server

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/migrations"
)

// redisClient builds a client from REDIS_URL: one URL is a single node (or Sentinel-less
// primary), several comma-separated URLs are the seeds of a Redis Cluster. rediss:// means TLS
// with server verification; it is never skipped.
func redisClient(raw string) (redis.UniversalClient, error) {
	urls := strings.Split(raw, ",")
	if len(urls) == 1 {
		opt, err := redis.ParseURL(strings.TrimSpace(urls[0]))
		if err != nil {
			return nil, fmt.Errorf("%w: REDIS_URL: %w", ErrConfig, err)
		}
		if opt.TLSConfig != nil {
			opt.TLSConfig.MinVersion = tls.VersionTLS12
		}
		// Deadlines of the request path (the reserve's 1s) bound a Redis call that gets no
		// reply, instead of the client's 3s read timeout and its retries.
		opt.ContextTimeoutEnabled = true
		return redis.NewClient(opt), nil
	}
	var addrs []string
	var first *redis.Options
	for _, u := range urls {
		opt, err := redis.ParseURL(strings.TrimSpace(u))
		if err != nil {
			return nil, fmt.Errorf("%w: REDIS_URL: %w", ErrConfig, err)
		}
		if first == nil {
			first = opt
		}
		addrs = append(addrs, opt.Addr)
	}
	co := &redis.ClusterOptions{Addrs: addrs, Username: first.Username, Password: first.Password, TLSConfig: first.TLSConfig,
		ContextTimeoutEnabled: true}
	if co.TLSConfig != nil {
		co.TLSConfig.MinVersion = tls.VersionTLS12
	}
	return redis.NewClusterClient(co), nil
}

func migrateDB(ctx context.Context, dsn string, log *slog.Logger) error {
	applied, err := Migrate(ctx, dsn)
	if err != nil {
		return err
	}
	if len(applied) > 0 {
		log.Info("database migrated", "applied", applied)
	}
	return nil
}

// Migrate applies the ledger's migrations that the database at databaseURL lacks, in order,
// under an advisory lock (so proxies starting together apply each once), and returns the
// versions it applied (none: the database was up to date). `escrow migrate` runs it; the proxy
// runs it at start unless ESCROW_MIGRATE=false.
func Migrate(ctx context.Context, databaseURL string) (applied []int, err error) {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	defer pool.Close()
	applied, err = migrations.Up(ctx, pool) // its errors already say "migrations: …"
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return applied, nil
}
