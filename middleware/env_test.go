package middleware

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/redis/go-redis/v9"
	"github.com/tidwall/gjson"
)

const (
	testModel   = "gpt-test"
	testCredit  = int64(1_000_000)
	upstreamKey = "sk-upstream-secret"
)

var testPrices = pricing.Prices{pricing.Input: 1_000_000, pricing.CachedInput: 500_000, pricing.Output: 2_000_000}

// chatUsage is what the fake upstream reports for chat requests.
const chatUsageJSON = `{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":2},"completion_tokens_details":{"reasoning_tokens":1}}`

var chatUsage = pricing.Usage{Prompt: 12, Completion: 5, Reasoning: 1, Units: pricing.Units{pricing.CachedInput: 2}}

// spyRecorder records into the ledger and remembers the events.
type spyRecorder struct {
	l *memledger.Ledger
	// fin, when set, finishes each recorded event's hold, as the proxy's *accounting.Recorder
	// does with the store as its Finisher: a request that ended is no longer in flight.
	fin  accounting.Finisher
	mu   sync.Mutex
	evs  []ledger.UsageEvent
	fail error
}

func (s *spyRecorder) Record(ctx context.Context, ev ledger.UsageEvent) error {
	s.mu.Lock()
	fail := s.fail
	s.mu.Unlock()
	if fail != nil {
		return fail
	}
	if err := s.l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
		return err
	}
	s.mu.Lock()
	s.evs = append(s.evs, ev)
	s.mu.Unlock()
	return nil
}

// RecordReceipt is Record, then (with fin) the finish of the event's hold, best effort as the
// recorder's; no balance is claimed.
func (s *spyRecorder) RecordReceipt(ctx context.Context, ev ledger.UsageEvent) (accounting.Receipt, error) {
	if err := s.Record(ctx, ev); err != nil {
		return accounting.Receipt{}, err
	}
	if s.fin != nil && ev.HoldAmount > 0 {
		_, _ = s.fin.FinishEach(ctx, []balance.Finish{{Org: ev.Org, HoldID: ev.ID, Cost: ev.Cost}})
	}
	return accounting.Receipt{}, nil
}

// Void voids the event in the ledger, as *accounting.Recorder does: a failed Record whose event
// is voided is certainly not charged, so the client may be told it failed.
func (s *spyRecorder) Void(ctx context.Context, ev ledger.UsageEvent) error {
	return s.l.VoidUsage(ctx, ev)
}

// setFail makes every Record from now on fail with err (nil: succeed).
func (s *spyRecorder) setFail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = err
}

func (s *spyRecorder) events() []ledger.UsageEvent {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]ledger.UsageEvent(nil), s.evs...)
}

// upstreamReq is what the fake upstream received.
type upstreamReq struct {
	Path, Auth, AcceptEncoding string
	Body                       []byte
}

type testEnv struct {
	t        *testing.T
	redis    *testutil.RedisEnv
	fault    *testutil.FaultProxy // in front of Redis when withFault
	store    *balance.Store
	ledger   *memledger.Ledger
	rec      *spyRecorder
	org, key string
	srv      *httptest.Server
	up       *httptest.Server
	upMu     sync.Mutex
	upReqs   []upstreamReq
	// upstream answers the request; default fakeOpenAI.
	upstream func(w http.ResponseWriter, r *http.Request, body []byte)
	outcomes chan Outcome
}

type envOpt struct {
	cfg       func(*Config)
	storeCfg  func(*balance.Config)
	withFault bool
	mini      bool // miniredis even when a real Redis is configured
	finish    bool // the recorder finishes each recorded hold (spyRecorder.fin)
	// wrap, if set, wraps the proxy's handler (the server side of the client's connection).
	wrap func(http.Handler) http.Handler
}

// hangLimit bounds a wait for an event that must come: it only ends a test that would hang, so
// it is far above what a loaded machine (race detector, two cores, other packages compiling)
// takes. A wait returns as soon as its event comes.
const hangLimit = time.Minute

