package middleware

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// costEnv is the middleware harness with an *accounting.Recorder that finishes holds (as the
// proxy wires it) and no worker: nothing settles, so the store's available balance moves only
// by reserves and finishes.
func costEnv(t *testing.T, tweak func(*Config)) *testEnv {
	t.Helper()
	return newEnv(t, envOpt{cfg: func(c *Config) {
		rec, err := accounting.NewRecorder(c.Ledger.(*memledger.Ledger), &accounting.RecorderConfig{Logger: quiet, Finisher: c.Store.(*balance.Store)})
		must(t, err)
		rec.Start(context.Background())
		t.Cleanup(func() { _ = rec.Stop(context.Background()) })
		c.Recorder = rec
		if tweak != nil {
			tweak(c)
		}
	}})
}

// send posts body with the extra request headers and returns the response with its whole body
// read (so that its trailers have arrived).
func (e *testEnv) send(path, body string, hdr map[string]string) (*http.Response, string) {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	must(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+e.key)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	must(e.t, err)
	b, err := io.ReadAll(resp.Body)
	must(e.t, err)
	resp.Body.Close()
	return resp, string(b)
}

// charged is the cost the ledger holds for the request.
func (e *testEnv) charged(id string) ledger.RequestInfo {
	e.t.Helper()
	ri, err := e.ledger.Request(context.Background(), id)
	must(e.t, err)
	return ri
}

func num(t *testing.T, what, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("%s %q: %v", what, s, err)
	}
	return n
}

// TestCostHeadersJSON: a JSON response carries x-escrow-cost = the ledger's charge for it,
// exactly, and x-escrow-balance = the org's available balance after it (the store's, nothing
// else in flight), as headers; two calls in a row: the balance drops by exactly the second cost.
func TestCostHeadersJSON(t *testing.T) {
	t.Parallel()
	e := costEnv(t, nil)
	prev := testCredit
	for i, c := range []struct{ path, body string }{
		{EndpointChat, jsonBody(testModel, "")},
		{EndpointEmbeddings, `{"model":"text-embedding-test","input":"hello"}`},
		{EndpointResponses, `{"model":"gpt-test","input":"hi"}`},
	} {
		resp, body := e.send(c.path, c.body, nil)
		if resp.StatusCode != 200 || !json.Valid([]byte(body)) {
			t.Fatalf("call %d: %d %s", i, resp.StatusCode, body)
		}
		ri := e.charged(resp.Header.Get("x-request-id"))
		cost := num(t, "x-escrow-cost", resp.Header.Get(HeaderCost))
		bal := num(t, "x-escrow-balance", resp.Header.Get(HeaderBalance))
		if ri.Cost <= 0 || cost != ri.Cost {
			t.Fatalf("call %d: x-escrow-cost %d, ledger charge %d", i, cost, ri.Cost)
		}
		if st := e.state(); bal != st.Balance || bal != prev-cost {
			t.Fatalf("call %d: x-escrow-balance %d, store %d, previous %d − cost %d", i, bal, st.Balance, prev, cost)
		}
		if resp.Header.Get("Trailer") != "" || resp.ContentLength != int64(len(body)) || len(resp.Trailer) != 0 {
			t.Fatalf("call %d: a small body has its cost in headers: Trailer %q, length %d, trailers %v", i, resp.Header.Get("Trailer"), resp.ContentLength, resp.Trailer)
		}
		prev = bal
	}
}

