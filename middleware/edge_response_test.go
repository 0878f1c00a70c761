package middleware

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// The response-side edge (issue 10, item 1): usage is read from responses of any size,
// compressed or not, over HTTP through the middleware, and what the client sees of the usage is
// what the ledger charged. Each test runs on miniredis, and on a real Redis when
// ESCROW_TEST_REDIS_URL is set (the env's testutil.Redis).

// bigModel is priced like gpt-4o-mini (0.15 and 0.60 per million tokens, in micro-units) and
// allows 16,384 output tokens: the 8.7 MB n:64 reply costs 629,146 and more.
var bigModel = ledger.Model{Name: "gpt-4o-mini", Prices: pricing.Prices{pricing.Input: 150_000, pricing.CachedInput: 75_000, pricing.Output: 600_000},
	MaxInputTokens: 128_000, MaxOutputTokens: 16_384, DefaultHold: 5000}

// newFakeEnv is an env whose upstream is the fake OpenAI of internal/fakeupstream.
func newFakeEnv(t *testing.T, o envOpt) *testEnv {
	t.Helper()
	e := newEnv(t, o)
	must(t, e.ledger.PutModel(context.Background(), bigModel))
	fake := fakeupstream.New(fakeupstream.Options{KeepRequests: -1})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		r.Body = io.NopCloser(bytes.NewReader(body))
		fake.ServeHTTP(w, r)
	})
	return e
}

// gatedRecorder blocks a record until open is closed, after telling entered. It gives no
// balance and cannot void.
type gatedRecorder struct {
	next    Recorder
	entered chan struct{}
	open    chan struct{}
}

func (g *gatedRecorder) RecordReceipt(ctx context.Context, ev ledger.UsageEvent) (accounting.Receipt, error) {
	close(g.entered)
	<-g.open
	_, err := g.next.RecordReceipt(ctx, ev)
	return accounting.Receipt{}, err
}

func (g *gatedRecorder) Void(context.Context, ledger.UsageEvent) error {
	return errors.ErrUnsupported
}

func gate(g **gatedRecorder) func(*Config) {
	return func(c *Config) {
		*g = &gatedRecorder{next: c.Recorder, entered: make(chan struct{}), open: make(chan struct{})}
		c.Recorder = *g
	}
}

// billedExactly checks the request's event: its usage is want (what the client saw), priced
// with the model, not estimated, and in the ledger with the hold still on.
func (e *testEnv) billedExactly(id string, m ledger.Model, want pricing.Usage) ledger.UsageEvent {
	e.t.Helper()
	o := e.outcome()
	if o.Kind != OutcomeRecorded || o.HoldID != id {
		e.t.Fatalf("outcome %+v", o)
	}
	ev := e.assertRecorded(id, o.HoldAmount)
	c, err := m.Cost(want)
	must(e.t, err)
	if !ev.Usage.Equal(want) || ev.Cost != c || ev.Estimated || o.Cost != c {
		e.t.Fatalf("billed %+v cost %d (estimated %v), the client saw %+v costing %d", ev.Usage, ev.Cost, ev.Estimated, want, c)
	}
	return ev
}

// visibleUsage is the usage a client reads from a JSON body (encoding/json, as a Go client).
func visibleUsage(t *testing.T, body []byte) pricing.Usage {
	t.Helper()
	raw, ok := clientUsageRaw(body)
	if !ok {
		t.Fatalf("no usage in the body the client got (%d bytes): %.200s", len(body), body)
	}
	u, ok := usageOf(gjson.ParseBytes(raw))
	if !ok {
		t.Fatalf("usage %s not readable", raw)
	}
	return u
}