func newEnv(t *testing.T, o envOpt) *testEnv {
	t.Helper()
	ctx := context.Background()
	e := &testEnv{t: t, ledger: memledger.New(), outcomes: make(chan Outcome, 100)}
	if o.mini {
		e.redis = testutil.MiniRedis(t)
	} else {
		e.redis = testutil.Redis(t)
	}
	client := e.redis.Client
	if o.mini {
		// miniredis runs every script in Go, one after another: a burst of 2,000 reserves
		// queues for the client's 20 connections far longer than the default pool (4 s) and read
		// (3 s) timeouts under the race detector on a loaded machine, and each timed-out call is a
		// 503. The request path's own deadlines (ReserveTimeout) still bound each call.
		c := redis.NewClient(&redis.Options{Addr: e.redis.Mini.Addr(), PoolTimeout: 2 * time.Minute, ReadTimeout: time.Minute,
			ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = c.Close() })
		client = c
	}
	if o.withFault {
		addr := strings.TrimPrefix(e.redis.URL, "redis://")
		if opt, err := redis.ParseURL(e.redis.URL); err == nil {
			addr = opt.Addr
		}
		e.fault = testutil.StartFaultProxy(t, addr)
		opt := &redis.Options{Addr: e.fault.Addr(), DialTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond,
			WriteTimeout: 300 * time.Millisecond, MaxRetries: 1}
		if ro, err := redis.ParseURL(e.redis.URL); err == nil {
			opt.DB = ro.DB
		}
		c := redis.NewClient(opt)
		t.Cleanup(func() { _ = c.Close() })
		client = c
	}
	// An embedded Redis has no round trips to save, and a coalesced pipeline of a hundred scripts
	// run one after another could outlast a call's deadline, failing its whole batch: no
	// coalescing, as the server does for its embedded Redis.
	bcfg := balance.Config{Ledger: e.ledger, Prefix: e.redis.Prefix, Logger: quiet, NoCoalesce: o.mini}
	if o.storeCfg != nil {
		o.storeCfg(&bcfg)
	}
	st, err := balance.New(ctx, client, &bcfg)
	if err != nil {
		t.Fatalf("balance.New: %v", err)
	}
	e.store = st
	e.rec = &spyRecorder{l: e.ledger}
	if o.finish {
		e.rec.fin = st
	}
	e.org = testutil.RandomName("org")
	must(t, e.ledger.CreateOrg(ctx, e.org))
	if _, _, err := e.ledger.Credit(ctx, e.org, testCredit, "pay-"+e.org); err != nil {
		t.Fatal(err)
	}
	_, e.key, err = e.ledger.CreateKey(ctx, e.org)
	must(t, err)
	must(t, e.ledger.PutModel(ctx, ledger.Model{Name: testModel, Prices: testPrices, MaxInputTokens: 100_000, MaxOutputTokens: 1000, DefaultHold: 5000}))
	must(t, e.ledger.PutModel(ctx, ledger.Model{Name: "text-embedding-test", Prices: pricing.Prices{pricing.Input: 1_000_000}, MaxInputTokens: 8000, DefaultHold: 100}))

	e.upstream = fakeOpenAI
	e.up = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		e.upMu.Lock()
		e.upReqs = append(e.upReqs, upstreamReq{Path: r.URL.Path, Auth: r.Header.Get("Authorization"), AcceptEncoding: r.Header.Get("Accept-Encoding"), Body: body})
		h := e.upstream
		e.upMu.Unlock()
		h(w, r, body)
	}))
	t.Cleanup(e.up.Close)
	upURL, _ := url.Parse(e.up.URL)
	rp := httputil.NewSingleHostReverseProxy(upURL)
	dir := rp.Director
	rp.Director = func(r *http.Request) {
		dir(r)
		r.Header.Set("Authorization", "Bearer "+upstreamKey)
	}
	rp.FlushInterval = -1
	rp.ErrorLog = log.New(io.Discard, "", 0)

	cfg := Config{Store: e.store, Ledger: e.ledger, Recorder: e.rec, PassThrough: []string{"/v1/models"},
		Logger: quiet, OnOutcome: func(o Outcome) { e.outcomes <- o }}
	if !o.withFault {
		// A test that is not about a slow Redis or ledger must not get a 503 because a loaded
		// parallel run (race detector, two cores) starved one call past the 1 s default: the
		// tests of those deadlines set them, or run behind the fault proxy.
		cfg.ReserveTimeout, cfg.LookupTimeout = 20*time.Second, 20*time.Second
	}
	if o.cfg != nil {
		o.cfg(&cfg)
	}
	ec := echo.New()
	ec.HideBanner, ec.HidePort = true, true
	ec.Use(New(cfg))
	ec.Any("/v1/*", echo.WrapHandler(rp))
	var h http.Handler = ec
	if o.wrap != nil {
		h = o.wrap(h)
	}
	e.srv = httptest.NewServer(h)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *testEnv) setUpstream(h func(w http.ResponseWriter, r *http.Request, body []byte)) {
	e.upMu.Lock()
	e.upstream = h
	e.upMu.Unlock()
}

