package middleware

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// The one rule for a response that ends without readable usage (DESIGN "The flow", step 3): a
// hang-up past the read-on bound, a transport cut, an upstream error after output. A bounded
// request (its hold is its bound) is charged its hold; an unbounded one the input bound (the
// body's bytes at the highest input price) plus what was streamed, never more than the hold;
// all marked estimated. Each case runs on the four priced text endpoints.

// readOn is the read-on bound after a hang-up in these tests: short, so no test waits long.
const readOn = 100 * time.Millisecond

// estimateCase is one endpoint's request and the SSE events its upstream sends.
type estimateCase struct {
	name, path string
	bounded    string // a plain-text body with an output cap of 500: its hold is its bound
	unbounded  string // the same with a field escrow cannot price: its hold is not a bound
	first      string // the first events: one with 3 bytes of output text
	errorEvent string // how this API's upstream ends a stream with an error
	// input is the input tokens the upstream itself reported before the end (Anthropic's
	// message_start), 0: none, so the input bound is the body's bytes.
	input int64
}

const anthStart = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":9,\"output_tokens\":1}}}\n\n" +
	"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n"

var estimateCases = []estimateCase{
	{name: "chat", path: EndpointChat,
		bounded:    `{"model":"gpt-test","messages":[{"role":"user","content":"Say hello"}],"max_tokens":500,"stream":true}`,
		unbounded:  `{"model":"gpt-test","messages":[{"role":"user","content":"Say hello"}],"max_tokens":500,"stream":true,"x_unpriced":1}`,
		first:      chatChunks(true)[0],
		errorEvent: `data: {"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}` + "\n\n"},
	{name: "completions", path: EndpointCompletions,
		bounded:    `{"model":"gpt-test","prompt":"Say hello","max_tokens":500,"stream":true}`,
		unbounded:  `{"model":"gpt-test","prompt":"Say hello","max_tokens":500,"stream":true,"x_unpriced":1}`,
		first:      `data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"Hel"}],"usage":null}` + "\n\n",
		errorEvent: `data: {"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}` + "\n\n"},
	{name: "responses", path: EndpointResponses,
		bounded:    `{"model":"gpt-test","input":"Say hello","max_output_tokens":500,"stream":true}`,
		unbounded:  `{"model":"gpt-test","input":"Say hello","max_output_tokens":500,"stream":true,"x_unpriced":1}`,
		first:      responsesEvents[0] + responsesEvents[1],
		errorEvent: "event: error\ndata: {\"type\":\"error\",\"code\":\"server_error\",\"message\":\"The server had an error.\",\"param\":null,\"sequence_number\":2}\n\n"},
	{name: "responses-failed", path: EndpointResponses,
		bounded:    `{"model":"gpt-test","input":"Say hello","max_output_tokens":500,"stream":true}`,
		unbounded:  `{"model":"gpt-test","input":"Say hello","max_output_tokens":500,"stream":true,"x_unpriced":1}`,
		first:      responsesEvents[0] + responsesEvents[1],
		errorEvent: "event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"id\":\"resp_1\",\"status\":\"failed\",\"error\":{\"code\":\"server_error\",\"message\":\"The server had an error.\"},\"usage\":null}}\n\n"},
	{name: "messages", path: EndpointMessages,
		bounded:    `{"model":"gpt-test","max_tokens":500,"stream":true,"messages":[{"role":"user","content":"Say hello"}]}`,
		unbounded:  `{"model":"gpt-test","max_tokens":500,"stream":true,"messages":[{"role":"user","content":"Say hello"}],"x_unpriced":1}`,
		first:      anthStart,
		errorEvent: "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
		input:      9},
}

// estimateBound is what an unbounded request is charged: the input bound (the upstream's own
// input count when it gave one, else the body's bytes at the highest input price) plus the
// output streamed, never more than the hold.
func estimateBound(t *testing.T, c estimateCase, body string, out, hold int64) int64 {
	t.Helper()
	var b int64
	var err error
	if c.input > 0 {
		b, err = testPrices.Cost(pricing.Usage{Prompt: c.input, Completion: out})
	} else if c.path == EndpointMessages {
		b, err = testPrices.Bound(int64(len(body)), out)
	} else {
		b, err = testPrices.BoundFor(int64(len(body)), out, pricing.TextClasses) // only Anthropic's usage carries cache writes
	}
	must(t, err)
	return min(b, hold)
}

// checkEstimate checks that the request was charged want, marked estimated, with its hold kept
// for the worker to settle.
func (e *testEnv) checkEstimate(o Outcome, want int64) ledger.UsageEvent {
	e.t.Helper()
	if o.Kind != OutcomeEstimated || o.Cost != want {
		e.t.Fatalf("outcome %+v: want estimated at %d", o, want)
	}
	ev := e.assertRecorded(o.HoldID, o.HoldAmount)
	if !ev.Estimated || ev.Cost != want {
		e.t.Fatalf("event %+v: want estimated at %d (hold %d)", ev, want, o.HoldAmount)
	}
	return ev
}