// TestCostTrailersLargeJSON: a JSON body larger than MaxResponseBytes streams as it comes
// (memory flat), so its header leaves before the cost is known: the cost and the balance come
// as announced HTTP trailers, the upstream's Content-Length dropped (chunked), the body intact.
func TestCostTrailersLargeJSON(t *testing.T) {
	t.Parallel()
	e := costEnv(t, func(c *Config) { c.MaxResponseBytes = 1024 })
	big := `{"id":"chatcmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"` +
		strings.Repeat("x", 64<<10) + `"},"finish_reason":"stop"}],"usage":` + chatUsageJSON + `}`
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(big)))
		for i := 0; i < len(big); i += 4096 {
			_, _ = io.WriteString(w, big[i:min(i+4096, len(big))])
		}
	})
	for i := range 2 {
		before := e.state().Balance
		resp, body := e.send(EndpointChat, jsonBody(testModel, ""), nil)
		if resp.StatusCode != 200 || body != big {
			t.Fatalf("call %d: %d, body intact %v", i, resp.StatusCode, body == big)
		}
		// Go's client takes the announced names out of the Trailer header into resp.Trailer.
		_, announced := resp.Trailer[HeaderCost]
		_, announcedBal := resp.Trailer[HeaderBalance]
		if !announced || !announcedBal || resp.Header.Get(HeaderCost) != "" || resp.ContentLength != -1 || len(resp.TransferEncoding) != 1 {
			t.Fatalf("call %d: trailers %v, header cost %q, length %d, %v", i, resp.Trailer, resp.Header.Get(HeaderCost), resp.ContentLength, resp.TransferEncoding)
		}
		ri := e.charged(resp.Header.Get("x-request-id"))
		c := num(t, "trailer cost", resp.Trailer.Get(HeaderCost))
		bal := num(t, "trailer balance", resp.Trailer.Get(HeaderBalance))
		if c != ri.Cost || c != cost(t, chatUsage) {
			t.Fatalf("call %d: trailer cost %d, ledger %d", i, c, ri.Cost)
		}
		if st := e.state(); bal != st.Balance || (i > 0 && bal != before-c) {
			t.Fatalf("call %d: trailer balance %d, store %d, before %d − cost %d", i, bal, st.Balance, before, c)
		}
	}
}

// sdkStream decodes body as the OpenAI SDKs do (see testutil.SDKStream); it fails the test on
// an event they could not decode.
func sdkStream(t *testing.T, body string) ([]map[string]any, bool) {
	t.Helper()
	items, done, err := testutil.SDKStream(body)
	if err != nil {
		t.Fatal(err)
	}
	return items, done
}

// costComment finds the escrow comment in an event stream: its bytes, and the cost and the
// balance it carries (-1 when left out).
func costComment(t *testing.T, body string) (comment string, cost, bal int64) {
	t.Helper()
	comment, cost, bal, ok, err := testutil.CostComment(body)
	if !ok || err != nil {
		t.Fatalf("escrow comment in %q: found %v, %v", body, ok, err)
	}
	return comment, cost, bal
}

// TestCostSSEComment: an event stream carries the cost only when the client asks
// (x-escrow-include-cost: true): an SSE comment, a block of its own, right before `data: [DONE]`
// (chat) or before response.completed (Responses), with the ledger's charge and the store's
// balance after it; a strict OpenAI SDK parser decodes the same chunks with it as without it;
// and without the header the stream is byte-identical to the upstream's (when escrow has
// nothing to edit) or to what escrow sent before (same bytes as with the header, minus the
// comment).
func TestCostSSEComment(t *testing.T) {
	t.Parallel()
	e := costEnv(t, nil)
	ask := map[string]string{HeaderIncludeCost: "true"}
	for _, tc := range []struct {
		name, path, body, before string
		upstream                 string // the upstream's bytes, when the client must get them unchanged
		chunks                   int    // what the SDK yields
	}{
		{"chat, client include_usage", EndpointChat, jsonBody(testModel, `"stream":true,"stream_options":{"include_usage":true}`),
			"data: [DONE]\n\n", strings.Join(chatChunks(true), ""), 3},
		{"chat, usage injected", EndpointChat, jsonBody(testModel, `"stream":true`), "data: [DONE]\n\n", "", 2},
		{"responses", EndpointResponses, `{"model":"gpt-test","input":"hi","stream":true}`,
			"event: response.completed\n", strings.Join(responsesEvents, ""), 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain, plainBody := e.send(tc.path, tc.body, nil)
			if plain.StatusCode != 200 || strings.Contains(plainBody, "escrow") || plain.Header.Get(HeaderCost) != "" || len(plain.Trailer) != 0 {
				t.Fatalf("without the header: %d %q %v", plain.StatusCode, plainBody, plain.Header)
			}
			if tc.upstream != "" && plainBody != tc.upstream {
				t.Fatalf("without the header the stream changed:\n%q\nwant\n%q", plainBody, tc.upstream)
			}
			before := e.state().Balance
			resp, body := e.send(tc.path, tc.body, ask)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			comment, cost, bal := costComment(t, body)
			if !strings.HasPrefix(body[strings.Index(body, comment)+len(comment):], tc.before) {
				t.Fatalf("the comment is not right before %q: %q", tc.before, body)
			}
			if strings.Replace(body, comment, "", 1) != plainBody {
				t.Fatalf("with the header, minus the comment:\n%q\nwithout:\n%q", strings.Replace(body, comment, "", 1), plainBody)
			}
			ri := e.charged(resp.Header.Get("x-request-id"))
			if cost != ri.Cost || cost <= 0 {
				t.Fatalf("comment cost %d, ledger %d", cost, ri.Cost)
			}
			if st := e.state(); bal != st.Balance || bal != before-cost {
				t.Fatalf("comment balance %d, store %d, before %d − cost %d", bal, st.Balance, before, cost)
			}
			a, doneA := sdkStream(t, plainBody)
			b, doneB := sdkStream(t, body)
			if len(a) != tc.chunks || len(b) != len(a) || doneA != doneB || doneA != (tc.path == EndpointChat) {
				t.Fatalf("SDK items: %d (done %v) with the comment, %d (done %v) without, want %d", len(b), doneB, len(a), doneA, tc.chunks)
			}
			for i := range a {
				x, _ := json.Marshal(a[i])
				y, _ := json.Marshal(b[i])
				if string(x) != string(y) {
					t.Fatalf("item %d: %s vs %s", i, y, x)
				}
				if tc.path == EndpointChat && b[i]["object"] != "chat.completion.chunk" {
					t.Fatalf("item %d is not a chunk: %s", i, y)
				}
				if typ, _ := b[i]["type"].(string); tc.path == EndpointResponses && !strings.HasPrefix(typ, "response.") {
					t.Fatalf("item %d is not a Responses event: %s", i, y)
				}
			}
		})
	}
}

