package middleware

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/pricing"
)

// loneCR turns a stream's line ends into lone carriage returns (valid SSE).
func loneCR(s string) string { return strings.ReplaceAll(s, "\n", "\r") }

// streamGated makes an upstream that sends events one write each, flushed, and after the first
// waits (up to 30 s) for the client to have seen it: a middleware that buffered the stream
// would keep the client waiting until the end. passed says whether the client saw the first
// event before the upstream went on.
func streamGated(events []string) (h func(w http.ResponseWriter, r *http.Request, body []byte), seen chan struct{}, passed func() bool) {
	seen = make(chan struct{})
	var mu sync.Mutex
	ok := false
	h = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i, ev := range events {
			_, _ = io.WriteString(w, ev)
			w.(http.Flusher).Flush()
			if i == 0 {
				select {
				case <-seen:
					mu.Lock()
					ok = true
					mu.Unlock()
				case <-time.After(30 * time.Second):
				}
			}
		}
	}
	return h, seen, func() bool { mu.Lock(); defer mu.Unlock(); return ok }
}

// readSignal reads the whole body, closing seen once it contains marker.
func readSignal(t *testing.T, body io.Reader, marker string, seen chan struct{}) string {
	t.Helper()
	var got bytes.Buffer
	buf := make([]byte, 4096)
	signalled := false
	for {
		n, err := body.Read(buf)
		got.Write(buf[:n])
		if !signalled && strings.Contains(got.String(), marker) {
			close(seen)
			signalled = true
		}
		if err != nil {
			if !signalled {
				close(seen)
			}
			return got.String()
		}
	}
}

// TestSSELoneCR: streams whose lines end in a lone CR (valid SSE) over HTTP through the
// middleware: the usage chunk escrow asked for is read and kept from the client, the stream
// passes event by event (not buffered to its end), and [DONE] (or the Responses terminal event)
// never reaches the client before the usage is recorded: with the record failing, the client
// gets escrow's error event instead.
func TestSSELoneCR(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	chat := func(mixed bool) []string {
		var evs []string
		for i, ch := range chatChunks(true) {
			if !mixed || i%2 == 0 {
				ch = loneCR(ch)
			}
			evs = append(evs, ch)
		}
		return evs
	}
	for _, c := range []struct {
		name  string
		mixed bool // CR events alternate with LF ones
	}{{"cr", false}, {"mixed", true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envOpt{})
			h, seen, passed := streamGated(chat(c.mixed))
			e.setUpstream(h)
			resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
			got := readSignal(t, resp.Body, `"Hel"`, seen)
			resp.Body.Close()
			o := e.outcome()
			if o.Kind != OutcomeRecorded || o.Cost != cost(t, chatUsage) {
				t.Fatalf("outcome %+v: want ok at cost %d (the usage read)", o, cost(t, chatUsage))
			}
			if strings.Contains(got, "usage") || strings.Contains(got, "prompt_tokens") {
				t.Fatalf("the client saw the usage it did not ask for:\n%q", got)
			}
			if !strings.Contains(got, `"Hel"`) || !strings.Contains(got, `"lo"`) || !strings.HasSuffix(strings.TrimRight(got, "\r\n"), "data: [DONE]") {
				t.Fatalf("stream:\n%q", got)
			}
			if !passed() {
				t.Fatalf("the first event did not reach the client while the upstream waited: the stream was buffered")
			}
			e.assertRecorded(resp.Header.Get("x-request-id"), o.HoldAmount)
		})
	}
	t.Run("responses", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, envOpt{})
		var evs []string
		for _, ev := range responsesEvents {
			evs = append(evs, loneCR(ev))
		}
		h, seen, passed := streamGated(evs)
		e.setUpstream(h)
		resp := e.post(ctx, EndpointResponses, e.key, `{"model":"`+testModel+`","input":"hi","stream":true}`)
		got := readSignal(t, resp.Body, "response.created", seen)
		resp.Body.Close()
		o := e.outcome()
		if o.Kind != OutcomeRecorded || o.Cost != cost(t, responsesUsage) {
			t.Fatalf("outcome %+v: want ok at cost %d", o, cost(t, responsesUsage))
		}
		if !strings.Contains(got, "response.completed") || !passed() {
			t.Fatalf("stream (first event passed early: %v):\n%q", passed(), got)
		}
	})
	t.Run("record fails", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, envOpt{})
		e.rec.fail = errors.New("ledger down and journal full")
		h, seen, _ := streamGated(chat(false))
		e.setUpstream(h)
		resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, `"stream":true`))
		got := readSignal(t, resp.Body, `"Hel"`, seen)
		resp.Body.Close()
		// Served ⇒ billed: the content passed, so the end does too and the usage is retried.
		if !strings.Contains(got, "[DONE]") || strings.Contains(got, `"code":"billing_unavailable"`) {
			t.Fatalf("a stream whose usage was not recorded yet:\n%q", got)
		}
		o := e.outcome()
		if o.Kind != OutcomeRecordLater {
			t.Fatalf("outcome %+v", o)
		}
		e.rec.setFail(nil)
		waitFor(t, func() bool { return e.usageRecorded(o.HoldID) }, "the served stream's usage recorded")
	})
}