// TestHugeResponsesBilledExactly: the n:64 × 16,384 reply (8.7 MB, charged 4 before) and a
// single choice with logprobs and top_logprobs 20 (~20 MB) are billed their real usage to the
// micro-unit; the client gets every byte, and the body's last bytes only once the usage is
// recorded.
func TestHugeResponsesBilledExactly(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, extra string }{
		{"n64", `"n":64,"max_tokens":16384`},
		{"logprobs", `"logprobs":true,"top_logprobs":20,"max_tokens":16384`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var g *gatedRecorder
			var fc flushCounter
			e := newFakeEnv(t, envOpt{cfg: gate(&g), wrap: fc.wrap})
			// [fill]: the fake's answer fills its cap (a model stops on its own otherwise).
			resp := e.post(context.Background(), EndpointChat, e.key, strings.Replace(jsonBody(bigModel.Name, tc.extra), "Say hello", "[fill] Say hello", 1))
			id := resp.Header.Get("x-request-id")
			var got atomic.Int64
			var body bytes.Buffer
			body.Grow(32 << 20)
			read := make(chan error, 1)
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := resp.Body.Read(buf)
					body.Write(buf[:n])
					got.Add(int64(n))
					if err != nil {
						if errors.Is(err, io.EOF) {
							err = nil
						}
						read <- err
						return
					}
				}
			}()
			<-g.entered                                        // the handler has written all it will before the record
			before := waitReceived(t, &got, fc.flushed.Load()) // whatever was passed on has reached the client
			close(g.open)
			must(t, <-read)
			resp.Body.Close()
			total := int64(body.Len())
			if resp.StatusCode != 200 || total < 8_000_000 {
				t.Fatalf("status %d, %d bytes", resp.StatusCode, total)
			}
			// The body streamed (the client had all but its end before the record) and its end
			// waited for the record: the client could not complete the JSON.
			if before < total-64<<10 || before >= total || json.Valid(body.Bytes()[:before]) {
				t.Fatalf("client had %d of %d bytes while the usage was being recorded", before, total)
			}
			want := visibleUsage(t, body.Bytes())
			ev := e.billedExactly(id, bigModel, want)
			if want.Completion != 1_048_576 && tc.name == "n64" {
				t.Fatalf("fake answered %d completion tokens", want.Completion)
			}
			if tc.name == "n64" && ev.Cost < 629_146 {
				t.Fatalf("cost %d below the issue's true cost", ev.Cost)
			}
			t.Logf("%s: %d bytes, usage %+v, cost %d, hold %d", tc.name, total, want, ev.Cost, ev.HoldAmount)
		})
	}
}

// flushCounter counts the body bytes the proxy flushed to the client's connection (it wraps
// the proxy's handler: envOpt.wrap). Once the handler is blocked in the record, that count is
// what the client is sure to receive before the end: a test waits for the client to have read
// it (an event) instead of for the stream to look still for a while (a guess a slow machine
// can break).
type flushCounter struct{ flushed atomic.Int64 }

func (f *flushCounter) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&countingWriter{ResponseWriter: w, f: f}, r)
	})
}

type countingWriter struct {
	http.ResponseWriter
	f       *flushCounter
	written int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.written += int64(n)
	return n, err
}

func (c *countingWriter) FlushError() error {
	err := http.NewResponseController(c.ResponseWriter).Flush()
	if err == nil {
		c.f.flushed.Store(c.written)
	}
	return err
}

func (c *countingWriter) Flush() { _ = c.FlushError() }

