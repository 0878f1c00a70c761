package server

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/middleware"
	"github.com/llmescrow/escrow/pricing"
)

// metrics are the proxy's Prometheus metrics. No label carries an org: cardinality stays fixed.
type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec   // by outcome
	fitted   prometheus.Counter       // requests served with a fitted output cap
	holds    prometheus.Histogram     // hold amounts
	costs    prometheus.Histogram     // real costs
	errors   *prometheus.CounterVec   // Redis / ledger errors seen by the middleware
	latency  *prometheus.HistogramVec // request duration by outcome kind
	spend    *prometheus.CounterVec   // micro-units charged, by model and outcome
	tokens   *prometheus.CounterVec   // tokens charged, by model and kind

	journalRefused prometheus.Counter // requests refused because the local journal is nearly full
}

// newMetrics registers the metrics of s's parts. It starts nothing (pprof is started by Start).
func newMetrics(a *Server) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "escrow_requests_total",
		Help: "Requests by outcome: recorded, estimated, released, insufficient_quota (429), rate_limited (429), unavailable (503), rejected (4xx), fail_open.",
	}, []string{"outcome"})
	m.fitted = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "escrow_requests_fitted_total",
		Help: "Requests whose bound did not fit the balance or a limit, served with a lower output cap (x-escrow-output-cap).",
	})
	m.holds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "escrow_hold_amount_microunits", Help: "Hold amounts taken.",
		Buckets: prometheus.ExponentialBuckets(100, 4, 12),
	})
	m.costs = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "escrow_cost_microunits", Help: "Real costs recorded.",
		Buckets: prometheus.ExponentialBuckets(100, 4, 12),
	})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "escrow_backend_errors_total", Help: "Errors from Redis or the ledger seen on the request path.",
	}, []string{"backend"})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "escrow_request_seconds", Help: "Time from the request's arrival to its outcome (upstream time included), by outcome kind.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
	}, []string{"outcome"})
	// Spend by model: the model label only takes priced models (a charged request's model is
	// in the price table), never a client's free text, so it stays as small as the price table.
	m.spend = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "escrow_spend_microunits_total",
		Help: "Micro-units charged, by model and outcome (recorded: usage from the upstream; estimated: the hold or an estimate was charged).",
	}, []string{"model", "outcome"})
	m.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "escrow_tokens_total", Help: "Tokens (units) charged, by model and kind (prompt, cached, completion, and each other price class by its name).",
	}, []string{"model", "kind"})
	m.reg.MustRegister(m.requests, m.fitted, m.holds, m.costs, m.errors, m.latency, m.spend, m.tokens)

	w := a.worker
	counter := func(name, help string, f func() int64) {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f()) }))
	}
	gauge := func(name, help string, f func() int64) {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return float64(f()) }))
	}
	counter("escrow_worker_accounted_total", "Usage events turned into ledger entries.", func() int64 { return w.Stats().Accounted })
	counter("escrow_worker_settled_total", "Ledger entries applied to the hot balance.", func() int64 { return w.Stats().Settled })
	counter("escrow_worker_seeds_total", "Cold orgs seeded by the worker.", func() int64 { return w.Stats().Seeds })
	counter("escrow_worker_gaps_total", "Ledger gaps healed by re-sending entries.", func() int64 { return w.Stats().Gaps })
	counter("escrow_worker_reaped_total", "Expired holds of dead processes released.", func() int64 { return w.Stats().Reaped })
	counter("escrow_worker_drift_repairs_total", "Hot balances dropped by the reconciler after a drift.", func() int64 { return w.Stats().DriftRepairs })
	counter("escrow_worker_grants_expired_total", "Expire entries written for credit grants that expired.", func() int64 { return w.Stats().GrantsExpired })
	counter("escrow_worker_grant_expiries_waiting_total", "Grant expiry passes of an org put off by holds reserved before the expiry.", func() int64 { return w.Stats().GrantsWaiting })
	counter("escrow_worker_errors_total", "Failed worker passes.", func() int64 { return w.Stats().Errors })
	gauge("escrow_worker_last_drift_microunits", "The last drift the reconciler found.", func() int64 { return w.Stats().LastDrift })
	gauge("escrow_worker_batch_size", "Usage events accounted by the last pass.", func() int64 { return w.Stats().LastBatchSize })
	gauge("escrow_worker_backlog_orgs", "Orgs waiting to be settled at the last sweep.", func() int64 { return w.Stats().PendingBacklog })
	m.settleMetrics(a)
	m.journalMetrics(a)
	m.webhookMetrics(a) // webhooks.go
	m.jobMetrics(a)     // jobs.go
	return m
}

// statFuncs returns the registrars of counters and gauges whose value is read from stats() at
// each scrape.
func statFuncs[S any](reg *prometheus.Registry, stats func() S) (counter, gauge func(name, help string, f func(S) int64)) {
	counter = func(name, help string, f func(S) int64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f(stats())) }))
	}
	gauge = func(name, help string, f func(S) int64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return float64(f(stats())) }))
	}
	return counter, gauge
}