func (e *testEnv) upstreamRequests() []upstreamReq {
	e.upMu.Lock()
	defer e.upMu.Unlock()
	return append([]upstreamReq(nil), e.upReqs...)
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// post sends a request with the env's key (key "" = none).
func (e *testEnv) post(ctx context.Context, path, key, body string) *http.Response {
	e.t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	must(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	must(e.t, err)
	return resp
}

func (e *testEnv) outcome() Outcome {
	e.t.Helper()
	select {
	case o := <-e.outcomes:
		return o
	case <-time.After(hangLimit):
		e.t.Fatal("no outcome reported")
	}
	return Outcome{}
}

func (e *testEnv) state() balance.State {
	e.t.Helper()
	st, err := e.store.State(context.Background(), e.org)
	must(e.t, err)
	return st
}

func (e *testEnv) account() ledger.Account {
	e.t.Helper()
	a, err := e.ledger.Account(context.Background(), e.org)
	must(e.t, err)
	return a
}

// usageRecorded reports whether the ledger holds unsettled usage for the hold id.
func (e *testEnv) usageRecorded(id string) bool {
	e.t.Helper()
	m, err := e.ledger.UnsettledUsage(context.Background(), e.org, []string{id})
	must(e.t, err)
	return m[id]
}

// assertNothingDebited checks the hot balance (if seeded) and the ledger are untouched.
func (e *testEnv) assertNothingDebited() {
	e.t.Helper()
	if st := e.state(); st.Exists && (st.Balance != testCredit || st.Held != 0 || st.Holds != 0) {
		e.t.Fatalf("hot balance touched: %+v", st)
	}
	if a := e.account(); a.Balance != testCredit || a.Pending != 0 {
		e.t.Fatalf("ledger touched: %+v", a)
	}
	if evs := e.rec.events(); len(evs) != 0 {
		e.t.Fatalf("usage recorded: %+v", evs)
	}
}

// assertHoldKept checks that the request's hold is still on (the worker settles it) and its
// usage event is in the ledger.
func (e *testEnv) assertRecorded(id string, hold int64) ledger.UsageEvent {
	e.t.Helper()
	if !e.usageRecorded(id) {
		e.t.Fatalf("no usage for %s in the ledger", id)
	}
	var ev ledger.UsageEvent
	for _, x := range e.rec.events() {
		if x.ID == id {
			ev = x
		}
	}
	if ev.ID == "" || ev.Org != e.org || ev.HoldAmount != hold {
		e.t.Fatalf("event %+v (hold %d)", ev, hold)
	}
	if st := e.state(); st.Balance != testCredit-hold || st.Held != hold || st.Holds != 1 {
		e.t.Fatalf("hot balance after a recorded request: %+v, hold %d", st, hold)
	}
	return ev
}

func cost(t *testing.T, u pricing.Usage) int64 {
	c, err := testPrices.Cost(u)
	must(t, err)
	return c
}

// openAIError decodes and checks the OpenAI error shape.
func openAIError(t *testing.T, body []byte) (typ, code, param string) {
	t.Helper()
	var shape map[string]map[string]any
	if err := json.Unmarshal(body, &shape); err != nil {
		t.Fatalf("error body %q: %v", body, err)
	}
	inner, ok := shape["error"]
	if !ok || len(shape) != 1 {
		t.Fatalf("error body %q is not {\"error\":{…}}", body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := inner[k]; !ok {
			t.Fatalf("error body %q lacks %q", body, k)
		}
	}
	if m, _ := inner["message"].(string); m == "" {
		t.Fatalf("empty message in %q", body)
	}
	typ, _ = inner["type"].(string)
	code, _ = inner["code"].(string)
	param, _ = inner["param"].(string)
	return
}

// fakeOpenAI answers like OpenAI: JSON or SSE for chat/completions and responses, JSON for
// embeddings. Chat streams carry "usage":null chunks and a usage-only chunk only when
// stream_options.include_usage is true.
func fakeOpenAI(w http.ResponseWriter, r *http.Request, body []byte) {
	stream := gjson.GetBytes(body, "stream").Bool()
	incl := gjson.GetBytes(body, "stream_options.include_usage").Bool()
	switch r.URL.Path {
	case EndpointEmbeddings:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"text-embedding-test","usage":{"prompt_tokens":8,"total_tokens":8}}`)
	case EndpointResponses:
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"resp_1","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"Hi"}]}],"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":10},"output_tokens":30,"output_tokens_details":{"reasoning_tokens":12},"total_tokens":50}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ev := range responsesEvents {
			_, _ = io.WriteString(w, ev)
			w.(http.Flusher).Flush()
		}
	default:
		if !stream {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-test","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],"usage":`+chatUsageJSON+`}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ch := range chatChunks(incl) {
			_, _ = io.WriteString(w, ch)
			w.(http.Flusher).Flush()
		}
	}
}

var responsesEvents = []string{
	"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null}}\n\n",
	"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
	"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":10},\"output_tokens\":30,\"output_tokens_details\":{\"reasoning_tokens\":12},\"total_tokens\":50}}}\n\n",
}

var responsesUsage = pricing.Usage{Prompt: 20, Completion: 30, Reasoning: 12, Units: pricing.Units{pricing.CachedInput: 10}}

func chatChunks(includeUsage bool) []string {
	u := ""
	if includeUsage {
		u = `,"usage":null`
	}
	chunks := []string{
		`data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]` + u + "}\n\n",
		`data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]` + u + "}\n\n",
	}
	if includeUsage {
		chunks = append(chunks, `data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":`+chatUsageJSON+"}\n\n")
	}
	return append(chunks, "data: [DONE]\n\n")
}

// readEvents reads an SSE body event by event, calling fn with each (until fn returns false).
func readEvents(t *testing.T, body io.Reader, fn func(ev string) bool) {
	t.Helper()
	br := bufio.NewReader(body)
	var ev bytes.Buffer
	for {
		line, err := br.ReadString('\n')
		ev.WriteString(line)
		if line == "\n" || line == "\r\n" || (err != nil && ev.Len() > 0) {
			if !fn(ev.String()) {
				return
			}
			ev.Reset()
		}
		if err != nil {
			return
		}
	}
}

func jsonBody(model string, extra string) string {
	b := `{"model":"` + model + `","messages":[{"role":"user","content":"Say hello"}]`
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

var quiet = slog.New(slog.DiscardHandler)