// Unwrap gives http.ResponseController the connection's writer (deadlines, full duplex).
func (c *countingWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// waitReceived waits until the client has read n bytes (a bound only against a hang) and
// returns what it read by then.
func waitReceived(t *testing.T, got *atomic.Int64, n int64) int64 {
	t.Helper()
	waitFor(t, func() bool { return got.Load() >= n }, fmt.Sprintf("the client to receive the %d bytes flushed to it", n))
	return got.Load()
}

// teeReader counts and keeps what a client read, for a look at it while the reading goes on.
type teeReader struct {
	r   io.Reader
	mu  sync.Mutex
	buf []byte
	n   atomic.Int64
}

func (tr *teeReader) Read(p []byte) (int, error) {
	n, err := tr.r.Read(p)
	tr.mu.Lock()
	tr.buf = append(tr.buf, p[:n]...)
	tr.mu.Unlock()
	tr.n.Add(int64(n))
	return n, err
}

func (tr *teeReader) snapshot() []byte {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return append([]byte(nil), tr.buf...)
}

// sseUsage reads a chat/completions stream as a client: the usage chunk's usage, if any.
func sseChatUsage(t *testing.T, stream []byte) (pricing.Usage, bool) {
	t.Helper()
	var u pricing.Usage
	found := false
	readEvents(t, bytes.NewReader(stream), func(ev string) bool {
		for _, line := range strings.Split(ev, "\n") {
			data, ok := strings.CutPrefix(strings.TrimRight(line, "\r"), "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			if uu, ok := usageOf(gjson.Get(data, "usage")); ok {
				u, found = uu, true
			}
		}
		return true
	})
	return u, found
}

// sseResponsesUsage is the usage of a Responses stream's response.completed event, as a client
// reads it.
func sseResponsesUsage(t *testing.T, stream []byte) pricing.Usage {
	t.Helper()
	var u pricing.Usage
	found := false
	readEvents(t, bytes.NewReader(stream), func(ev string) bool {
		for _, line := range strings.Split(ev, "\n") {
			data, ok := strings.CutPrefix(strings.TrimRight(line, "\r"), "data: ")
			if ok && gjson.Get(data, "type").Str == "response.completed" {
				u, found = usageOf(gjson.Get(data, "response.usage"))
			}
		}
		return true
	})
	if !found {
		t.Fatalf("no response.completed with usage in %d bytes", len(stream))
	}
	return u
}

// TestCompressedRepliesBilledExactly: an upstream that ignores Accept-Encoding: identity and
// answers gzip, deflate or br — JSON, chat streams (usage asked by the client, or injected and
// hidden) and Responses streams — is billed exactly; the client gets the decoded bytes.
func TestCompressedRepliesBilledExactly(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, envOpt{})
	ctx := context.Background()
	for _, coding := range []string{"gzip", "deflate", "br"} {
		msg := `"messages":[{"role":"user","content":"[encoding:` + coding + `] [cached:2] [reasoning:3] [fill] say hello"}]`
		for _, tc := range []struct{ name, path, body string }{
			{"json", EndpointChat, `{"model":"gpt-test",` + msg + `,"max_tokens":40}`},
			{"sse asked", EndpointChat, `{"model":"gpt-test",` + msg + `,"max_tokens":40,"stream":true,"stream_options":{"include_usage":true}}`},
			{"sse injected", EndpointChat, `{"model":"gpt-test",` + msg + `,"max_tokens":40,"stream":true}`},
			{"responses json", EndpointResponses, `{"model":"gpt-test","input":"[encoding:` + coding + `] [cached:1] [fill] hi there","max_output_tokens":30}`},
			{"responses sse", EndpointResponses, `{"model":"gpt-test","input":"[encoding:` + coding + `] [cached:1] [fill] hi there","max_output_tokens":30,"stream":true}`},
		} {
			t.Run(coding+" "+tc.name, func(t *testing.T) {
				resp := e.post(ctx, tc.path, e.key, tc.body)
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				must(t, err)
				id := resp.Header.Get("x-request-id")
				if resp.StatusCode != 200 || resp.Header.Get("Content-Encoding") != "" {
					t.Fatalf("status %d, Content-Encoding %q: %.200s", resp.StatusCode, resp.Header.Get("Content-Encoding"), got)
				}
				var want pricing.Usage
				switch tc.name {
				case "json", "responses json":
					want = visibleUsage(t, got)
				case "sse asked":
					u, ok := sseChatUsage(t, got)
					if !ok || !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
						t.Fatalf("stream without usage or [DONE]: %.300s", got)
					}
					want = u
				case "sse injected":
					if strings.Contains(string(got), "usage") || !strings.HasSuffix(string(got), "data: [DONE]\n\n") {
						t.Fatalf("injected usage not hidden from the client:\n%.500s", got)
					}
					want = pricing.Usage{Prompt: 6, Completion: 40, Reasoning: 3, Units: pricing.Units{pricing.CachedInput: 2}} // the fake's rule: words, markers, cap
				case "responses sse":
					want = sseResponsesUsage(t, got)
				}
				if want.Completion == 0 || want.Of(pricing.CachedInput) == 0 {
					t.Fatalf("the fake's usage %+v lacks the markers' counts", want)
				}
				e.billedExactly(id, ledger.Model{Name: testModel, Prices: testPrices}, want)
				e.settleAll()
			})
		}
	}
}

