package server

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/tidwall/gjson"

	"github.com/llmescrow/escrow/async"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/middleware"
)

// Background responses (DESIGN.md "Async work", docs/jobs.md): the middleware holds the
// request and records its job (middleware.Config.Jobs: jobStarter, the poller below); the
// poller polls the upstream for it (responsesUpstream); the routes on a response pass only for
// the org that created it.

// jobStarter is the middleware's Jobs: the server's poller, made after the middleware.
type jobStarter struct{ s *Server }

func (j jobStarter) Begin(ctx context.Context, jb job.Job) (job.Job, error) {
	if j.s.poller == nil {
		return jb, errors.New("server: no job poller")
	}
	return j.s.poller.Begin(ctx, jb)
}

// openJobs makes the poller over the ledger's jobs (when it has them) and registers the
// background responses' upstream.
func (s *Server) openJobs() error {
	js, ok := s.ledger.(job.Store)
	if !ok {
		return nil
	}
	var err error
	lease := cmp.Or(s.cfg.JobLease, async.DefaultLease)
	s.poller, err = async.NewPoller(js, s.store, &async.Config{Lease: lease, MaxBackoff: s.cfg.JobMaxBackoff,
		MinBackoff: min(s.cfg.JobMinBackoff, s.cfg.JobMaxBackoff), PollTimeout: min(async.DefaultPollTimeout, lease/2), Logger: s.log})
	if err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	s.poller.Handle(job.BackgroundResponse, async.UpstreamFunc(s.pollResponse))
	return nil
}

// jobsClient is the client the poller asks the upstream with.
var jobsClient = &http.Client{Timeout: 30 * time.Second}

// upstreamURL is the URL of path on the job's upstream (its model's OpenAI route), and the
// upstream.
func (s *Server) jobUpstream(j job.Job, path string) (*upstream, string, error) {
	u := s.routes.lookup(StyleOpenAI, j.Model)
	if u == nil {
		return nil, "", fmt.Errorf("no upstream for model %q", j.Model)
	}
	to := *u.base
	to.Path = strings.TrimSuffix(to.Path, "/") + path
	to.RawPath = ""
	return u, to.String(), nil
}