// TestCostSSEAfterBigTerminalEvent: a terminal Responses event too long to keep whole passes as
// it comes, its tail held back: the comment cannot go before it, so it follows it, still a block
// of its own that the SDK skips.
func TestCostSSEAfterBigTerminalEvent(t *testing.T) {
	t.Parallel()
	e := costEnv(t, func(c *Config) { c.MaxResponseBytes = 64 }) // every event is "big"
	resp, body := e.send(EndpointResponses, `{"model":"gpt-test","input":"hi","stream":true}`, map[string]string{HeaderIncludeCost: "true"})
	comment, c, bal := costComment(t, body)
	if want := strings.Join(responsesEvents, "") + comment; body != want {
		t.Fatalf("stream:\n%q\nwant\n%q", body, want)
	}
	if ri := e.charged(resp.Header.Get("x-request-id")); c != ri.Cost || c != cost(t, responsesUsage) || bal != e.state().Balance {
		t.Fatalf("comment cost %d balance %d; ledger %d, store %d", c, bal, ri.Cost, e.state().Balance)
	}
	if items, _ := sdkStream(t, body); len(items) != len(responsesEvents) {
		t.Fatalf("SDK items: %v", items)
	}
}

// TestCostSSEEstimated: a stream whose usage never comes (the upstream ignores include_usage)
// is charged an estimate; the comment says what was charged.
func TestCostSSEEstimated(t *testing.T) {
	t.Parallel()
	e := costEnv(t, nil)
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ch := range chatChunks(false) {
			_, _ = io.WriteString(w, ch)
		}
	})
	resp, body := e.send(EndpointChat, jsonBody(testModel, `"stream":true`), map[string]string{HeaderIncludeCost: "1"})
	_, cost, bal := costComment(t, body)
	ri := e.charged(resp.Header.Get("x-request-id"))
	if !ri.Estimated || cost != ri.Cost || bal != e.state().Balance {
		t.Fatalf("comment cost %d balance %d; ledger %+v, store %d", cost, bal, ri.UsageEvent, e.state().Balance)
	}
	if !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("stream end: %q", body)
	}
}

