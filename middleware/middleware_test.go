package middleware

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

func TestRefusals(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	tests := []struct {
		name, path, key, body string
		status                int
		typ, code             string
		header, headerValue   string
	}{
		{"missing key", EndpointChat, "", jsonBody(testModel, ""), 401, TypeInvalidRequest, CodeInvalidAPIKey, "", ""},
		{"unknown key", EndpointChat, "sk-nope", jsonBody(testModel, ""), 401, TypeInvalidRequest, CodeInvalidAPIKey, "", ""},
		{"unpriced path", "/v1/images/variations", e.key, `{"model":"x"}`, 404, TypeInvalidRequest, CodeNotFound, "", ""},
		{"batches", "/v1/batches", e.key, `{}`, 404, TypeInvalidRequest, CodeNotFound, "", ""},
		{"unknown model", EndpointChat, e.key, jsonBody("no-such-model", ""), 404, TypeInvalidRequest, CodeModelNotFound, "", ""},
		{"bad json", EndpointChat, e.key, `{"model":"gpt-test",`, 400, TypeInvalidRequest, CodeInvalidJSON, "", ""},
		{"oversized", EndpointChat, e.key, jsonBody(testModel, `"pad":"`+strings.Repeat("x", 5<<20)+`"`), 413, TypeInvalidRequest, CodeRequestTooLarge, "", ""},
		{"cap above max", EndpointChat, e.key, jsonBody(testModel, `"max_completion_tokens":1001`), 400, TypeInvalidRequest, CodeInvalidValue, "", ""},
		{"cap zero", EndpointChat, e.key, jsonBody(testModel, `"max_tokens":0`), 400, TypeInvalidRequest, CodeInvalidValue, "", ""},
		{"background", EndpointResponses, e.key, `{"model":"gpt-test","input":"hi","background":true}`, 400, TypeInvalidRequest, CodeInvalidValue, "", ""},
		{"audio", EndpointChat, e.key, jsonBody(testModel, `"modalities":["text","audio"],"audio":{"voice":"alloy"}`), 400, TypeInvalidRequest, CodeUnsupported, "", ""},
		{"priority tier", EndpointChat, e.key, jsonBody(testModel, `"service_tier":"priority"`), 400, TypeInvalidRequest, CodeUnsupported, "", ""},
		{"hosted tool", EndpointResponses, e.key, `{"model":"gpt-test","input":"hi","tools":[{"type":"web_search"}]}`, 400, TypeInvalidRequest, CodeUnsupported, "", ""},
		{"GET on a priced path", EndpointChat, e.key, "", 405, TypeInvalidRequest, CodeMethodNotAllowed, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			method := http.MethodPost
			if tt.body == "" {
				method = http.MethodGet
			}
			req, _ := http.NewRequestWithContext(ctx, method, e.srv.URL+tt.path, strings.NewReader(tt.body))
			if tt.key != "" {
				req.Header.Set("Authorization", "Bearer "+tt.key)
			}
			resp, err := http.DefaultClient.Do(req)
			must(t, err)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tt.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tt.status, body)
			}
			typ, code, _ := openAIError(t, body)
			if typ != tt.typ || code != tt.code {
				t.Fatalf("type %q code %q, want %q %q", typ, code, tt.typ, tt.code)
			}
			if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Fatalf("content type %q", ct)
			}
			if o := e.outcome(); o.Kind != OutcomeRefused || o.Status != tt.status || o.Code != tt.code || o.Duration <= 0 {
				t.Fatalf("outcome %+v", o)
			}
		})
	}
	e.assertNothingDebited()
	if n := len(e.upstreamRequests()); n != 0 {
		t.Fatalf("upstream called %d times", n)
	}
}

func TestInsufficientQuota(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	// A poor org: 10 micro-units, less than any hold.
	poor := e.org + "p"
	must(t, e.ledger.CreateOrg(ctx, poor))
	if _, _, err := e.ledger.Credit(ctx, poor, 10, "pay-"+poor); err != nil {
		t.Fatal(err)
	}
	_, key, err := e.ledger.CreateKey(ctx, poor)
	must(t, err)
	resp := e.post(ctx, EndpointChat, key, jsonBody(testModel, ""))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || resp.Header.Get("x-should-retry") != "false" {
		t.Fatalf("status %d, x-should-retry %q: %s", resp.StatusCode, resp.Header.Get("x-should-retry"), body)
	}
	if typ, code, _ := openAIError(t, body); typ != "insufficient_quota" || code != "insufficient_quota" {
		t.Fatalf("type %q code %q", typ, code)
	}
	st, err := e.store.State(ctx, poor)
	must(t, err)
	if !st.Exists || st.Balance != 10 || st.Held != 0 {
		t.Fatalf("poor org debited: %+v", st)
	}
	if len(e.upstreamRequests()) != 0 || len(e.rec.events()) != 0 {
		t.Fatal("refused request reached the upstream or the ledger")
	}
}

func TestTooManyInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{storeCfg: func(c *balance.Config) { c.MaxInFlight = 1 }})
	ctx := context.Background()
	other := uuid.Must(uuid.NewV7()).String()
	if _, err := e.store.Reserve(ctx, balance.ReserveRequest{Org: e.org, HoldID: other, Amount: 7}); err != nil {
		t.Fatal(err)
	}
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 429 || resp.Header.Get("Retry-After") == "" || resp.Header.Get("x-should-retry") == "false" {
		t.Fatalf("status %d, headers %v: %s", resp.StatusCode, resp.Header, body)
	}
	if typ, code, _ := openAIError(t, body); typ != "rate_limit_exceeded" || code != "rate_limit_exceeded" {
		t.Fatalf("type %q code %q", typ, code)
	}
	if st := e.state(); st.Balance != testCredit-7 || st.Held != 7 || st.Holds != 1 {
		t.Fatalf("debited: %+v", st)
	}
}

func TestJSONRecorded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || gjson.GetBytes(body, "choices.0.message.content").String() != "Hello there" ||
		!gjson.GetBytes(body, "usage").IsObject() {
		t.Fatalf("status %d body %s", resp.StatusCode, body)
	}
	id := resp.Header.Get("x-request-id")
	if u, err := uuid.Parse(id); err != nil || u.Version() != 7 || resp.Header.Get("x-escrow-hold-id") != id {
		t.Fatalf("request id %q: %v", id, err)
	}
	o := e.outcome()
	if o.Kind != OutcomeRecorded || o.HoldID != id || !o.Usage.Equal(chatUsage) || o.Duration <= 0 {
		t.Fatalf("outcome %+v", o)
	}
	ev := e.assertRecorded(id, o.HoldAmount)
	// The cost is the event's; the balance after it is left out: this Recorder cannot tell it.
	if c, bal := resp.Header.Get("x-escrow-cost"), resp.Header.Values("x-escrow-balance"); c != itoa(ev.Cost) || len(bal) != 0 {
		t.Fatalf("x-escrow-cost %q (event %d), x-escrow-balance %q", c, ev.Cost, bal)
	}
	if !ev.Usage.Equal(chatUsage) || ev.Cost != cost(t, chatUsage) || ev.Estimated || ev.Model != testModel || ev.Endpoint != EndpointChat || ev.KeyID == "" {
		t.Fatalf("event %+v", ev)
	}
	ups := e.upstreamRequests()
	if len(ups) != 1 || ups[0].Auth != "Bearer "+upstreamKey || ups[0].AcceptEncoding != "identity" ||
		string(ups[0].Body) != withCap(jsonBody(testModel, ""), "max_completion_tokens", 1000) {
		t.Fatalf("upstream got %+v", ups)
	}
	// The worker's accounting charges the real cost.
	if _, err := e.ledger.AccountPending(context.Background(), 100); err != nil {
		t.Fatal(err)
	}
	if a := e.account(); a.Balance != testCredit-ev.Cost {
		t.Fatalf("ledger balance %d, want %d", a.Balance, testCredit-ev.Cost)
	}
}

func TestEmbeddingsAndResponsesJSON(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	resp := e.post(ctx, EndpointEmbeddings, e.key, `{"model":"text-embedding-test","input":"hello"}`)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	o := e.outcome()
	if resp.StatusCode != 200 || o.Kind != OutcomeRecorded || !o.Usage.Equal(pricing.Usage{Prompt: 8}) {
		t.Fatalf("embeddings: %d %+v", resp.StatusCode, o)
	}
	// An embeddings hold is the body's bound: bytes × input price.
	if want := int64(len(`{"model":"text-embedding-test","input":"hello"}`)); o.HoldAmount != want {
		t.Fatalf("embeddings hold %d, want %d", o.HoldAmount, want)
	}
	resp = e.post(ctx, EndpointResponses, e.key, `{"model":"gpt-test","input":"hi","max_output_tokens":100}`)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	o = e.outcome()
	if resp.StatusCode != 200 || o.Kind != OutcomeRecorded || !o.Usage.Equal(responsesUsage) || o.Cost != cost(t, responsesUsage) {
		t.Fatalf("responses: %d %+v", resp.StatusCode, o)
	}
}

func TestStreamFlushesAndRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	gate := make(chan struct{})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		chunks := chatChunks(true)
		_, _ = io.WriteString(w, chunks[0])
		w.(http.Flusher).Flush()
		select {
		case <-gate: // the client has the first chunk
		case <-time.After(hangLimit):
			return
		}
		for _, c := range chunks[1:] {
			_, _ = io.WriteString(w, c)
			w.(http.Flusher).Flush()
		}
	})
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	defer resp.Body.Close()
	id := resp.Header.Get("x-request-id")
	var events []string
	readEvents(t, resp.Body, func(ev string) bool {
		events = append(events, ev)
		if len(events) == 1 {
			close(gate) // only now may the upstream send its second chunk
		}
		if strings.Contains(ev, "[DONE]") && !e.usageRecorded(id) {
			t.Errorf("[DONE] reached the client before the usage was recorded")
		}
		return true
	})
	if len(events) != 3 || !strings.Contains(events[0], "Hel") || events[2] != "data: [DONE]\n\n" {
		t.Fatalf("events %q", events)
	}
	o := e.outcome()
	if o.Kind != OutcomeRecorded || !o.Usage.Equal(chatUsage) {
		t.Fatalf("outcome %+v", o)
	}
	e.assertRecorded(id, o.HoldAmount)
}

func TestIncludeUsage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	// A client that did not ask for usage: the middleware asks upstream, and hides it.
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(got), "usage") || !strings.Contains(string(got), "Hel") || !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
		t.Fatalf("client without stream_options saw:\n%s", got)
	}
	if strings.Count(string(got), "data: ") != 3 {
		t.Fatalf("want 2 chunks and [DONE]:\n%s", got)
	}
	ups := e.upstreamRequests()
	if !gjson.GetBytes(ups[0].Body, "stream_options.include_usage").Bool() {
		t.Fatalf("include_usage not injected: %s", ups[0].Body)
	}
	if o := e.outcome(); o.Kind != OutcomeRecorded || !o.Usage.Equal(chatUsage) {
		t.Fatalf("outcome %+v", o)
	}
	// A client that asked sees exactly what the upstream sent.
	resp = e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true,"stream_options":{"include_usage":true}`))
	got, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := strings.Join(chatChunks(true), ""); string(got) != want {
		t.Fatalf("client that asked saw:\n%s\nwant:\n%s", got, want)
	}
	if ups := e.upstreamRequests(); string(ups[1].Body) != withCap(jsonBody(testModel, `"stream":true,"stream_options":{"include_usage":true}`), "max_completion_tokens", 1000) {
		t.Fatalf("body changed: %s", ups[1].Body)
	}
	if o := e.outcome(); o.Kind != OutcomeRecorded || !o.Usage.Equal(chatUsage) {
		t.Fatalf("outcome %+v", o)
	}
}

func TestResponsesStreamHoldsCompletedUntilRecorded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	resp := e.post(context.Background(), EndpointResponses, e.key, `{"model":"gpt-test","input":"hi","stream":true}`)
	defer resp.Body.Close()
	id := resp.Header.Get("x-request-id")
	var got strings.Builder
	readEvents(t, resp.Body, func(ev string) bool {
		got.WriteString(ev)
		if strings.Contains(ev, "response.completed") && !e.usageRecorded(id) {
			t.Errorf("response.completed reached the client before the usage was recorded")
		}
		return true
	})
	if got.String() != strings.Join(responsesEvents, "") {
		t.Fatalf("stream changed:\n%s", got.String())
	}
	if o := e.outcome(); o.Kind != OutcomeRecorded || !o.Usage.Equal(responsesUsage) {
		t.Fatalf("outcome %+v", o)
	}
}

func TestUpstreamErrorReleases(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"server_error","param":null,"code":null}}`)
	})
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 500 || !strings.Contains(string(body), "boom") {
		t.Fatalf("upstream error not passed: %d %s", resp.StatusCode, body)
	}
	if o := e.outcome(); o.Kind != OutcomeReleased || o.Status != 500 {
		t.Fatalf("outcome %+v", o)
	}
	e.assertNothingDebited()

	// Transport failure before the first byte: the upstream drops the connection.
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	})
	resp = e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if o := e.outcome(); o.Kind != OutcomeReleased {
		t.Fatalf("outcome %+v", o)
	}
	e.assertNothingDebited()
}