// settleAll releases the env's holds so that assertRecorded's one-hold check holds for the next
// request (the worker would settle them).
func (e *testEnv) settleAll() {
	e.t.Helper()
	for _, ev := range e.rec.events() {
		_, _ = e.store.Release(context.Background(), e.org, ev.ID)
	}
}

// TestUnreadableChargesHold: a 2xx whose usage cannot be read — a coding escrow cannot decode,
// a body that does not decode as its coding says, a body that is not JSON — is charged the hold,
// marked estimated, never passed free.
func TestUnreadableChargesHold(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, envOpt{})
	ctx := context.Background()
	plainGzip := func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		_, _ = io.WriteString(w, `{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	}
	notJSON := func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `<html>usage: {"prompt_tokens":1}</html>`)
	}
	nestedOnly := func(w http.ResponseWriter, r *http.Request, body []byte) {
		// 2 MiB, streamed past the window: a usage inside a choice is not the response's.
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"`+strings.Repeat("x", 2<<20)+`"},"usage":{"prompt_tokens":1,"completion_tokens":1}}]}`)
	}
	for _, tc := range []struct {
		name, body, clientCoding string
		upstream                 func(http.ResponseWriter, *http.Request, []byte)
	}{
		{"nested usage only", jsonBody(testModel, ""), "", nestedOnly},
		{"unknown coding json", jsonBody(testModel, `"max_tokens":40`), "zstd", nil},
		{"unknown coding sse", jsonBody(testModel, `"max_tokens":40,"stream":true`), "zstd", nil},
		{"gzip that is not", jsonBody(testModel, ""), "", plainGzip},
		{"not json", jsonBody(testModel, ""), "", notJSON},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := tc.body
			if tc.upstream == nil {
				body = strings.Replace(body, "Say hello", "[encoding:zstd] Say hello", 1)
			}
			e.setUpstream(tc.upstream)
			if tc.upstream == nil {
				fake := fakeupstream.New(fakeupstream.Options{KeepRequests: -1})
				e.setUpstream(func(w http.ResponseWriter, r *http.Request, b []byte) {
					r.Body = io.NopCloser(bytes.NewReader(b))
					fake.ServeHTTP(w, r)
				})
			}
			resp := e.post(ctx, EndpointChat, e.key, body)
			_, _ = io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get("Content-Encoding") != tc.clientCoding {
				t.Fatalf("status %d, Content-Encoding %q", resp.StatusCode, resp.Header.Get("Content-Encoding"))
			}
			o := e.outcome()
			if o.Kind != OutcomeEstimated || o.Cost != o.HoldAmount || o.HoldAmount <= 0 || !(errors.Is(o.Err, errUnreadable) || errors.Is(o.Err, errNoUsage)) {
				t.Fatalf("outcome %+v: want the hold charged", o)
			}
			ev := e.assertRecorded(o.HoldID, o.HoldAmount)
			if !ev.Estimated || ev.Cost != o.HoldAmount {
				t.Fatalf("event %+v", ev)
			}
			// The client is told it was charged the hold (a header, or a trailer when the
			// header left before the end: a large or undecodable body).
			if c := resp.Header.Get(HeaderCost) + resp.Trailer.Get(HeaderCost); c != itoa(o.HoldAmount) {
				t.Fatalf("x-escrow-cost %q (header %q), hold %d", c, resp.Header.Get(HeaderCost), o.HoldAmount)
			}
			e.settleAll()
		})
	}
}

