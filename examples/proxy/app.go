package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/middleware"
	"github.com/llmescrow/escrow/migrations"
)

// app is one proxy process: its parts and their lifecycle.
type app struct {
	cfg config
	log *slog.Logger

	mini     *miniredis.Miniredis // embedded Redis, when REDIS_URL is empty
	rdb      redis.UniversalClient
	ledger   accounting.Ledger
	store    *balance.Store
	journal  *accounting.Journal // local usage journal for ledger outages; nil without ESCROW_JOURNAL_DIR
	recorder *accounting.Recorder
	worker   *accounting.Worker
	metrics  *metrics
	echo     *echo.Echo

	upstream   *url.URL
	fake       *http.Server // built-in fake upstream, when UPSTREAM_URL is empty
	fakeLn     net.Listener
	ln         net.Listener
	httpServer *http.Server
	serveErr   chan error

	demoKey string
	once    sync.Once
}

// newApp builds every part; nothing listens yet.
func newApp(ctx context.Context, cfg config, log *slog.Logger) (_ *app, err error) {
	a := &app{cfg: cfg, log: log, serveErr: make(chan error, 2)}
	defer func() {
		if err != nil {
			a.close()
		}
	}()
	if cfg.embedded() && cfg.AdminToken == "" {
		cfg.AdminToken = randomToken("adm-")
		a.cfg.AdminToken = cfg.AdminToken
	}

	// Redis.
	if cfg.RedisURL == "" {
		a.mini = miniredis.NewMiniRedis()
		if err := a.mini.StartAddr("127.0.0.1:0"); err != nil {
			return nil, fmt.Errorf("embedded redis: %w", err)
		}
		a.rdb = redis.NewClient(&redis.Options{Addr: a.mini.Addr()})
		log.Info("using embedded Redis (miniredis): balances are lost when the process stops")
	} else if a.rdb, err = redisClient(cfg.RedisURL); err != nil {
		return nil, err
	}

	// Ledger.
	if cfg.DatabaseURL == "" {
		a.ledger = accounting.NewMemory()
		log.Info("using the in-memory ledger: for the demo only")
	} else {
		if cfg.Migrate {
			if err := migrateDB(ctx, cfg.DatabaseURL, log); err != nil {
				return nil, err
			}
		}
		// Migrations ran above (or were turned off with ESCROW_MIGRATE=false): never here.
		if a.ledger, err = accounting.OpenPostgres(ctx, cfg.DatabaseURL, accounting.PostgresConfig{SkipMigrations: true, Logger: log}); err != nil {
			return nil, fmt.Errorf("ledger: %w", err)
		}
	}

	a.store, err = balance.New(ctx, a.rdb, balance.Config{
		Ledger:        a.ledger,
		Prefix:        cfg.Prefix,
		HoldTTL:       cfg.HoldTTL,
		PinTTL:        cfg.PinTTL,
		ReapGrace:     cfg.ReapGrace,
		MaxInFlight:   cfg.MaxInFlight,
		AllowEviction: cfg.AllowEviction || a.mini != nil,
		Coalesce:      cfg.Coalesce,
		Logger:        log,
	})
	if err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	for _, w := range a.store.Warnings() {
		log.Warn(w)
	}
	epoch, err := a.ledger.Epoch(ctx)
	if err != nil {
		return nil, fmt.Errorf("ledger not ready (are the migrations applied? ESCROW_MIGRATE=true applies them): %w", err)
	}
	a.store.ObserveEpoch(epoch)
	rc := accounting.RecorderConfig{Logger: log, Finisher: a.store} // holds finished in each record batch
	if cfg.JournalDir != "" {
		if a.journal, err = accounting.OpenJournal(cfg.JournalDir, cfg.JournalMaxBytes); err != nil {
			return nil, fmt.Errorf("journal: %w", err)
		}
		rc.Journal, rc.Pinner = a.journal, a.store
		rc.PinInterval = a.store.Config().PinTTL / 4
		rc.ReplayInterval = cfg.ReplayInterval
		if n := a.journal.Len(); n > 0 {
			log.Warn("the local journal holds usage from an earlier run; it is replayed once the ledger answers",
				"dir", cfg.JournalDir, "events", n, "bytes", a.journal.Size())
		}
	} else if !cfg.embedded() {
		log.Warn("no ESCROW_JOURNAL_DIR: while the ledger is down, requests fail with 503 billing_unavailable instead of being journaled")
	}
	a.recorder = accounting.NewRecorder(a.ledger, rc)
	a.worker = accounting.NewWorker(a.ledger, a.store, &accounting.WorkerConfig{
		Logger:            log,
		SweepInterval:     cfg.SweepInterval,
		ReapInterval:      cfg.ReapInterval,
		ScanInterval:      cfg.ScanInterval,
		ReconcileInterval: cfg.ReconcileEvery,
	})
	a.metrics = newMetrics(a)

	// Upstream.
	if cfg.UpstreamURL == "" {
		if a.fakeLn, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return nil, err
		}
		a.fake = &http.Server{Handler: fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = a.fake.Serve(a.fakeLn) }()
		a.upstream = &url.URL{Scheme: "http", Host: a.fakeLn.Addr().String()}
		a.cfg.UpstreamAPIKey = "sk-fake-upstream"
		log.Info("using the built-in fake upstream", "addr", a.upstream.Host)
	} else if a.upstream, err = url.Parse(cfg.UpstreamURL); err != nil || a.upstream.Host == "" {
		return nil, fmt.Errorf("UPSTREAM_URL %q: not an absolute URL", cfg.UpstreamURL)
	}

	if err := a.buildEcho(); err != nil {
		return nil, err
	}
	if cfg.embedded() {
		if err := a.seedDemo(ctx); err != nil {
			return nil, fmt.Errorf("demo data: %w", err)
		}
	}
	return a, nil
}