// TestHangupStillRecordsRealUsage: a client that hangs up mid-stream is charged the real usage,
// which the middleware reads on after the hang-up. The upstream sends the rest of the stream
// only once the proxy's side of the client's connection has seen it close (the request's
// context ends: an event, not a guessed pause), so the test cannot pass with an upstream that
// finished first.
func TestHangupStillRecordsRealUsage(t *testing.T) {
	t.Parallel()
	clientGone := make(chan struct{})
	var goneOnce sync.Once
	e := newEnv(t, envOpt{wrap: func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == EndpointChat {
				// The request's context ends when the connection closes (or the handler
				// returns, which cannot happen before the upstream below has finished).
				context.AfterFunc(r.Context(), func() { goneOnce.Do(func() { close(clientGone) }) })
			}
			h.ServeHTTP(w, r)
		})
	}})
	upstreamDone := make(chan struct{})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		defer close(upstreamDone)
		w.Header().Set("Content-Type", "text/event-stream")
		chunks := chatChunks(true)
		_, _ = io.WriteString(w, chunks[0])
		w.(http.Flusher).Flush()
		select {
		case <-clientGone:
		case <-time.After(hangLimit):
			t.Error("the proxy never saw the client hang up: the hang-up path was not taken")
		}
		for _, c := range chunks[1:] {
			if _, err := io.WriteString(w, c); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	id := resp.Header.Get("x-request-id")
	buf := make([]byte, 10)
	if _, err := io.ReadAtLeast(resp.Body, buf, 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	o := e.outcome()
	<-upstreamDone
	if o.Kind != OutcomeRecorded || !o.Usage.Equal(chatUsage) || o.HoldID != id {
		t.Fatalf("outcome %+v", o)
	}
	ev := e.assertRecorded(id, o.HoldAmount)
	if ev.Estimated || ev.Cost != cost(t, chatUsage) {
		t.Fatalf("event %+v", ev)
	}
}

func TestHangupBoundEstimates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{cfg: func(c *Config) { c.HangupTimeout = 200 * time.Millisecond }})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chatChunks(true)[0])
		w.(http.Flusher).Flush()
		<-r.Context().Done() // never finishes on its own
	})
	ctx, cancel := context.WithCancel(context.Background())
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	id := resp.Header.Get("x-request-id")
	buf := make([]byte, 10)
	if _, err := io.ReadAtLeast(resp.Body, buf, 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	o := e.outcome()
	if o.Kind != OutcomeEstimated || !errors.Is(o.Err, errHangupBound) {
		t.Fatalf("outcome %+v", o)
	}
	// A plain-text body without an output cap is bounded by the model's max output tokens (its
	// hold is that bound): charged the hold, which stands for the body's bytes in and the max out.
	ev := e.assertRecorded(id, o.HoldAmount)
	size := int64(len(jsonBody(testModel, `"stream":true`)))
	if !ev.Estimated || ev.Usage.Prompt != size || ev.Usage.Completion != 1000 || ev.Cost != o.HoldAmount || ev.Cost != cost(t, ev.Usage) {
		t.Fatalf("estimate %+v", ev)
	}
}

func TestCutAfterFirstByteEstimates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	cut := make(chan struct{})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chatChunks(true)[0])
		w.(http.Flusher).Flush()
		select { // the cut comes once the client has the first chunk
		case <-cut:
		case <-time.After(hangLimit):
		}
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	})
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	id := resp.Header.Get("x-request-id")
	var got []byte
	buf := make([]byte, 4096)
	for !strings.Contains(string(got), "Hel") {
		n, err := resp.Body.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			t.Fatalf("the first chunk never came whole (%v): %q", err, got)
		}
	}
	close(cut)
	rest, _ := io.ReadAll(resp.Body)
	got = append(got, rest...)
	resp.Body.Close()
	if strings.Contains(string(got), "[DONE]") || !strings.Contains(string(got), "Hel") {
		t.Fatalf("client saw %q", got)
	}
	o := e.outcome()
	if o.Kind != OutcomeEstimated {
		t.Fatalf("outcome %+v", o)
	}
	if ev := e.assertRecorded(id, o.HoldAmount); !ev.Estimated || ev.Usage.Completion < 1 || ev.Usage.Prompt < 1 {
		t.Fatalf("event %+v", ev)
	}
}