// journalMetrics says whether the local usage journal is in use (a ledger outage).
func (m *metrics) journalMetrics(a *Server) {
	r := a.recorder
	counter, gauge := statFuncs(m.reg, r.Stats)
	gauge("escrow_journal_bytes", "Size of the local usage journal (non-zero: the ledger was unreachable and usage waits to be replayed).", func(s accounting.RecorderStats) int64 { return s.JournalBytes })
	gauge("escrow_journal_events", "Usage events waiting in the local journal.", func(s accounting.RecorderStats) int64 { return s.JournalEvents })
	gauge("escrow_journal_max_bytes", "Cap of the local journal (0: no journal).", func(s accounting.RecorderStats) int64 { return s.JournalMaxBytes })
	gauge("escrow_journal_pinned_holds", "Holds pinned because their usage waits in the journal.", func(s accounting.RecorderStats) int64 { return s.Pinned })
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "escrow_journal_degraded",
		Help: "1 while new requests are refused because the local journal is nearly full."},
		func() float64 {
			if r.Degraded() {
				return 1
			}
			return 0
		}))
	counter("escrow_journal_events_total", "Usage events written to the local journal because the ledger was unreachable.", func(s accounting.RecorderStats) int64 { return s.Journaled })
	counter("escrow_journal_replays_total", "Successful replays of the local journal into the ledger.", func(s accounting.RecorderStats) int64 { return s.Replays })
	counter("escrow_journal_replayed_events_total", "Usage events replayed from the local journal into the ledger.", func(s accounting.RecorderStats) int64 { return s.Replayed })
	counter("escrow_journal_replay_errors_total", "Failed replay attempts (the ledger still unreachable).", func(s accounting.RecorderStats) int64 { return s.ReplayErrors })
	counter("escrow_journal_pin_errors_total", "Pin or unpin calls that failed (retried).", func(s accounting.RecorderStats) int64 { return s.PinErrors })
	counter("escrow_holds_finished_total", "Holds finished right after their usage was recorded (unused part given back, out of the in-flight count).", func(s accounting.RecorderStats) int64 { return s.Finished })
	counter("escrow_finish_errors_total", "Record batches whose holds could not be finished (they wait for the settle instead).", func(s accounting.RecorderStats) int64 { return s.FinishErrors })
	counter("escrow_finish_skipped_total", "Holds not finished because their Redis node had too many finish calls in flight (slow or dead); they wait for the settle.", func(s accounting.RecorderStats) int64 { return s.FinishSkipped })
	counter("escrow_journal_full_total", "Batches refused because the local journal was full (those requests failed).", func(s accounting.RecorderStats) int64 { return s.JournalFull })
	m.journalRefused = prometheus.NewCounter(prometheus.CounterOpts{Name: "escrow_journal_refused_total",
		Help: "Requests refused with 503 because the local journal was nearly full."})
	m.reg.MustRegister(m.journalRefused)
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// observe turns a middleware outcome into metrics.
func (m *metrics) observe(o middleware.Outcome) {
	label := string(o.Kind)
	switch {
	case o.Kind == middleware.OutcomeRefused && o.Code != "":
		label = o.Code
	case o.FailOpen:
		label = "fail_open"
	}
	m.requests.WithLabelValues(label).Inc()
	if o.Duration > 0 {
		m.latency.WithLabelValues(string(o.Kind)).Observe(o.Duration.Seconds())
	}
	if o.HoldAmount > 0 {
		m.holds.Observe(float64(o.HoldAmount))
	}
	if o.FitCap > 0 {
		m.fitted.Inc()
	}
	if o.Kind == middleware.OutcomeRecorded || o.Kind == middleware.OutcomeEstimated || o.Kind == middleware.OutcomeRecordLater {
		m.costs.Observe(float64(o.Cost))
		m.spend.WithLabelValues(o.Model, string(o.Kind)).Add(float64(o.Cost))
		m.tokens.WithLabelValues(o.Model, "prompt").Add(float64(o.Usage.Prompt))
		m.tokens.WithLabelValues(o.Model, "cached").Add(float64(o.Usage.Of(pricing.CachedInput)))
		m.tokens.WithLabelValues(o.Model, "completion").Add(float64(o.Usage.Completion))
		for c, n := range o.Usage.Units { // each other class by its name (audio_input …)
			if c != pricing.CachedInput {
				m.tokens.WithLabelValues(o.Model, string(c)).Add(float64(n))
			}
		}
	}
	if o.Status == http.StatusServiceUnavailable {
		m.errors.WithLabelValues("redis").Inc()
	}
	if o.Kind == middleware.OutcomeRecordFailed || o.Kind == middleware.OutcomeRecordUnknown || o.Kind == middleware.OutcomeRecordLater {
		m.errors.WithLabelValues("ledger").Inc()
	}
}
