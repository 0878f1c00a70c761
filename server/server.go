// Package server is escrow's product wiring: the configuration (environment and flags), the
// Redis client, the ledger, the balance store, the recorder and the worker, the HTTP server with
// the middleware in front of the upstream, the admin API, metrics, /healthz and /readyz, and the
// lifecycle of every part.
//
//	cfg, err := server.LoadConfig("escrow serve", os.Args[2:], os.Getenv, os.Stderr)
//	srv, err := server.New(ctx, cfg)
//	err = srv.Start(ctx)
//	…
//	err = srv.Stop(ctx)
//
// The parts a demo or a test brings instead of the configured ones (an embedded Redis, an
// in-process upstream) are Options, so the production binary carries none of them.
package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"github.com/llmescrow/escrow/endpoint"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/llmescrow/escrow"
	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/async"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/middleware"
	"github.com/llmescrow/escrow/webhook"
)

// ErrNoRedis and ErrNoUpstream are returned by New when neither the configuration nor an Option
// provides the part.
var (
	ErrNoRedis    = errors.New("server: no Redis (set REDIS_URL)")
	ErrNoUpstream = errors.New("server: no upstream (set UPSTREAM_URL and UPSTREAM_API_KEY, or ESCROW_ROUTES_FILE)")
)

// Option gives New a part instead of the one the configuration describes.
type Option func(*parts)

type parts struct {
	rdb         redis.UniversalClient
	embedded    bool
	upstream    http.Handler
	upstreamKey string
	routes      []Route
}

// WithRedis makes the server use c instead of dialing Config.RedisURL. The caller keeps c:
// Stop does not close it.
func WithRedis(c redis.UniversalClient) Option {
	return func(p *parts) { p.rdb, p.embedded = c, false }
}

// WithEmbeddedRedis is WithRedis for a process-private Redis (miniredis in the demo): its
// eviction policy is not checked, and it may pair with the in-memory ledger (empty
// DATABASE_URL), which forgets everything when the process ends, as the embedded Redis does.
func WithEmbeddedRedis(c redis.UniversalClient) Option {
	return func(p *parts) { p.rdb, p.embedded = c, true }
}

// WithUpstream serves h on a loopback listener of its own and proxies to it, with apiKey as the
// upstream key, instead of Config.UpstreamURL (the demo's fake upstream). Stop closes it.
func WithUpstream(h http.Handler, apiKey string) Option {
	return func(p *parts) { p.upstream, p.upstreamKey = h, apiKey }
}

// WithRoutes adds routes (see Route) before the configured ones (ESCROW_ROUTES_FILE, or the
// catch-all of UPSTREAM_URL or WithUpstream), e.g. a demo's second, in-process upstream for some
// models. The combined table follows the same rules (a model or prefix listed twice is an error).
func WithRoutes(rs ...Route) Option {
	return func(p *parts) { p.routes = append(p.routes, rs...) }
}

// Server is one proxy process: its parts and their lifecycle. New builds every part, Start
// listens and starts the background work, Stop undoes both.
type Server struct {
	cfg Config
	log *slog.Logger

	rdb      redis.UniversalClient
	ownRedis bool                  // rdb was dialed from Config.RedisURL: Stop closes it
	adminRdb redis.UniversalClient // dialed from Config.AdminRedisURL (nil without); Stop closes it
	ledger   ledger.Ledger
	store    *balance.Store
	journal  *accounting.Journal // local usage journal for ledger outages; nil with ESCROW_JOURNAL_DIR=off
	recorder *accounting.Recorder
	worker   *accounting.Worker
	ops      *accounting.Ops
	webhooks *webhook.Sender // delivers the ledger's webhook outbox
	esc      *escrow.Escrow  // the parts above, wired and run together (escrow.New)
	pay      *payments       // Stripe's webhook and auto top-up; nil when not configured (payments.go)
	poller   *async.Poller   // background jobs (jobs.go); nil when the ledger has no jobs
	jobProxy http.Handler    // the reverse proxy of the job routes
	metrics  *metrics
	echo     *echo.Echo
	// batchPolls are the batch kinds' upstreams, registered with the poller once it is made
	// (batches.go).
	batchPolls []batchPoll

	routes     *routeTable  // each model's upstream (upstreams.go)
	fake       *http.Server // in-process upstream (WithUpstream)
	ln         net.Listener
	httpServer *http.Server
	pprof      *http.Server
	tracing    *sdktrace.TracerProvider // OTLP traces (tracing.go); nil: none

	once sync.Once

	// tempJournal is the demo's temporary journal directory (removed at close); "" otherwise.
	tempJournal string
}

