package server

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/lua"
)

// settleMetrics exports how far behind settling is: the settle-lag histogram of this process's
// worker and, on Postgres, the ledger's backlog.
func (m *metrics) settleMetrics(a *Server) {
	cmds := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "escrow_redis_commands_total",
		Help: "Redis commands this process sent, its worker's included (a pipeline counts each of its commands; label pipelined). A script call is named by its script: evalsha:reserve, evalsha:finish, evalsha:settle, …"}, []string{"command", "pipelined"})
	short := prometheus.NewCounter(prometheus.CounterOpts{Name: "escrow_redis_wait_short_total",
		Help: "WAITs after reserves (ESCROW_REDIS_WAIT_REPLICAS) that fewer replicas acknowledged than asked, or that failed: the holds of their pipeline were refused (503)."})
	m.reg.MustRegister(cmds, short)
	a.rdb.AddHook(commandCounter{single: cmds.MustCurryWith(prometheus.Labels{"pipelined": "false"}),
		piped: cmds.MustCurryWith(prometheus.Labels{"pipelined": "true"}), scripts: scriptNames(), waitShort: short})
	m.reg.MustRegister(settleLagCollector{w: a.worker, desc: prometheus.NewDesc("escrow_settle_lag_seconds",
		"Settle lag of the entries this process's worker settled: usage recorded (the usage event's created_at) → applied to the Redis balance.", nil, nil)})
	if pg, ok := a.ledger.(*pgledger.Ledger); ok {
		m.reg.MustRegister(backlogCollector{pg: pg,
			pending:   prometheus.NewDesc("escrow_worker_pending_events", "Usage events recorded and not yet accounted (-1: the ledger did not answer).", nil, nil),
			unsettled: prometheus.NewDesc("escrow_worker_unsettled_entries", "Ledger entries not yet applied to the hot balance (-1: the ledger did not answer).", nil, nil),
		})
	}
}

// backlogCollector reads the ledger's backlog once per scrape.
type backlogCollector struct {
	pg                 *pgledger.Ledger
	pending, unsettled *prometheus.Desc
}

func (c backlogCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.pending; ch <- c.unsettled }

func (c backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	b, err := c.pg.Backlog(ctx)
	if err != nil {
		b = pgledger.Backlog{PendingEvents: -1, UnsettledEntries: -1}
	}
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(b.PendingEvents))
	ch <- prometheus.MustNewConstMetric(c.unsettled, prometheus.GaugeValue, float64(b.UnsettledEntries))
}

// commandCounter counts the Redis commands of the process (the hot path's round trips and the
// worker's), a script call by its script's name.
type commandCounter struct {
	single, piped *prometheus.CounterVec
	scripts       map[string]string // SHA-1 of a script as sent → "evalsha:<name>"
	waitShort     prometheus.Counter
}

// scriptNames maps the SHA-1 of each script escrow sends (lua.Scripts, as balance sends them) to
// its metric label.
func scriptNames() map[string]string {
	m := map[string]string{}
	for name, src := range lua.Scripts {
		h := sha1.Sum([]byte(src))
		m[hex.EncodeToString(h[:])] = "evalsha:" + name
	}
	return m
}

// name is the command's label: its name, or for EVALSHA the script's.
func (h commandCounter) name(cmd redis.Cmder) string {
	n := cmd.Name()
	if n == "evalsha" {
		if args := cmd.Args(); len(args) > 1 {
			if sha, ok := args[1].(string); ok {
				if s, ok := h.scripts[sha]; ok {
					return s
				}
			}
		}
	}
	return n
}

func (commandCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h commandCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.single.WithLabelValues(h.name(cmd)).Inc()
		return next(ctx, cmd)
	}
}

func (h commandCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		wait := false
		for _, c := range cmds {
			h.piped.WithLabelValues(h.name(c)).Inc()
			wait = wait || c.Name() == "wait"
		}
		err := next(ctx, cmds)
		if wait {
			for _, c := range cmds {
				if c.Name() == "wait" && waitShort(c) {
					h.waitShort.Inc()
				}
			}
		}
		return err
	}
}

// waitShort reports whether a WAIT (numreplicas, timeout) failed or was answered by fewer
// replicas than it asked for.
func waitShort(c redis.Cmder) bool {
	cmd, ok := c.(*redis.Cmd)
	if !ok {
		return false
	}
	got, err := cmd.Int64()
	args := cmd.Args()
	if err != nil || len(args) < 2 {
		return true
	}
	var want int64
	switch v := args[1].(type) {
	case int:
		want = int64(v)
	case int64:
		want = v
	}
	return got < want
}

// settleLagCollector exports the worker's settle-lag histogram (accounting.SettleLag).
type settleLagCollector struct {
	w    *accounting.Worker
	desc *prometheus.Desc
}

func (c settleLagCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c settleLagCollector) Collect(ch chan<- prometheus.Metric) {
	l := c.w.SettleLag()
	buckets := make(map[float64]uint64, len(l.Bounds))
	var cum uint64
	for i, b := range l.Bounds {
		cum += l.Counts[i]
		buckets[b.Seconds()] = cum
	}
	ch <- prometheus.MustNewConstHistogram(c.desc, l.Count, l.Sum.Seconds(), buckets)
}

// servePprof serves net/http/pprof on its own listener (ESCROW_PPROF_ADDR). It is for
// profiling only: never expose it beyond loopback.
func servePprof(addr string, log *slog.Logger) *http.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	log.Warn("pprof is served (profiling only)", "addr", addr)
	go func() {
		if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Warn("pprof server", "err", err)
		}
	}()
	return srv
}