// TestCostNotOnFailures: an upstream error is not charged, so it carries no cost and no
// balance; x-escrow-include-cost is escrow's own and never reaches the upstream.
func TestCostNotOnFailures(t *testing.T) {
	t.Parallel()
	e := costEnv(t, nil)
	got := make(chan string, 1)
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		got <- r.Header.Get(HeaderIncludeCost)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"server_error","param":null,"code":null}}`)
	})
	resp, _ := e.send(EndpointChat, jsonBody(testModel, ""), map[string]string{HeaderIncludeCost: "true"})
	if resp.StatusCode != 500 || resp.Header.Get(HeaderCost) != "" || resp.Header.Get(HeaderBalance) != "" || len(resp.Trailer) != 0 {
		t.Fatalf("upstream error: %d %v %v", resp.StatusCode, resp.Header, resp.Trailer)
	}
	if h := <-got; h != "" {
		t.Fatalf("the upstream saw x-escrow-include-cost: %q", h)
	}
}

// TestCostFailOpen: a fail-open request (Redis unreachable, no hold) is charged and says so,
// but the balance after it is unknown: x-escrow-balance is left out rather than guessed.
func TestCostFailOpen(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{withFault: true, cfg: func(c *Config) {
		rec, err := accounting.NewRecorder(c.Ledger.(*memledger.Ledger), &accounting.RecorderConfig{Logger: quiet, Finisher: c.Store.(*balance.Store)})
		must(t, err)
		rec.Start(context.Background())
		t.Cleanup(func() { _ = rec.Stop(context.Background()) })
		c.Recorder, c.FailOpen = rec, true
	}})
	e.fault.Block()
	e.fault.Cut()
	resp, _ := e.send(EndpointChat, jsonBody(testModel, ""), nil)
	if o := e.outcome(); resp.StatusCode != 200 || !o.FailOpen {
		t.Fatalf("%d %+v", resp.StatusCode, o)
	}
	ri := e.charged(resp.Header.Get("x-request-id"))
	if resp.Header.Get(HeaderCost) != itoa(ri.Cost) || ri.Cost != cost(t, chatUsage) || len(resp.Header.Values(HeaderBalance)) != 0 {
		t.Fatalf("cost %q (ledger %d), balance %q", resp.Header.Get(HeaderCost), ri.Cost, resp.Header.Values(HeaderBalance))
	}
}

// TestCostNotFromTheHandler: the cost headers are escrow's own. A handler (here a reverse proxy
// with no header filter) that sets them — as headers, or as trailers after the body — never
// gets them to the client: a 2xx carries the ledger's cost and no balance this Recorder cannot
// tell; an upstream error carries neither.
func TestCostNotFromTheHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{}) // the spy Recorder: no balance known
	var status atomic.Int32
	status.Store(http.StatusOK)
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set(HeaderCost, "1")
		w.Header().Set(HeaderBalance, "999999999")
		w.Header().Set("Trailer", HeaderCost+", "+HeaderBalance)
		if st := int(status.Load()); st != http.StatusOK {
			w.WriteHeader(st)
		}
		fakeOpenAI(w, r, body)
		w.Header().Set(HeaderCost, "2")
		w.Header().Set(HeaderBalance, "888888888")
	})
	resp, _ := e.send(EndpointChat, jsonBody(testModel, ""), nil)
	ev := e.assertRecorded(resp.Header.Get("x-request-id"), e.outcome().HoldAmount)
	got := append(resp.Header.Values(HeaderCost), resp.Trailer.Values(HeaderCost)...)
	for _, v := range got {
		if v != itoa(ev.Cost) {
			t.Fatalf("x-escrow-cost %q, charged %d", got, ev.Cost)
		}
	}
	if len(got) == 0 || len(resp.Header.Values(HeaderBalance))+len(resp.Trailer.Values(HeaderBalance)) != 0 {
		t.Fatalf("cost %q; balance %q / %q", got, resp.Header.Values(HeaderBalance), resp.Trailer.Values(HeaderBalance))
	}
	e.settleAll()

	status.Store(http.StatusBadGateway)
	resp, _ = e.send(EndpointChat, jsonBody(testModel, ""), nil)
	if resp.StatusCode != http.StatusBadGateway || len(resp.Header.Values(HeaderCost))+len(resp.Header.Values(HeaderBalance)) != 0 {
		t.Fatalf("upstream error: %d %v", resp.StatusCode, resp.Header)
	}
}