// New builds every part from cfg (nil: DefaultConfig) and opts; nothing listens yet. It checks
// Redis (version, eviction policy) and the ledger (migrated, its epoch read), and applies the
// migrations first when cfg.Migrate is set.
func New(ctx context.Context, cfg *Config, opts ...Option) (_ *Server, err error) {
	if cfg == nil {
		cfg = DefaultConfig()
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	var p parts
	for _, o := range opts {
		o(&p)
	}
	s := &Server{cfg: *cfg, log: cfg.Logger}
	if s.log == nil {
		s.log = cfg.NewLogger(os.Stderr)
	}
	// Every part logs through s.log: no line carries a URL's password or token, whatever
	// logger the caller gave.
	s.log = redactLogger(s.log)
	defer func() {
		if err != nil {
			s.close()
			// The errors of the clients that parse and dial the configured URLs may quote them.
			err = redactError(err)
		}
	}()
	// The routes first, so that every part logs through a logger that masks the upstreams'
	// keys (and the admin token) wherever they would appear.
	if err := s.openUpstream(p); err != nil {
		return nil, err
	}
	s.log = redactLogger(s.log, append(s.routes.keys, cfg.AdminToken, cfg.StripeAPIKey)...)
	if err := s.openRedis(p); err != nil {
		return nil, err
	}
	if err := s.openLedger(ctx, p.embedded); err != nil {
		return nil, err
	}
	if s.tracing, err = newTracerProvider(ctx); err != nil {
		return nil, err
	}
	if err := s.openEscrow(ctx, p.embedded); err != nil {
		return nil, err
	}
	if err := s.openPayments(); err != nil {
		return nil, err
	}
	s.metrics = newMetrics(s)
	if s.routes.empty() && s.cfg.Role != RoleAdmin {
		return nil, ErrNoUpstream
	}
	if err := s.buildEcho(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *Server) openRedis(p parts) error {
	switch {
	case p.rdb != nil:
		s.rdb = p.rdb
	case s.cfg.RedisURL != "":
		c, err := redisClient(s.cfg.RedisURL)
		if err != nil {
			return err
		}
		s.rdb, s.ownRedis = c, true
	default:
		return ErrNoRedis
	}
	if s.cfg.AdminRedisURL != "" {
		c, err := redisClient(s.cfg.AdminRedisURL)
		if err != nil {
			return fmt.Errorf("admin redis: %w", err)
		}
		s.adminRdb = c
	}
	return nil
}

func (s *Server) openLedger(ctx context.Context, embeddedRedis bool) error {
	if s.cfg.DatabaseURL == "" {
		if !embeddedRedis {
			// A real Redis outlives the process; an in-memory ledger does not: the two would
			// disagree after the first restart.
			return fmt.Errorf("%w: the in-memory ledger only pairs with an embedded Redis: set DATABASE_URL", ErrConfig)
		}
		s.ledger = memledger.New()
		s.log.Info("using the in-memory ledger: for the demo only")
		return nil
	}
	if s.cfg.Migrate {
		if err := migrateDB(ctx, s.cfg.DatabaseURL, s.log); err != nil {
			return err
		}
	}
	// Migrations ran above (or were turned off with ESCROW_MIGRATE=false): never here.
	l, err := pgledger.Open(ctx, s.cfg.DatabaseURL, &pgledger.Config{SkipMigrations: true, Logger: s.log,
		ViewConns: int32(min(max(s.cfg.ViewConns, 0), 1000)), ViewTimeout: s.cfg.ViewTimeout})
	if err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	s.ledger = l
	return nil
}

// openEscrow builds the hot balance, the recorder (with the journal when ESCROW_JOURNAL_DIR
// is set), the worker, the webhook sender and the middleware with escrow.New, on this server's
// Redis client and ledger, from the configuration.
func (s *Server) openEscrow(ctx context.Context, embedded bool) error {
	cfg := s.cfg
	journalDir, err := s.journalDir(ctx)
	if err != nil {
		return err
	}
	if journalDir != "" {
		s.log.Info("local usage journal", "dir", journalDir)
	}
	esc, err := escrow.New(ctx, s.rdb, nil, &escrow.Config{
		Ledger: s.ledger,
		Logger: s.log,
		Balance: balance.Config{
			Prefix:        cfg.Prefix,
			HoldTTL:       cfg.HoldTTL,
			PinTTL:        cfg.PinTTL,
			ReapGrace:     cfg.ReapGrace,
			MaxInFlight:   cfg.MaxInFlight,
			EndUserFields: cfg.EndUserFields,
			AllowEviction: cfg.AllowEviction || embedded,
			// An embedded Redis has no round trips to save, and its scripts run one after
			// another in Go: a pipeline of a hundred could outlast the client's read timeout,
			// failing its whole batch at once (a 2,000-way burst under the race detector did).
			NoCoalesce:  !cfg.Coalesce || embedded,
			ClockOffset: cfg.limitClock,
			// int64 in the configuration (its integer parser); a count of replicas in balance.
			WaitReplicas: int(min(cfg.RedisWaitReplicas, 1<<16)),
			WaitTimeout:  cfg.RedisWaitTimeout,
			// The two planes (DESIGN.md "Two planes"): the admin plane's writes go through their
			// own user when one is given; a proxy without one writes no admin key.
			Admin:    s.adminRdb,
			DataOnly: s.adminRdb == nil && cfg.Role == RoleProxy,
		},
		Worker: accounting.WorkerConfig{
			SweepInterval:     cfg.SweepInterval,
			PassInterval:      cfg.PassInterval,
			ReapInterval:      cfg.ReapInterval,
			ScanInterval:      cfg.ScanInterval,
			ReconcileInterval: cfg.ReconcileEvery,
			Charged:           s.charged, // auto top-up (payments.go)
		},
		// Usage left in the journal from an earlier run is announced by the recorder when it
		// replays it.
		Recorder:   accounting.RecorderConfig{ReplayInterval: cfg.ReplayInterval},
		JournalDir: journalDir,
		Journal:    accounting.JournalConfig{MaxBytes: cfg.JournalMaxBytes},
		Webhooks:   webhook.Config{Timeout: cfg.WebhookTimeout, MaxAttempts: cfg.WebhookMaxAttempts, AllowPrivate: cfg.WebhookAllowPrivate},
		Middleware: middleware.Config{
			FailOpen:             cfg.FailOpen,
			MaxRequestBytes:      cfg.MaxBodyBytes,
			DefaultHold:          cfg.DefaultHold,
			RecordTimeout:        cfg.RecordTimeout,
			VoidTimeout:          cfg.voidTimeout,
			HangupTimeout:        cfg.ReadOn,
			NoFit:                !cfg.Fit,
			FitMinOutputTokens:   cfg.FitMinOutput,
			FitFields:            map[string]string{endpoint.Chat.Path: cfg.FitChatField},
			EndUserHeader:        cfg.EndUserHeader,
			RequireEndUser:       cfg.RequireEndUser,
			ReserveTimeout:       cfg.ReserveTimeout,
			KeyCacheTTL:          cfg.KeyCacheTTL,
			MaxStale:             cfg.KeyMaxStale,
			KeyFailuresPerMinute: cfg.KeyFailures,
			TracerProvider:       s.tracerProvider(),
			OnOutcome:            func(o middleware.Outcome) { s.metrics.observe(o) }, // the metrics are made after
			Route:                s.route,
			PassThrough:          append(append([]string{"/v1/models", "/v1/models/*"}, viewPaths()...), jobPaths()...),
			Jobs:                 jobStarter{s},
			ErrorHandler:         s.writeRefusal,
			Batches:              s.batches(), // batches.go

			RenameUpstreamRateLimit: cfg.UpstreamRateLimit == "rename", // ESCROW_UPSTREAM_RATELIMIT
		},
		AdminToken: cfg.AdminToken,
	})
	switch {
	case errors.Is(err, balance.ErrConfig), errors.Is(err, middleware.ErrConfig):
		// The parts check their own settings (ESCROW_HOLD_TTL, ESCROW_PIN_TTL, …).
		return fmt.Errorf("%w: %w", ErrConfig, err)
	case err != nil:
		return err
	}
	s.esc = esc
	s.store, s.journal, s.recorder, s.worker = esc.Store(), esc.Journal(), esc.Recorder(), esc.Worker()
	s.ops, s.webhooks = esc.Ops(), esc.Webhooks()
	if err := s.openJobs(); err != nil {
		return err
	}
	s.openBatches() // batches.go: the batch kinds, on the same poller
	return nil
}

// openUpstream builds the route table: the routes file; or one catch-all OpenAI route to
// UPSTREAM_URL, or to the in-process upstream of WithUpstream, and one catch-all Anthropic route
// to ESCROW_ANTHROPIC_URL (its key sent as x-api-key), or to the in-process upstream when that
// is unset (the demo's fake serves both APIs).
func (s *Server) openUpstream(p parts) error {
	var rs []Route
	all := ""
	switch {
	case p.upstream != nil && s.cfg.RoutesFile != "":
		return fmt.Errorf("%w: WithUpstream and ESCROW_ROUTES_FILE exclude each other", ErrConfig)
	case p.upstream != nil:
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("in-process upstream: %w", err)
		}
		s.fake = &http.Server{Handler: p.upstream, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = s.fake.Serve(ln) }()
		s.cfg.UpstreamAPIKey = p.upstreamKey
		s.log.Info("using an in-process upstream", "addr", ln.Addr().String())
		rs = []Route{{Prefix: &all, Upstream: "http://" + ln.Addr().String(), APIKey: p.upstreamKey}}
		if s.cfg.AnthropicURL == "" {
			rs = append(rs, Route{Prefix: &all, Upstream: "http://" + ln.Addr().String(), APIKey: p.upstreamKey, Style: StyleAnthropic})
		}
	case s.cfg.RoutesFile != "":
		var err error
		if rs, err = readRoutesFile(s.cfg.RoutesFile); err != nil {
			return fmt.Errorf("%w: %w", ErrConfig, err)
		}
	case s.cfg.UpstreamURL != "":
		u, err := url.Parse(s.cfg.UpstreamURL)
		if err != nil || u.Host == "" {
			// Not quoted: a value that does not parse may not be masked by redact either.
			return fmt.Errorf("%w: UPSTREAM_URL is not an absolute URL (want scheme://host, e.g. https://api.openai.com)", ErrConfig)
		}
		rs = []Route{{Prefix: &all, Upstream: s.cfg.UpstreamURL, APIKey: s.cfg.UpstreamAPIKey}}
	case len(p.routes) == 0 && s.cfg.AnthropicURL == "":
		// Reported by New after the other parts, whose own configuration errors come first.
		s.routes = &routeTable{}
		return nil
	}
	if s.cfg.AnthropicURL != "" && s.cfg.RoutesFile == "" {
		u, err := url.Parse(s.cfg.AnthropicURL)
		if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
			// Not quoted: a value that does not parse may not be masked by redact either.
			return fmt.Errorf("%w: ESCROW_ANTHROPIC_URL is not an absolute URL (want scheme://host, e.g. https://api.anthropic.com)", ErrConfig)
		}
		rs = append(rs, Route{Prefix: &all, Upstream: s.cfg.AnthropicURL, APIKey: s.cfg.AnthropicAPIKey, Style: StyleAnthropic})
	}
	t, err := newRouteTable(append(slices.Clip(p.routes), rs...), os.Getenv)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	s.routes = t
	return nil
}