// boundOf is the bound of a bounded case's body (output cap 500), which is its hold.
func boundOf(t *testing.T, path, body string) int64 {
	t.Helper()
	classes := pricing.CacheClasses
	if path != EndpointMessages {
		classes = pricing.TextClasses // only Anthropic's usage carries cache writes (HoldAmount)
	}
	b, err := testPrices.BoundFor(int64(len(body)), 500, classes)
	must(t, err)
	return b
}

// hangUpAfterFirstBytes posts body and hangs up once the first bytes of the response came.
func (e *testEnv) hangUpAfterFirstBytes(path, body string) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp := e.post(ctx, path, e.key, body)
	if _, err := io.ReadAtLeast(resp.Body, make([]byte, 8), 1); err != nil {
		e.t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
}

// TestReadOnBoundEstimate (issue 22 item 2 c): a stream that sends one chunk and goes silent
// (as hidden reasoning does) while its client hangs up is read on for the configured bound,
// then cut: a bounded request is charged its hold (a silent phase bills tokens nobody saw), an
// unbounded one the input bound plus what was streamed.
func TestReadOnBoundEstimate(t *testing.T) {
	t.Parallel()
	for _, c := range estimateCases {
		if c.name == "responses-failed" {
			continue // the same stream as "responses" until its end
		}
		for _, bounded := range []bool{true, false} {
			name := c.name + map[bool]string{true: "/bounded", false: "/unbounded"}[bounded]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, envOpt{cfg: func(cfg *Config) { cfg.HangupTimeout = readOn }})
				e.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, c.first)
					w.(http.Flusher).Flush()
					<-r.Context().Done() // silent until escrow cuts it
				})
				body := c.bounded
				if !bounded {
					body = c.unbounded
				}
				e.hangUpAfterFirstBytes(c.path, body)
				o := e.outcome()
				if !errors.Is(o.Err, errHangupBound) {
					t.Fatalf("outcome %+v: want the read-on bound", o)
				}
				want := o.HoldAmount
				if bounded {
					if hold := boundOf(t, c.path, body); o.HoldAmount != hold {
						t.Fatalf("hold %d, want the bound %d", o.HoldAmount, hold)
					}
				} else {
					want = estimateBound(t, c, body, 1, o.HoldAmount)
					if want >= o.HoldAmount {
						t.Fatalf("vacuous: the estimate %d is not below the hold %d", want, o.HoldAmount)
					}
				}
				e.checkEstimate(o, want)
			})
		}
	}
}

// TestUpstreamErrorEstimate (issue 22 item 2 d): a stream the upstream ends with an error after
// output — chat and completions `data: {"error":…}`, Responses `event: error` or
// `response.failed` with null usage, Anthropic's error event — is charged by the same rule on
// every API: a bounded request its hold, an unbounded one the input bound plus what was
// streamed (never the whole hold).
func TestUpstreamErrorEstimate(t *testing.T) {
	t.Parallel()
	for _, c := range estimateCases {
		for _, bounded := range []bool{true, false} {
			name := c.name + map[bool]string{true: "/bounded", false: "/unbounded"}[bounded]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, envOpt{})
				e.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
					w.Header().Set("Content-Type", "text/event-stream")
					_, _ = io.WriteString(w, c.first)
					w.(http.Flusher).Flush()
					_, _ = io.WriteString(w, c.errorEvent)
				})
				body := c.bounded
				if !bounded {
					body = c.unbounded
				}
				resp := e.post(context.Background(), c.path, e.key, body)
				got, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || !strings.Contains(string(got), "error") {
					t.Fatalf("%d %q", resp.StatusCode, got)
				}
				o := e.outcome()
				if !errors.Is(o.Err, errStreamError) {
					t.Fatalf("outcome %+v: want the upstream's error", o)
				}
				want := o.HoldAmount
				if !bounded {
					want = estimateBound(t, c, body, 1, o.HoldAmount)
					if want >= o.HoldAmount {
						t.Fatalf("vacuous: the estimate %d is not below the hold %d", want, o.HoldAmount)
					}
				}
				e.checkEstimate(o, want)
			})
		}
	}
}

