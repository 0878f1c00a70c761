// Command proxy is escrow's first command: the proxy of package server with embedded defaults,
// so it runs on a bare machine. Without REDIS_URL it uses an embedded Redis (miniredis), without
// DATABASE_URL an in-memory ledger, without UPSTREAM_URL a fake OpenAI upstream; on the fully
// embedded parts it creates a demo org and prints a curl line that works.
//
//	go run ./examples/proxy          # embedded Redis, in-memory ledger, fake upstream, demo org
//	go run ./examples/proxy -h       # every setting, with its environment variable
//
// The operator's binary, with none of these test doubles, is cmd/escrow.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/server"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "escrow proxy:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	cfg, err := server.LoadConfig("go run ./examples/proxy", args, os.Getenv, os.Stderr)
	if err != nil {
		return err
	}
	log := cfg.NewLogger(os.Stderr)
	slog.SetDefault(log) // libraries that log through slog.Default follow the configured format and level
	cfg.Logger = log
	demo := cfg.RedisURL == "" && cfg.DatabaseURL == ""
	if demo && cfg.AdminToken == "" {
		cfg.AdminToken = randomToken("adm-")
	}
	var opts []server.Option
	if cfg.RedisURL == "" {
		mini := miniredis.NewMiniRedis()
		if err := mini.StartAddr("127.0.0.1:0"); err != nil {
			return fmt.Errorf("embedded redis: %w", err)
		}
		defer mini.Close()
		rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
		defer rdb.Close()
		log.Info("using embedded Redis (miniredis): balances are lost when the process stops")
		opts = append(opts, server.WithEmbeddedRedis(rdb))
	}
	if cfg.UpstreamURL == "" && cfg.RoutesFile == "" {
		log.Info("using the built-in fake upstream")
		opts = append(opts, server.WithUpstream(fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), "sk-fake-upstream"))
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	srv, err := server.New(ctx, cfg, opts...)
	if err != nil {
		return err
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	defer cancel()
	var demoKey string
	if demo {
		if demoKey, err = seedDemo(ctx, srv.Ops(), cfg.DemoBalance); err != nil {
			return errors.Join(fmt.Errorf("demo data: %w", err), srv.Stop(sctx))
		}
	}
	if err := srv.Start(ctx); err != nil {
		return errors.Join(err, srv.Stop(sctx))
	}
	if demo {
		fmt.Fprint(os.Stdout, demoBanner(srv.Addr(), demoKey, cfg.AdminToken, cfg.DemoBalance))
	}
	<-ctx.Done()
	log.Info("shutting down")
	sctx, cancel = context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	return srv.Stop(sctx)
}