// Ops are the operator's operations (credit, adjust, models, keys, epoch, balances) on this
// server's ledger and store: what the admin API serves, for programs that embed the server.
func (s *Server) Ops() *accounting.Ops { return s.ops }

// Start listens on Config.Addr and starts the recorder, the worker and (when configured) the
// pprof listener. After an error, Stop releases what New and Start made.
func (s *Server) Start(ctx context.Context) error {
	// The background parts outlive ctx, all alike: Stop ends them, after the HTTP server has
	// drained, so the requests still in flight when ctx ends (a SIGTERM) record their usage,
	// and the worker's last pass settles it.
	if err := s.esc.Start(ctx); err != nil {
		return err
	}
	if s.poller != nil {
		if err := s.poller.Start(context.WithoutCancel(ctx)); err != nil {
			return err
		}
	}
	if err := s.startPayments(ctx); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", s.cfg.Addr, err)
	}
	s.ln = ln
	s.httpServer = s.newHTTPServer()
	go func() {
		if err := s.httpServer.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("http server stopped", "err", err)
		}
	}()
	if s.cfg.PprofAddr != "" {
		s.pprof = servePprof(s.cfg.PprofAddr, s.log)
	}
	redisDesc := "given to New"
	if s.ownRedis {
		redisDesc = s.cfg.RedisURL
	}
	// The URLs are logged as configured, their secrets masked by the logger (redact).
	s.log.Info("escrow proxy listening", "addr", ln.Addr().String(), "upstreams", s.routes.String(),
		"redis", redisDesc, "database", cmp.Or(s.cfg.DatabaseURL, "in-memory ledger"),
		"admin_api", s.cfg.AdminToken != "")
	return nil
}