// TestInputBoundIsBodyBytes (issue 22 item 2 a): the input of an estimate is the body's bytes
// (tokens never outnumber bytes; text such as "a1a1…" is split per character), not bytes / 4;
// and an estimate is never more than the hold.
func TestInputBoundIsBodyBytes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{cfg: func(cfg *Config) { cfg.HangupTimeout = readOn }})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chatChunks(true)[0])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	prompt := strings.Repeat("a1", 20_000)
	img := `{"role":"user","content":[{"type":"text","text":"` + prompt + `"},{"type":"file","file":{"file_id":"file-1"}}]}` // a file: not bounded
	body := `{"model":"gpt-test","stream":true,"messages":[` + img + `]}`
	e.hangUpAfterFirstBytes(EndpointChat, body)
	o := e.outcome()
	want := estimateBound(t, estimateCase{}, body, 1, o.HoldAmount)
	if want >= o.HoldAmount || want < int64(len(prompt)) {
		t.Fatalf("vacuous: estimate %d, hold %d", want, o.HoldAmount)
	}
	if ev := e.checkEstimate(o, want); ev.Usage.Prompt != int64(len(body)) {
		t.Fatalf("usage %+v: want the body's %d bytes as input", ev.Usage, len(body))
	}

	// The same request to a model whose learned max is below what the request states: held at
	// what it states (issue 32: the hold never drops it), and charged the estimate, no more
	// than the hold.
	body = strings.Replace(body, "gpt-test", "gpt-learned", 1)
	e2 := newEnv(t, envOpt{cfg: func(cfg *Config) { cfg.HangupTimeout = readOn }})
	must(t, e2.ledger.PutModel(context.Background(), ledger.Model{Name: "gpt-learned", Prices: testPrices,
		MaxInputTokens: 100_000, MaxOutputTokens: 1000, MaxCost: 5000}))
	e2.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chatChunks(true)[0])
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	e2.hangUpAfterFirstBytes(EndpointChat, body)
	o = e2.outcome()
	if want := int64(len(body)) + 2*1000; o.HoldAmount != want {
		t.Fatalf("hold %d, want what the request states, %d, above the learned max 5000", o.HoldAmount, want)
	}
	e2.checkEstimate(o, estimateBound(t, estimateCase{}, body, 1, o.HoldAmount))
}

// TestHangupBeforeAnswerCharged (issue 22 item 2 b): a non-streaming request whose client hangs
// up and whose upstream has not answered when the read-on bound ends is charged the estimate
// (the upstream was called: the provider bills it), not released with 0 — a bounded one its
// hold, an unbounded one its input bound.
func TestHangupBeforeAnswerCharged(t *testing.T) {
	t.Parallel()
	for _, c := range estimateCases {
		if c.name == "responses-failed" {
			continue
		}
		for _, bounded := range []bool{true, false} {
			name := c.name + map[bool]string{true: "/bounded", false: "/unbounded"}[bounded]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, envOpt{cfg: func(cfg *Config) { cfg.HangupTimeout = readOn }})
				ctx, hangUp := context.WithCancel(context.Background())
				defer hangUp()
				e.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
					hangUp() // the client leaves once the upstream has the request
					<-r.Context().Done()
				})
				body := strings.Replace(c.bounded, `"stream":true`, `"stream":false`, 1)
				if !bounded {
					body = strings.Replace(c.unbounded, `"stream":true`, `"stream":false`, 1)
				}
				e.postGone(ctx, c.path, body)
				o := e.outcome()
				if !errors.Is(o.Err, errHangupBound) {
					t.Fatalf("outcome %+v: want the read-on bound", o)
				}
				want := o.HoldAmount
				if !bounded {
					want = estimateBound(t, estimateCase{path: c.path}, body, 0, o.HoldAmount)
					if want >= o.HoldAmount {
						t.Fatalf("vacuous: the estimate %d is not below the hold %d", want, o.HoldAmount)
					}
				}
				e.checkEstimate(o, want)
			})
		}
	}
}

// TestHangupUpstreamErrorReleased: an upstream that answers an error after the client hung up
// but within the read-on bound is an upstream failure: released, nothing charged.
func TestHangupUpstreamErrorReleased(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{cfg: func(cfg *Config) { cfg.HangupTimeout = time.Minute }})
	ctx, hangUp := context.WithCancel(context.Background())
	defer hangUp()
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, _ []byte) {
		hangUp()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"server_error","param":null,"code":null}}`)
	})
	e.postGone(ctx, EndpointChat, jsonBody(testModel, `"max_tokens":500`))
	if o := e.outcome(); o.Kind != OutcomeReleased {
		t.Fatalf("outcome %+v: want released", o)
	}
	if evs := e.rec.events(); len(evs) != 0 {
		t.Fatalf("charged %+v", evs)
	}
}

// postGone posts body with ctx, which is cancelled (the client hangs up) before any answer.
func (e *testEnv) postGone(ctx context.Context, path, body string) {
	e.t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	must(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+e.key)
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		resp.Body.Close()
		e.t.Fatalf("the client got an answer (%d) although it hung up", resp.StatusCode)
	}
}
