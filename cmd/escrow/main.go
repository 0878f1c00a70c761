// Command escrow is the operator's binary: an OpenAI-compatible proxy that puts a hold on the
// customer's prepaid balance before each request and settles the real cost afterwards, on a
// real Redis and PostgreSQL. (For a bare machine, go run ./examples/proxy brings embedded ones.)
//
//	escrow serve [flags]     # run the proxy; every flag has an environment variable
//	escrow serve -h          # every setting with its default
//	escrow orgs|credit|keys|usage|models|request …   # the admin API from a terminal
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"slices"
	"syscall"

	"github.com/llmescrow/escrow/server"
)

// commands are the subcommands; the operator's CLI commands join serve here.
var commands = map[string]struct {
	help string
	run  func(args []string) error
}{
	"serve":         {"run the proxy (REDIS_URL, DATABASE_URL, and UPSTREAM_URL with UPSTREAM_API_KEY or ESCROW_ROUTES_FILE are required)", serve},
	"orgs":          {"list, create, show or rename orgs (the CLI commands use ESCROW_URL and ESCROW_ADMIN_TOKEN)", cmdOrgs},
	"credit":        {"credit an org: escrow credit ORG MICRO_UNITS --ref REFERENCE [--expires-at T] [--priority N]", cmdCredit},
	"grants":        {"list an org's credit grants (priority, expiry, rest) in spending order", cmdGrants},
	"keys":          {"list an org's API keys, create, rename or revoke one", cmdKeys},
	"usage":         {"an org's usage by day, model, key or end user, as a table, JSON or CSV", cmdUsage},
	"models":        {"list, show, price (decimals per 1M tokens), import a price table (LiteLLM JSON or CSV) or delete models", cmdModels},
	"price-classes": {"the price classes a model can price: unit, side, default (escrow models set M --price CLASS=D)", cmdPriceClasses},
	"request":       {"one request by its x-request-id: hold, usage, cost, status", cmdRequest},
	"entries":       {"an org's ledger entries, newest first (charges with their request)", cmdEntries},
	"audit":         {"every admin write: who, what, when", cmdAudit},
	"reconcile":     {"compare an org's hot balance with the ledger and repair a drift: escrow reconcile ORG", cmdReconcile},
	"epoch":         {"show the ledger epoch, or raise it after restoring the ledger from a backup", cmdEpoch},
	"webhooks":      {"list, create or delete webhook endpoints, and list an endpoint's deliveries", cmdWebhooks},
	"limits":        {"list, create, change the cap of or delete an org's spending limits (per org, project, key or end user and window), list a per-end-user limit's end users", cmdLimits},
	"projects":      {"create a project (a named group of an org's keys), put a key in one or take it out", cmdProjects},
	"freeze":        {"refuse every new request of an org, one of its projects or a key, at once", freezeCmd("freeze", "freeze")},
	"unfreeze":      {"lift a freeze", freezeCmd("unfreeze", "unfreeze")},
	"top":           {"the orgs that spent the most in a time range", cmdTop},
	"tokens":        {"list, create, rotate (old and new valid for an overlap) or revoke scoped admin tokens (read, admin, org:ORG)", cmdTokens},
	"redis-acl":     {"print the ACL SETUSER commands of a Redis data user (the proxies) and admin user (the admin API)", cmdRedisACL},
	"pg-roles":      {"print the GRANTs of a Postgres data role (the proxies) and admin role (the admin API)", cmdPGRoles},
	"topup":         {"show, set or delete an org's auto top-up (threshold, amount, Stripe payment method, daily and monthly caps) and list its attempts", cmdTopUp},
	"jobs":          {"background responses and batches, newest first: status, hold, cost (escrow jobs [ORG] [--live])", cmdJobs},
	"migrate":       {"apply the ledger's database migrations (DATABASE_URL) and exit", cmdMigrate},
}

func main() {
	if err := run(os.Args[1:], os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "escrow:", err)
		var ee *exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprintln(out, "Usage: escrow <command> [flags]\n\nCommands:")
		for _, name := range slices.Sorted(maps.Keys(commands)) {
			fmt.Fprintf(out, "  %-10s %s\n", name, commands[name].help)
		}
		if len(args) == 0 {
			return errors.New("no command")
		}
		return flag.ErrHelp
	}
	c, ok := commands[args[0]]
	if !ok {
		return fmt.Errorf("unknown command %q (escrow help lists them)", args[0])
	}
	return c.run(args[1:])
}

// serve runs the proxy until SIGINT or SIGTERM, then shuts it down gracefully.
func serve(args []string) error {
	cfg, err := server.LoadConfig("escrow serve", args, os.Getenv, os.Stderr)
	if err != nil {
		return err
	}
	cfg.Logger = cfg.NewLogger(os.Stderr)
	slog.SetDefault(cfg.Logger) // libraries that log through slog.Default follow the configured format and level
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	srv, err := server.New(ctx, cfg)
	if err != nil {
		return err
	}
	startErr := srv.Start(ctx)
	if startErr == nil {
		<-ctx.Done()
		cfg.Logger.Info("shutting down")
	}
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	return errors.Join(startErr, srv.Stop(sctx))
}