// TestGiantResponsesCompletedEvent: a Responses stream whose response.completed event is ~16 MB
// (logprobs with 20 alternatives per token) — far past the event limit — is billed its real
// usage, passes unchanged, and its response.completed is not dispatchable by the client before
// the usage is recorded.
func TestGiantResponsesCompletedEvent(t *testing.T) {
	t.Parallel()
	var g *gatedRecorder
	var fc flushCounter
	e := newFakeEnv(t, envOpt{cfg: gate(&g), wrap: fc.wrap})
	body := `{"model":"gpt-4o-mini","input":"[cached:3] [fill] tell me a long story","max_output_tokens":16384,"stream":true,` +
		`"include":["message.output_text.logprobs"],"top_logprobs":20}`
	resp := e.post(context.Background(), EndpointResponses, e.key, body)
	id := resp.Header.Get("x-request-id")
	raw := &teeReader{r: resp.Body}
	var stream bytes.Buffer
	var completed atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		br := bufio.NewReaderSize(raw, 1<<20)
		var ev bytes.Buffer
		for {
			line, err := br.ReadBytes('\n')
			stream.Write(line)
			ev.Write(line)
			if len(line) == 1 || (len(line) == 2 && line[0] == '\r') { // a dispatched event
				if bytes.Contains(ev.Bytes()[:min(ev.Len(), 200)], []byte("response.completed")) {
					completed.Store(true)
				}
				ev.Reset()
			}
			if err != nil {
				return
			}
		}
	}()
	<-g.entered // the handler has written all it will before the record
	waitReceived(t, &raw.n, fc.flushed.Load())
	// What the client has so far: a response.completed it could dispatch would be followed by
	// the blank line that ends its event.
	seen := raw.snapshot()
	if k := bytes.Index(seen, []byte("response.completed")); k >= 0 && (bytes.Contains(seen[k:], []byte("\n\n")) || bytes.Contains(seen[k:], []byte("\n\r\n"))) {
		t.Fatal("the client could dispatch response.completed before its usage was recorded")
	}
	if n := bytes.Count(seen, []byte("\n\n")); n < 5 {
		t.Fatalf("only %d events reached the client before the end: the stream did not pass as it came", n)
	}
	close(g.open)
	<-done
	resp.Body.Close()
	if !completed.Load() || stream.Len() < 10_000_000 {
		t.Fatalf("completed %v after %d bytes", completed.Load(), stream.Len())
	}
	want := sseResponsesUsage(t, stream.Bytes())
	ev := e.billedExactly(id, bigModel, want)
	if want.Completion != 16384 || want.Of(pricing.CachedInput) != 3 {
		t.Fatalf("usage %+v", want)
	}
	t.Logf("%d-byte stream, usage %+v, cost %d, hold %d", stream.Len(), want, ev.Cost, ev.HoldAmount)
}

// TestBigChatChunksBilled: chat chunks each larger than the event limit (logprobs), plain and
// gzip, are passed as they come and the usage chunk after them is still read and hidden.
func TestBigChatChunksBilled(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, envOpt{cfg: func(c *Config) { c.MaxResponseBytes = 600 }})
	for _, marker := range []string{"", "[encoding:gzip] "} {
		body := `{"model":"gpt-test","messages":[{"role":"user","content":"` + marker + `[fill] count to ten"}],"max_tokens":50,"stream":true,"logprobs":true,"top_logprobs":20}`
		resp := e.post(context.Background(), EndpointChat, e.key, body)
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.HasSuffix(string(got), "data: [DONE]\n\n") || strings.Count(string(got), "top_logprobs") < 50 {
			t.Fatalf("stream: %.300s", got)
		}
		if _, ok := sseChatUsage(t, got); ok {
			t.Fatal("the injected usage chunk reached the client")
		}
		e.billedExactly(resp.Header.Get("x-request-id"), ledger.Model{Name: testModel, Prices: testPrices},
			pricing.Usage{Prompt: len64(marker + "[fill] count to ten"), Completion: 50})
		e.settleAll()
	}
}

func len64(s string) int64 { return int64(len(strings.Fields(s))) }

// TestCutLargeJSONEstimates: a streamed JSON body cut by the upstream after 2 MiB is estimated
// (the transport failed after the first byte): for a request whose hold is not a bound, the
// input bound (the body's bytes) plus the text that passed, counted generously, never more than
// the hold — and the client sees a broken response, not a success.
func TestCutLargeJSONEstimates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	text := strings.Repeat("word ", 2<<20/5)
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"`+text)
		w.(http.Flusher).Flush()
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
	})
	req := jsonBody(testModel, `"x_unpriced":1`) // not plain text: its hold is not a bound
	resp := e.post(context.Background(), EndpointChat, e.key, req)
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil && json.Valid(got) {
		t.Fatal("a cut body reached the client as a complete one")
	}
	o := e.outcome()
	if o.Kind != OutcomeEstimated || errors.Is(o.Err, errNoUsage) || errors.Is(o.Err, errUnreadable) {
		t.Fatalf("outcome %+v", o)
	}
	ev := e.assertRecorded(o.HoldID, o.HoldAmount)
	bound, err := testPrices.Bound(int64(len(req)), ev.Usage.Completion)
	must(t, err)
	if least := int64(len(text)) / 4; !ev.Estimated || ev.Usage.Prompt != int64(len(req)) || ev.Usage.Completion < least || ev.Cost != min(bound, o.HoldAmount) {
		t.Fatalf("estimate %+v (hold %d), want ≥ %d output tokens", ev, o.HoldAmount, least)
	}
}