func (a *app) buildEcho() error {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = func(err error, c echo.Context) {
		if c.Response().Committed {
			return
		}
		var he *echo.HTTPError
		code := http.StatusInternalServerError
		msg := "internal error"
		if errors.As(err, &he) {
			code = he.Code
			msg = fmt.Sprint(he.Message)
		}
		_ = writeError(c, code, "invalid_request_error", http.StatusText(code), msg)
	}
	e.GET("/healthz", func(c echo.Context) error { return c.JSON(http.StatusOK, map[string]string{"status": "ok"}) })
	e.GET("/readyz", a.ready)
	e.GET("/metrics", echo.WrapHandler(a.metrics.handler()))
	if a.cfg.AdminToken != "" {
		(&adminAPI{token: a.cfg.AdminToken, ledger: a.ledger, store: a.store, worker: a.worker}).register(e)
	}

	mw, err := middleware.Config{
		Store:           a.store,
		Ledger:          a.ledger,
		Recorder:        a.recorder,
		FailOpen:        a.cfg.FailOpen,
		MaxRequestBytes: a.cfg.MaxBodyBytes,
		DefaultHold:     a.cfg.DefaultHold,
		HoldTTL:         a.cfg.HoldTTL,
		Logger:          a.log,
		OnOutcome:       a.metrics.observe,
	}.ToMiddleware()
	if err != nil {
		return fmt.Errorf("middleware: %w", err)
	}
	rp := a.reverseProxy()
	if a.cfg.BenchBaseline {
		a.log.Warn("ESCROW_BENCH_BASELINE is set: requests pass without holds and are not billed")
		e.Any("/v1/*", echo.WrapHandler(rp))
	} else {
		e.Any("/v1/*", echo.WrapHandler(rp), a.journalGate, mw)
	}
	a.echo = e
	return nil
}

// reverseProxy forwards to the upstream with the upstream's key; the client's key never leaves.
func (a *app) reverseProxy() *httputil.ReverseProxy {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 1024
	tr.MaxIdleConnsPerHost = 1024
	tr.ResponseHeaderTimeout = 10 * time.Minute
	up := a.upstream
	key := a.cfg.UpstreamAPIKey
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(up)
			pr.Out.Host = up.Host
			pr.Out.Header.Del("Authorization")
			if key != "" {
				pr.Out.Header.Set("Authorization", "Bearer "+key)
			}
		},
		Transport:     tr,
		FlushInterval: -1,
		BufferPool:    proxyBuffers,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			a.log.Warn("upstream error", "err", err, "path", r.URL.Path)
			body := (&middleware.Error{Type: middleware.TypeServer, Code: "upstream_error", Message: "upstream unavailable"}).Body()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			_, _ = w.Write(body)
		},
	}
}