// pollResponse asks the upstream where a background response stands.
func (s *Server) pollResponse(ctx context.Context, j job.Job) (async.Observation, error) {
	u, to, err := s.jobUpstream(j, "/v1/responses/"+url.PathEscape(j.UpstreamID))
	if err != nil {
		return async.Observation{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, to, nil)
	if err != nil {
		return async.Observation{}, err
	}
	u.setKey(req.Header)
	res, err := jobsClient.Do(req)
	if err != nil {
		return async.Observation{}, err
	}
	defer res.Body.Close()
	body, err := io.ReadAll(io.LimitReader(res.Body, maxJobBody))
	if err != nil {
		return async.Observation{}, err
	}
	switch {
	case res.StatusCode == http.StatusNotFound:
		return async.Observation{Gone: true, Reason: "the upstream answered 404"}, nil
	case res.StatusCode/100 != 2:
		return async.Observation{}, fmt.Errorf("upstream answered %d", res.StatusCode)
	}
	return responseObservation(j, body)
}

// maxJobBody bounds a response object read for its status and usage.
const maxJobBody = 32 << 20

// responseObservation reads a response object: its status and, once ended, what it billed,
// priced with the job's prices. A response that ended completed or incomplete without a
// readable usage is billed its hold (what the org agreed to risk, as a live request's 2xx
// without usage); a failed or cancelled one without usage bills nothing.
func responseObservation(j job.Job, body []byte) (async.Observation, error) {
	_, status, usage, ok := middleware.ResponseState(body)
	st := middleware.JobStatus(status)
	if st == "" {
		return async.Observation{}, fmt.Errorf("response %s: unknown status %q", j.UpstreamID, status)
	}
	o := async.Observation{Status: st}
	if !st.Terminal() {
		return o, nil
	}
	if at := gjson.GetBytes(body, "completed_at"); at.Type == gjson.Number && at.Int() > 0 {
		o.EndedAt = time.Unix(at.Int(), 0) // the settle lag counts from the upstream's end
	}
	switch {
	case ok:
		cost, err := j.Prices.Cost(usage)
		if err != nil {
			o.Lines = []job.Line{{Cost: j.Hold, Estimated: true}}
			o.Reason = "usage could not be priced"
			break
		}
		o.Lines = []job.Line{{Usage: usage, Cost: cost}}
	case st == job.Completed || st == job.Incomplete:
		o.Lines, o.Reason = []job.Line{{Cost: j.Hold, Estimated: true}}, "ended without a usage"
	}
	return o, nil
}

// mountJobs mounts the routes on a background response behind the middleware (which
// authenticates them: they are PassThrough paths).
func (s *Server) mountJobs(e *echo.Echo, mw echo.MiddlewareFunc) {
	if s.poller == nil {
		return
	}
	e.GET("/v1/responses/:id", s.responseRoute, mw)
	e.DELETE("/v1/responses/:id", s.responseRoute, mw)
	e.GET("/v1/responses/:id/input_items", s.responseRoute, mw)
	e.POST("/v1/responses/:id/cancel", s.responseRoute, mw)
	e.GET("/v1/escrow/jobs", s.customerJobs, mw)
}

// jobPaths are the PassThrough paths of the job routes.
func jobPaths() []string { return []string{"/v1/responses/*", "/v1/escrow/jobs"} }

// customerJob is a job as its org's own key sees it (GET /v1/escrow/jobs): amounts in
// micro-units, like the admin API.
type customerJob struct {
	ID         string     `json:"id"` // the upstream's id: what the client knows
	Kind       job.Kind   `json:"kind"`
	Model      string     `json:"model"`
	Status     job.Status `json:"status"`
	Hold       int64      `json:"hold"`
	Cost       int64      `json:"cost"`
	Unresolved bool       `json:"unresolved,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	SettledAt  *time.Time `json:"settled_at"`
}

// customerJobs lists the jobs of the key's org, newest first (?live=true: only those still
// holding; ?limit=N, at most 1000).
func (s *Server) customerJobs(c echo.Context) error {
	who, _ := middleware.IdentityOf(c)
	q := job.Query{Org: who.Org, Live: c.QueryParam("live") == "true"}
	q.Limit, _ = strconv.Atoi(c.QueryParam("limit"))
	js, err := s.poller.Jobs().Jobs(c.Request().Context(), q)
	if err != nil {
		s.log.Warn("customer jobs", "err", err)
		return middleware.WriteError(c, &middleware.Error{Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable,
			Code: middleware.CodeServiceUnavailable, RetryAfter: 5 * time.Second, Message: "The billing service is unavailable; please retry later."})
	}
	out := make([]customerJob, len(js))
	for i, j := range js {
		out[i] = customerJob{ID: j.UpstreamID, Kind: j.Kind, Model: j.Model, Status: j.Status, Hold: j.Hold, Cost: j.Cost,
			Unresolved: j.Unresolved, CreatedAt: j.CreatedAt, SettledAt: j.SettledAt}
	}
	return c.JSON(http.StatusOK, map[string]any{"object": "list", "data": out})
}

// responseRoute passes a request on a background response to its upstream, only for the org
// that created it (any other org, or a response escrow did not start, gets 404: never another
// customer's data through the shared upstream key). A GET or a cancel whose answer shows the
// response ended settles its job (the poller may have, first: then nothing happens).
func (s *Server) responseRoute(c echo.Context) error {
	req := c.Request()
	id := c.Param("id")
	who, _ := middleware.IdentityOf(c)
	j, err := s.poller.Jobs().JobByUpstream(req.Context(), job.BackgroundResponse, id)
	switch {
	case errors.Is(err, job.ErrUnknownJob) || err == nil && j.Org != who.Org:
		return middleware.WriteError(c, &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest,
			Code: middleware.CodeNotFound, Param: "response_id", Message: "No response found with id '" + id + "'."})
	case err != nil:
		s.log.Warn("job lookup", "response_id", id, "err", err)
		return middleware.WriteError(c, &middleware.Error{Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable,
			Code: middleware.CodeServiceUnavailable, RetryAfter: 5 * time.Second, Message: "The billing service is unavailable; please retry later."})
	}
	if req.Method == http.MethodDelete && j.Live() {
		// A deleted response can no longer be read: its end is read first, so that it is billed.
		o, err := s.pollResponse(req.Context(), j)
		if err == nil {
			j, _, err = s.poller.Observe(req.Context(), j, o)
		}
		if err != nil || j.Live() {
			return middleware.WriteError(c, &middleware.Error{Status: http.StatusBadRequest, Type: middleware.TypeInvalidRequest,
				Code: "response_in_progress", Message: "This response has not ended yet: cancel it first, then delete it."})
		}
	}
	u, _, err := s.jobUpstream(j, "")
	if err != nil {
		return middleware.WriteError(c, &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest,
			Code: middleware.CodeNotFound, Message: "No response found with id '" + id + "'."})
	}
	q := url.Values{}
	for _, name := range []string{"stream", "starting_after", "include[]", "include", "after", "before", "limit", "order"} {
		for _, v := range req.URL.Query()[name] {
			q.Add(name, v)
		}
	}
	req.Header.Del("Authorization")
	req.Header.Del("X-Api-Key")
	stream := q.Get("stream") == "true"
	read := j.Live() && (req.Method == http.MethodGet && !strings.HasSuffix(req.URL.Path, "/input_items") ||
		strings.HasSuffix(req.URL.Path, "/cancel"))
	var tee *teeWriter
	w := http.ResponseWriter(finalOnly{c.Response()})
	if read {
		tee = &teeWriter{ResponseWriter: w}
		w = tee
	}
	ctx := context.WithValue(req.Context(), upstreamCtxKey{}, u)
	ctx = context.WithValue(ctx, jobQueryKey{}, q.Encode())
	s.jobProxy.ServeHTTP(w, req.WithContext(ctx))
	if tee != nil && tee.status/100 == 2 && !tee.over {
		body := tee.buf.Bytes()
		if stream {
			body = streamedEnd(body)
		}
		if o, err := responseObservation(j, body); err == nil && body != nil {
			if _, _, err := s.poller.Observe(context.WithoutCancel(req.Context()), j, o); err != nil {
				s.log.Warn("settle job from a client's read", "job", j.ID, "err", err)
			}
		}
	}
	return nil
}

// streamedEnd is the response object of a Responses event stream's terminal event
// (response.completed, .incomplete, .failed or .cancelled), or nil when the stream has none.
func streamedEnd(stream []byte) []byte {
	var end []byte
	for _, line := range bytes.Split(stream, []byte("\n")) {
		data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r"), []byte("data:"))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		switch gjson.GetBytes(data, "type").String() {
		case "response.completed", "response.incomplete", "response.failed", "response.cancelled":
			if r := gjson.GetBytes(data, "response"); r.IsObject() {
				end = []byte(r.Raw)
			}
		}
	}
	return end
}

// jobQueryKey carries the query a job route forwards (its own allow-list) to the proxy's
// Rewrite.
type jobQueryKey struct{}

// teeWriter keeps a copy of a response body (up to maxJobBody) as it passes.
type teeWriter struct {
	http.ResponseWriter
	status int
	buf    bytes.Buffer
	over   bool
}

func (t *teeWriter) WriteHeader(code int) {
	if t.status == 0 && code >= 200 {
		t.status = code
	}
	t.ResponseWriter.WriteHeader(code)
}

func (t *teeWriter) Write(p []byte) (int, error) {
	if t.status == 0 {
		t.status = http.StatusOK
	}
	if !t.over {
		if t.buf.Len()+len(p) > maxJobBody {
			t.over = true
			t.buf.Reset()
		} else {
			t.buf.Write(p)
		}
	}
	return t.ResponseWriter.Write(p)
}

func (t *teeWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// jobMetrics: the live jobs per kind (read from the ledger at each scrape, at most once a
// second), and this process's polls, settles, unresolved jobs and settle lag.
func (m *metrics) jobMetrics(a *Server) {
	p := a.poller
	if p == nil {
		return
	}
	counter, gauge := statFuncs(m.reg, p.Stats)
	counter("escrow_job_claims_total", "Jobs (background responses, batches) this process claimed with a lease.", func(s async.Stats) int64 { return s.Claimed })
	counter("escrow_job_polls_total", "Polls of the upstream for a job.", func(s async.Stats) int64 { return s.Polls })
	counter("escrow_job_poll_errors_total", "Polls that failed (retried after a backoff).", func(s async.Stats) int64 { return s.PollErrors })
	counter("escrow_jobs_settled_total", "Jobs this process settled (by its poll, a client's read or a cancel).", func(s async.Stats) int64 { return s.Settled })
	counter("escrow_jobs_unresolved_total", "Jobs the upstream lost, charged by the estimate (job.unresolved).", func(s async.Stats) int64 { return s.Unresolved })
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "escrow_job_settle_lag_seconds_total",
		Help: "Σ time from a job's end upstream (when the upstream says) to its settle, over the jobs settled here."},
		func() float64 { return p.Stats().LagSum.Seconds() }))
	gauge("escrow_job_settle_lag_max_milliseconds", "The longest settle lag seen here.", func(s async.Stats) int64 { return s.LagMax.Milliseconds() })
	var (
		mu   sync.Mutex
		at   time.Time
		live map[job.Kind]int
	)
	read := func(k job.Kind) float64 {
		mu.Lock()
		defer mu.Unlock()
		if time.Since(at) > time.Second {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			n, err := p.Jobs().LiveJobs(ctx)
			cancel()
			if err == nil {
				live, at = n, time.Now()
			}
		}
		return float64(live[k])
	}
	for _, k := range job.Kinds {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "escrow_jobs_live",
			Help: "Jobs recorded and not settled yet (their holds held), by kind.", ConstLabels: prometheus.Labels{"kind": string(k)}},
			func() float64 { return read(k) }))
	}
}