// discardWriter is a client that takes every byte and keeps none.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }

// TestCaptureMemoryFlat: the capture writer's memory does not grow with the response. For 1, 8
// and 64 MiB JSON bodies and event streams it measures the heap the writer holds at the end of
// the response (live bytes after a GC, the writer still reachable) and, for JSON, every byte
// allocated on the way: both stay at the 1 MiB window kept for a clean error, whatever the size.
// (An event stream allocates per event, garbage that the GC takes: it is reported per MiB.)
func TestCaptureMemoryFlat(t *testing.T) {
	chunk := bigChatResponse(1 << 20)
	chunk = chunk[:bytes.LastIndex(chunk, []byte(`],"usage"`))]
	elems := chunk[bytes.IndexByte(chunk, '[')+1:]
	sseChunk := []byte("data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", 1000) + "\"}}]}\n\n")
	type mem struct{ live, total uint64 }
	run := func(mib int, sse bool) mem {
		var least mem
		for i := range 3 { // other tests' goroutines only add: the least of three runs is ours
			var before, mid, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			d := &discardWriter{h: http.Header{}}
			cw := &captureWriter{w: d, headers: func(http.Header) {}, maxJSON: 1 << 20, hangupBytes: 1 << 30, onBound: func() {}}
			cw.sse = &sseFilter{maxEvent: 1 << 20, emit: cw.out}
			if sse {
				d.h.Set("Content-Type", "text/event-stream")
				for range mib * 1000 {
					_, _ = cw.Write(sseChunk)
				}
				_, _ = cw.Write([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\ndata: [DONE]\n\n"))
			} else {
				d.h.Set("Content-Type", "application/json")
				_, _ = cw.Write(chunk)
				for range mib - 1 {
					_, _ = cw.Write([]byte{','})
					for p := elems; len(p) > 0; p = p[min(32<<10, len(p)):] {
						_, _ = cw.Write(p[:min(32<<10, len(p))])
					}
				}
				_, _ = cw.Write([]byte(`],"usage":{"prompt_tokens":1,"completion_tokens":2}}`))
			}
			cw.end()
			if _, ok := cw.usage(); !ok {
				t.Fatalf("%d MiB: no usage", mib)
			}
			runtime.ReadMemStats(&mid)
			runtime.GC()
			runtime.ReadMemStats(&after)
			runtime.KeepAlive(cw)
			m := mem{live: after.HeapAlloc - min(after.HeapAlloc, before.HeapAlloc), total: mid.TotalAlloc - before.TotalAlloc}
			if i == 0 || m.live < least.live {
				least.live = m.live
			}
			if i == 0 || m.total < least.total {
				least.total = m.total
			}
		}
		return least
	}
	for _, sse := range []bool{false, true} {
		m1, m8, m64 := run(1, sse), run(8, sse), run(64, sse)
		t.Logf("sse=%v: held at the end of a 1 / 8 / 64 MiB response: %d / %d / %d bytes; allocated on the way: %d / %d / %d bytes",
			sse, m1.live, m8.live, m64.live, m1.total, m8.total, m64.total)
		if m64.live > m1.live+256<<10 || m8.live > m1.live+256<<10 || m64.live > 3<<20 {
			t.Fatalf("sse=%v: the writer's heap grows with the response: %d (1 MiB) %d (8 MiB) %d (64 MiB)", sse, m1.live, m8.live, m64.live)
		}
		if !sse && (m64.total > m1.total+256<<10 || m8.total > m1.total+256<<10) {
			t.Fatalf("JSON: allocations grow with the response: %d (1 MiB) %d (8 MiB) %d (64 MiB)", m1.total, m8.total, m64.total)
		}
	}
}