// journalGate refuses new requests (503 before any hold is taken) while the local journal is
// nearly full, so the requests already in flight still have room to be journaled.
func (a *app) journalGate(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if !a.recorder.Degraded() {
			return next(c)
		}
		a.metrics.journalRefused.Inc()
		return middleware.WriteError(c, &middleware.Error{
			Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable, Code: middleware.CodeServiceUnavailable,
			RetryAfter: 5 * time.Second,
			Message:    "The billing service is degraded (the ledger is unreachable and the local journal is nearly full); please retry later.",
		})
	}
}

func (a *app) ready(c echo.Context) error {
	ctx, cancel := context.WithTimeout(c.Request().Context(), 2*time.Second)
	defer cancel()
	checks := map[string]string{"redis": "ok", "ledger": "ok"}
	status := http.StatusOK
	if err := a.rdb.Ping(ctx).Err(); err != nil {
		checks["redis"], status = err.Error(), http.StatusServiceUnavailable
	}
	if _, err := a.ledger.Epoch(ctx); err != nil {
		checks["ledger"], status = err.Error(), http.StatusServiceUnavailable
		if a.journal != nil {
			// Warm orgs are still served: their usage goes to the journal.
			checks["ledger"], status = "unreachable, journaling: "+err.Error(), http.StatusOK
		}
	}
	if a.journal != nil {
		checks["journal"] = "empty"
		if st := a.recorder.Stats(); st.JournalEvents > 0 {
			checks["journal"] = fmt.Sprintf("in use: %d events, %d of %d bytes", st.JournalEvents, st.JournalBytes, st.JournalMaxBytes)
		}
		if a.recorder.Degraded() {
			checks["journal"] += " (nearly full: new requests refused)"
			status = http.StatusServiceUnavailable
		}
	}
	return c.JSON(status, checks)
}

// start listens, and starts the recorder and the worker.
func (a *app) start(ctx context.Context) error {
	a.recorder.Start(ctx)
	if err := a.worker.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", a.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", a.cfg.Addr, err)
	}
	a.ln = ln
	a.httpServer = &http.Server{Handler: a.echo, ReadHeaderTimeout: 30 * time.Second, ErrorLog: slog.NewLogLogger(a.log.Handler(), slog.LevelWarn)}
	go func() { a.serveErr <- a.httpServer.Serve(ln) }()
	a.log.Info("escrow proxy listening", "addr", ln.Addr().String(), "upstream", a.upstream.String(),
		"embedded", a.cfg.embedded(), "admin_api", a.cfg.AdminToken != "")
	return nil
}

// addr is the address the proxy listens on.
func (a *app) addr() string { return a.ln.Addr().String() }

// shutdown stops accepting, finishes in-flight requests, flushes the recorder and stops the worker.
func (a *app) shutdown(ctx context.Context) error {
	var errs []error
	if a.httpServer != nil {
		if err := a.httpServer.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("http: %w", err))
		}
	}
	if err := a.recorder.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("recorder: %w", err))
	}
	if a.journal != nil {
		if n := a.journal.Len(); n > 0 {
			a.log.Warn("stopping with usage in the local journal; the next start replays it", "events", n)
		}
	}
	if err := a.worker.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("worker: %w", err))
	}
	a.close()
	return errors.Join(errs...)
}

// close releases connections and embedded servers.
func (a *app) close() {
	a.once.Do(func() {
		if a.fake != nil {
			_ = a.fake.Close()
		}
		if a.journal != nil {
			_ = a.journal.Close()
		}
		if a.ledger != nil {
			a.ledger.Close()
		}
		if a.rdb != nil {
			_ = a.rdb.Close()
		}
		if a.mini != nil {
			a.mini.Close()
		}
	})
}

// redisClient builds a client from REDIS_URL: one URL is a single node (or Sentinel-less
// primary), several comma-separated URLs are the seeds of a Redis Cluster. rediss:// means TLS
// with server verification; it is never skipped.
func redisClient(raw string) (redis.UniversalClient, error) {
	urls := strings.Split(raw, ",")
	if len(urls) == 1 {
		opt, err := redis.ParseURL(strings.TrimSpace(urls[0]))
		if err != nil {
			return nil, fmt.Errorf("REDIS_URL: %w", err)
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
			return nil, fmt.Errorf("REDIS_URL: %w", err)
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
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	defer pool.Close()
	applied, err := migrations.Up(ctx, pool)
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	if len(applied) > 0 {
		log.Info("database migrated", "applied", applied)
	}
	return nil
}

func randomToken(prefix string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}