// TestNoUsageChargesHold: a complete 2xx without usage is charged the hold (DESIGN: a 2xx whose
// usage cannot be read at all), never a smaller estimate, and counted as estimated.
func TestNoUsageChargesHold(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"12345678"}}]}`)
	})
	body := jsonBody(testModel, "")
	resp := e.post(context.Background(), EndpointChat, e.key, body)
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	o := e.outcome()
	if resp.StatusCode != 200 || o.Kind != OutcomeEstimated || o.Cost != o.HoldAmount || o.HoldAmount <= 0 || !errors.Is(o.Err, errNoUsage) {
		t.Fatalf("status %d outcome %+v: want the hold charged", resp.StatusCode, o)
	}
	// The estimate this replaces would have been far below the hold.
	if est := cost(t, pricing.Usage{Prompt: int64(len(body)+3) / 4, Completion: 2}); est >= o.HoldAmount {
		t.Fatalf("test is vacuous: estimate %d ≥ hold %d", est, o.HoldAmount)
	}
	if ev := e.assertRecorded(resp.Header.Get("x-request-id"), o.HoldAmount); !ev.Estimated || ev.Cost != o.HoldAmount {
		t.Fatalf("event %+v: want estimated at the hold", ev)
	}
}

func TestRecordFailureIsNotASuccess(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	e.rec.fail = errors.New("ledger down and journal full")
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	if _, code, _ := openAIError(t, body); code != CodeBillingFailed {
		t.Fatalf("code %q", code)
	}
	if o := e.outcome(); o.Kind != OutcomeRecordFailed {
		t.Fatalf("outcome %+v", o)
	}
	e.assertNothingDebited()

	// A stream's content was served before its record: served ⇒ billed. The client gets its
	// end, the hold is kept, and the event is recorded again until the ledger takes it.
	resp = e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(got), "[DONE]") || strings.Contains(string(got), `"code":"billing_unavailable"`) {
		t.Fatalf("stream after a failed record:\n%s", got)
	}
	o := e.outcome()
	if o.Kind != OutcomeRecordLater {
		t.Fatalf("outcome %+v", o)
	}
	if st := e.state(); st.Holds != 1 || st.Held != o.HoldAmount {
		t.Fatalf("hot balance %+v: the served stream's hold must stay", st)
	}
	e.rec.setFail(nil) // the ledger is back
	waitFor(t, func() bool { return e.usageRecorded(o.HoldID) }, "the served stream's usage recorded")
	e.assertRecorded(o.HoldID, o.HoldAmount)
}

func TestRedisDownThenRecovers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{withFault: true})
	ctx := context.Background()
	e.state() // seed nothing, just make sure Redis answers
	e.fault.Block()
	e.fault.Cut()
	// The 503 comes while Redis is still unreachable (it is unblocked only after): the
	// request fails on its own deadline instead of waiting for Redis to come back.
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if typ, code, _ := openAIError(t, body); typ != TypeServiceUnavailable || code != CodeServiceUnavailable {
		t.Fatalf("type %q code %q", typ, code)
	}
	failed := e.outcome()
	if failed.Kind != OutcomeRefused || len(e.upstreamRequests()) != 0 {
		t.Fatalf("outcome %+v", failed)
	}
	e.fault.Unblock()
	resp = e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("after recovery: %d", resp.StatusCode)
	}
	o := e.outcome()
	// The background release of the failed reserve has run (or finds nothing to release): only
	// the successful request's hold is on.
	waitFor(t, func() bool {
		st := e.state()
		return st.Holds == 1 && st.Held == o.HoldAmount && st.Balance == testCredit-o.HoldAmount
	}, "the hot balance to hold only hold "+strconv.FormatInt(o.HoldAmount, 10))
}

func TestFailOpen(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{withFault: true, cfg: func(c *Config) { c.FailOpen = true }})
	e.fault.Block()
	e.fault.Cut()
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	o := e.outcome()
	if o.Kind != OutcomeRecorded || !o.FailOpen || o.HoldAmount != 0 {
		t.Fatalf("outcome %+v", o)
	}
	evs := e.rec.events()
	if len(evs) != 1 || evs[0].HoldAmount != 0 || evs[0].Cost != cost(t, chatUsage) || !e.usageRecorded(evs[0].ID) {
		t.Fatalf("events %+v", evs)
	}
}

// TestHoldExtendedWhileRunning: a request that runs past its hold's first expiry keeps its hold
// (the keep-alive extends it), so a reaper then finds nothing to release. The upstream waits, on
// the Redis clock, until that first expiry has passed (an event, not a sleep of a guessed
// length); the TTL leaves the keep-alive, which extends every TTL/3, seconds of slack on a
// loaded machine.
func TestHoldExtendedWhileRunning(t *testing.T) {
	t.Parallel()
	ttl := 3 * time.Second
	e := newEnv(t, envOpt{storeCfg: func(c *balance.Config) { c.HoldTTL = ttl; c.PinTTL = time.Hour; c.ReapGrace = time.Millisecond }})
	reaped := make(chan int, 1)
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		ctx := context.Background()
		rdb := e.redis.Client
		holds, err := rdb.ZRangeWithScores(ctx, balance.KeysOf(e.redis.Prefix, e.org).Hexp, 0, -1).Result()
		if err != nil || len(holds) != 1 {
			reaped <- -1
			fakeOpenAI(w, r, body)
			return
		}
		first := int64(holds[0].Score) // the hold's expiry when the request reached the upstream
		for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if now, err := rdb.Time(ctx).Result(); err == nil && now.UnixMilli() > first+50 {
				break
			}
		}
		n, err := e.store.Reap(ctx, e.org)
		if err != nil {
			n = -1
		}
		reaped <- n
		fakeOpenAI(w, r, body)
	})
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if n := <-reaped; n != 0 {
		t.Fatalf("the reaper released %d holds of a live request", n)
	}
	o := e.outcome()
	if resp.StatusCode != 200 || o.Kind != OutcomeRecorded {
		t.Fatalf("%d %+v", resp.StatusCode, o)
	}
	e.assertRecorded(o.HoldID, o.HoldAmount)
}

// lostHolds is the real store, except that each keep-alive reports its hold lost once started
// is closed.
type lostHolds struct {
	*balance.Store
	started chan struct{}
}

func (h lostHolds) KeepAlive(_, _ string, onLost func(error)) (*balance.Lease, error) {
	go func() {
		<-h.started
		onLost(errors.New("test: the hold could not be extended"))
	}()
	return nil, nil
}

// TestHoldLostCancelsUpstream: when the store gives up keeping the hold alive, the upstream
// call is cancelled and the request is charged an estimate (the reaper may release the hold).
func TestHoldLostCancelsUpstream(t *testing.T) {
	t.Parallel()
	started := make(chan struct{})
	e := newEnv(t, envOpt{cfg: func(c *Config) { c.Store = lostHolds{Store: c.Store.(*balance.Store), started: started} }})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hello"}}]}`+"\n\n")
		w.(http.Flusher).Flush()
		select { // until the middleware cancels the upstream call
		case <-r.Context().Done():
		case <-time.After(hangLimit):
		}
	})
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
	first := make([]byte, 8)
	if _, err := io.ReadFull(resp.Body, first); err != nil {
		t.Fatalf("the first bytes never came: %v", err)
	}
	close(started) // the hold is lost while the response is on its way
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	o := e.outcome()
	if o.Kind != OutcomeEstimated || !errors.Is(o.Err, errHoldLost) {
		t.Fatalf("outcome %+v", o)
	}
	if ev := e.assertRecorded(o.HoldID, o.HoldAmount); !ev.Estimated {
		t.Fatalf("event %+v not estimated", ev)
	}
}

func TestPassThroughStripsKey(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		_, _ = io.WriteString(w, `{"data":[]}`)
	})
	req, _ := http.NewRequest(http.MethodGet, e.srv.URL+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer "+e.key)
	resp, err := http.DefaultClient.Do(req)
	must(t, err)
	resp.Body.Close()
	ups := e.upstreamRequests()
	if resp.StatusCode != 200 || len(ups) != 1 || strings.Contains(ups[0].Auth, e.key) {
		t.Fatalf("%d %+v", resp.StatusCode, ups)
	}
	if o := e.outcome(); o.Kind != OutcomePassed {
		t.Fatalf("outcome %+v", o)
	}
	e.assertNothingDebited()
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
