// Package escrow wires escrow's parts together in one call: the ledger, the hot balance in
// Redis, the usage recorder (with its local journal), the accounting worker and the webhook
// sender, started together and stopped in the order the money needs. It hands out the Echo
// middleware that puts a hold on each request and the admin API as an Echo group.
//
// The packages below it stay usable one by one (balance, accounting, middleware, admin,
// webhook); server builds the ready proxy on New.
package escrow

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/middleware"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/webhook"
)

// ErrConfig is returned by New for an unusable Config or missing dependencies.
var ErrConfig = errors.New("escrow: invalid config")

// Config configures New. The zero value (or nil) is the documented defaults of every part.
type Config struct {
	// Ledger, when set, is the ledger New uses instead of one on the pool given to New (the pool
	// is then ignored). New does not close a ledger it was given.
	Ledger ledger.Ledger
	// SkipMigrations leaves the database as it is; by default New applies the migrations the
	// pool's database lacks (in order, under an advisory lock) before anything else.
	SkipMigrations bool
	// Logger receives every part's logs. Default slog.Default().
	Logger *slog.Logger

	// Balance configures the hot balance; its Ledger and Logger are filled in by New.
	Balance balance.Config
	// Worker configures the accounting worker (account, settle, reap, reconcile); Logger filled in.
	Worker accounting.WorkerConfig
	// Recorder configures the usage recorder; Finisher, Wake, Journal, Pinner and Logger are
	// filled in by New.
	Recorder accounting.RecorderConfig
	// JournalDir, when set, is the directory (on persistent storage) of the local usage journal
	// that keeps requests billed through a ledger outage. Default "": no journal, and requests
	// fail with 503 billing_unavailable while the ledger is down.
	JournalDir string
	// Journal configures the journal (its size cap).
	Journal accounting.JournalConfig
	// Webhooks configures the sender of the ledger's webhook outbox; Logger filled in.
	Webhooks webhook.Config
	// Middleware configures the middleware; Store, Ledger and Recorder are filled in by New.
	Middleware middleware.Config
	// AdminToken is the bearer token of the admin API; MountAdmin refuses to mount it without one.
	AdminToken string
}

// Escrow is every part, wired. Make it with New, then Start it; Stop drains it.
type Escrow struct {
	log        *slog.Logger
	ledger     ledger.Ledger
	ownLedger  bool
	store      *balance.Store
	journal    *accounting.Journal
	recorder   *accounting.Recorder
	worker     *accounting.Worker
	ops        *accounting.Ops
	webhooks   *webhook.Sender
	middleware echo.MiddlewareFunc
	adminToken string
}