// Addr is the address the server listens on ("" before Start).
func (s *Server) Addr() string {
	if s.ln == nil {
		return ""
	}
	return s.ln.Addr().String()
}

// Stop stops accepting, finishes in-flight requests, flushes the recorder, stops the worker
// after a last pass, and closes every part this server opened. ctx bounds the wait.
func (s *Server) Stop(ctx context.Context) error {
	var errs []error
	if s.httpServer != nil {
		if err := s.httpServer.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("http: %w", err))
		}
	}
	if s.pprof != nil {
		_ = s.pprof.Close()
	}
	if err := s.stopPayments(ctx); err != nil {
		errs = append(errs, fmt.Errorf("auto top-up: %w", err))
	}
	if s.poller != nil {
		if err := s.poller.Stop(ctx); err != nil {
			errs = append(errs, fmt.Errorf("job poller: %w", err))
		}
	}
	if s.esc != nil {
		// The recorder's last batch, the worker's last pass, the webhooks: in that order.
		if err := s.esc.Stop(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if s.tracing != nil { // the spans of the last requests
		if err := s.tracing.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("tracing: %w", err))
		}
	}
	s.close()
	return errors.Join(errs...)
}

// close releases connections and the in-process upstream.
func (s *Server) close() {
	s.once.Do(func() {
		if s.tracing != nil { // New failed after making it (Stop shut it down already otherwise)
			_ = s.tracing.Shutdown(context.Background())
		}
		if s.fake != nil {
			_ = s.fake.Close()
		}
		if s.ledger != nil {
			s.ledger.Close()
		}
		if s.rdb != nil && s.ownRedis {
			_ = s.rdb.Close()
		}
		if s.adminRdb != nil {
			_ = s.adminRdb.Close()
		}
		if s.tempJournal != "" {
			_ = os.RemoveAll(s.tempJournal)
		}
	})
}