// normLF rewrites every SSE line end ("\r\n", lone "\r", "\n") as "\n".
func normLF(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "\r\n", "\n"), "\r", "\n")
}

// TestSSELineEndsAlike: a stream reads the same whatever its line ends ("\n", "\r\n", a lone
// "\r", or a mix), cut into writes of any size (a "\r\n" split between two writes is one line
// end) and with events short or too long to keep whole: the same usage, the same events for
// the client (the injected usage chunk left out, with its line ends), the end held back, and
// the stream byte for byte unchanged when nothing is injected.
func TestSSELineEndsAlike(t *testing.T) {
	t.Parallel()
	mixed := func(s string) string {
		var b strings.Builder
		for i, ev := range strings.SplitAfter(s, "\n\n") {
			switch i % 3 {
			case 0:
				ev = strings.ReplaceAll(ev, "\n", "\r\n")
			case 1:
				ev = loneCR(ev)
			}
			b.WriteString(ev)
		}
		return b.String()
	}
	responses := strings.Join(responsesEvents, "")
	for _, c := range []struct {
		name   string
		stream string
		inject bool
	}{{"chat", chatStreamInjected, true}, {"chat kept", chatStreamInjected, false}, {"responses", responses, false}} {
		for _, maxEvent := range []int{1 << 20, 64} {
			var want pricing.Usage
			var wantSeen, wantTail string
			for k, ends := range []func(string) string{
				func(s string) string { return s },
				func(s string) string { return strings.ReplaceAll(s, "\n", "\r\n") },
				loneCR, mixed,
			} {
				stream := ends(c.stream)
				for _, step := range []int{0, 1, 2, 3, 5, 17} {
					seen, tail, f := runSSEMax(stream, c.inject, step, maxEvent)
					what := func() string {
						return c.name + " " + strconv.Itoa(maxEvent) + " ends " + strconv.Itoa(k) + " step " + strconv.Itoa(step)
					}
					if !f.haveUsage {
						t.Fatalf("%s: no usage", what())
					}
					if k == 0 && step == 0 {
						want, wantSeen, wantTail = f.usage, normLF(seen), normLF(tail)
						if tail == "" {
							t.Fatalf("%s: nothing held back", what())
						}
						continue
					}
					if !f.usage.Equal(want) || normLF(seen) != wantSeen || normLF(tail) != wantTail {
						t.Fatalf("%s: usage %+v seen %q tail %q; want %+v %q %q", what(), f.usage, seen, tail, want, wantSeen, wantTail)
					}
					if !c.inject && seen+tail != stream {
						t.Fatalf("%s: stream changed:\n%q\n%q", what(), stream, seen+tail)
					}
					if c.inject && ((maxEvent > len(stream) && strings.Contains(seen, "usage")) || strings.Contains(seen, "[DONE]")) {
						t.Fatalf("%s: seen %q", what(), seen)
					}
				}
			}
		}
	}
}

// runSSEMax is runSSE with the filter's bound on an event kept whole.
func runSSEMax(stream string, inject bool, step, maxEvent int) (seen, tail string, f *sseFilter) {
	var out bytes.Buffer
	f = &sseFilter{inject: inject, maxEvent: maxEvent, emit: func(b []byte) { out.Write(b) }}
	b := []byte(stream)
	if step <= 0 {
		step = len(b)
	}
	for len(b) > 0 {
		n := min(step, len(b))
		f.Write(b[:n])
		b = b[n:]
	}
	f.finish()
	return out.String(), string(f.release()), f
}