// New builds every part on rdb (a single node or a Cluster client) and pool (nil: the
// in-memory ledger, for demos and tests only — it forgets everything when the process ends,
// so pair it only with a Redis that does too). Nothing runs until Start. New checks Redis
// (version, eviction policy), applies the migrations unless told not to, and reads the
// ledger's epoch.
func New(ctx context.Context, rdb redis.UniversalClient, pool *pgxpool.Pool, cfg *Config) (_ *Escrow, err error) {
	if rdb == nil {
		return nil, fmt.Errorf("%w: a Redis client is required", ErrConfig)
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	x := &Escrow{log: c.Logger, adminToken: c.AdminToken}
	if x.log == nil {
		x.log = slog.Default()
	}
	defer func() {
		if err != nil {
			x.close()
		}
	}()
	if err := x.openLedger(ctx, pool, c); err != nil {
		return nil, err
	}
	bc := c.Balance
	bc.Ledger, bc.Logger = x.ledger, cmpLogger(bc.Logger, x.log)
	if x.store, err = balance.New(ctx, rdb, &bc); err != nil {
		return nil, fmt.Errorf("hot balance: %w", err)
	}
	if err := x.openAccounting(c); err != nil {
		return nil, err
	}
	if _, err := x.ops.SyncEpoch(ctx); err != nil {
		return nil, fmt.Errorf("ledger not ready (are the migrations applied? escrow serve applies them unless ESCROW_MIGRATE=false): %w", err)
	}
	mc := c.Middleware
	mc.Store, mc.Ledger, mc.Recorder = x.store, x.ledger, x.recorder
	mc.Logger = cmpLogger(mc.Logger, x.log)
	if x.middleware, err = mc.ToMiddleware(); err != nil {
		return nil, fmt.Errorf("middleware: %w", err)
	}
	return x, nil
}

func (x *Escrow) openLedger(ctx context.Context, pool *pgxpool.Pool, c Config) error {
	switch {
	case c.Ledger != nil:
		x.ledger = c.Ledger
	case pool == nil:
		x.ledger, x.ownLedger = memledger.New(), true
	default:
		if !c.SkipMigrations {
			if _, err := migrations.Up(ctx, pool); err != nil {
				return fmt.Errorf("ledger: %w", err)
			}
		}
		l, err := pgledger.New(pool, &pgledger.Config{SkipMigrations: true, Logger: x.log})
		if err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
		x.ledger, x.ownLedger = l, true
	}
	return nil
}

// openAccounting makes the journal, the worker, the recorder (which finishes holds in each
// batch and wakes this process's worker), the operations and the webhook sender.
func (x *Escrow) openAccounting(c Config) error {
	rc := c.Recorder
	rc.Logger, rc.Finisher = cmpLogger(rc.Logger, x.log), x.store
	if c.JournalDir != "" {
		var err error
		if x.journal, err = accounting.OpenJournal(c.JournalDir, &c.Journal); err != nil {
			return fmt.Errorf("journal: %w", err)
		}
		rc.Journal, rc.Pinner = x.journal, x.store
		if rc.PinInterval == 0 {
			rc.PinInterval = x.store.PinRenewal()
		}
	}
	wc := c.Worker
	wc.Logger = cmpLogger(wc.Logger, x.log)
	var err error
	if x.worker, err = accounting.NewWorker(x.ledger, x.store, &wc); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	// The recorder wakes this process's worker itself; its batches send no NOTIFY, which would
	// wake every worker listening on the database for the same events.
	rc.Wake = x.worker.Wake
	if x.recorder, err = accounting.NewRecorder(x.ledger, &rc); err != nil {
		return fmt.Errorf("recorder: %w", err)
	}
	x.ops = accounting.NewOps(x.worker)
	h, ok := x.ledger.(ledger.Webhooks)
	if !ok {
		return fmt.Errorf("webhooks: %w", ledger.ErrNoWebhooks)
	}
	whc := c.Webhooks
	whc.Logger = cmpLogger(whc.Logger, x.log)
	if x.webhooks, err = webhook.NewSender(h, &whc); err != nil {
		return fmt.Errorf("webhooks: %w", err)
	}
	return nil
}

// Start starts the recorder, the worker and the webhook sender. They outlive ctx: Stop ends
// them, so that requests still in flight when ctx ends record their usage and the worker's
// last pass settles it.
func (x *Escrow) Start(ctx context.Context) error {
	run := context.WithoutCancel(ctx)
	if err := x.recorder.Start(run); err != nil {
		return fmt.Errorf("recorder: %w", err)
	}
	if err := x.worker.Start(run); err != nil {
		return fmt.Errorf("worker: %w", err)
	}
	if err := x.webhooks.Start(run); err != nil {
		return fmt.Errorf("webhooks: %w", err)
	}
	return nil
}

// Stop drains in the order the money needs — the recorder's last batch into the ledger (or
// the journal), then the worker's last pass that accounts and settles it, then the webhooks
// that pass wrote — and closes what New opened. Stop the HTTP server first, so that no request
// is still being served. ctx bounds the wait.
func (x *Escrow) Stop(ctx context.Context) error {
	var errs []error
	if err := x.recorder.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("recorder: %w", err))
	}
	if x.journal != nil {
		if n := x.journal.Len(); n > 0 {
			x.log.Warn("stopping with usage in the local journal; the next start replays it", "events", n)
		}
	}
	if err := x.worker.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("worker: %w", err))
	}
	if err := x.webhooks.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("webhooks: %w", err))
	}
	x.close()
	return errors.Join(errs...)
}

// close releases the journal and a ledger New made.
func (x *Escrow) close() {
	if x.journal != nil {
		_ = x.journal.Close()
		x.journal = nil
	}
	if x.ownLedger && x.ledger != nil {
		x.ledger.Close()
		x.ownLedger = false
	}
}

// Middleware is the Echo middleware: holds, 429s, usage capture and record.
func (x *Escrow) Middleware() echo.MiddlewareFunc { return x.middleware }

// MountAdmin adds the admin API's routes to g (escrow's proxy mounts it at /admin/v1). It
// fails without Config.AdminToken: an admin API open to anyone is never mounted.
func (x *Escrow) MountAdmin(g *echo.Group) error {
	allowPrivate := x.webhooks.Config().AllowPrivate
	api, err := admin.New(x.ops, &admin.Config{Token: x.adminToken, Logger: x.log,
		CheckWebhookURL: func(u string) error { return webhook.CheckURL(u, allowPrivate) }})
	if err != nil {
		return err
	}
	api.Register(g)
	return nil
}

// Ops are the operator's operations (credits, limits, keys, models, reads) on this ledger and
// hot balance: what the admin API serves, for programs that call them directly.
func (x *Escrow) Ops() *accounting.Ops { return x.ops }

// Store is the hot balance.
func (x *Escrow) Store() *balance.Store { return x.store }

// Ledger is the ledger.
func (x *Escrow) Ledger() ledger.Ledger { return x.ledger }

// Recorder is the usage recorder (its Stats, and Degraded while usage goes to the journal).
func (x *Escrow) Recorder() *accounting.Recorder { return x.recorder }

// Worker is the accounting worker (its Stats and settle lag).
func (x *Escrow) Worker() *accounting.Worker { return x.worker }

// Webhooks is the webhook sender (its Stats).
func (x *Escrow) Webhooks() *webhook.Sender { return x.webhooks }

// Journal is the local usage journal (nil without Config.JournalDir).
func (x *Escrow) Journal() *accounting.Journal { return x.journal }

func cmpLogger(l, def *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return def
}
