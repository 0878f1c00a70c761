// Command proxy is escrow's runnable product: an OpenAI-compatible reverse proxy that puts a hold
// on the customer's prepaid balance before each request and settles the real cost afterwards.
//
//	go run ./examples/proxy          # embedded Redis, in-memory ledger, fake upstream, demo org
//	go run ./examples/proxy -h       # every setting, with its environment variable
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
	cfg, err := loadConfig(args, os.Getenv, os.Stderr)
	if err != nil {
		return err
	}
	log := newLogger(cfg, os.Stderr)
	slog.SetDefault(log) // libraries that log through slog.Default follow the configured format and level
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	a, err := newApp(ctx, cfg, log)
	if err != nil {
		return err
	}
	if err := a.start(ctx); err != nil {
		a.close()
		return err
	}
	if cfg.embedded() {
		fmt.Fprint(os.Stdout, a.demoBanner())
	}
	<-ctx.Done()
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	return a.shutdown(sctx)
}
