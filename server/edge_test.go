package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// The proxy speaks HTTP for the client, not through it (issue 10, items 7–9): these tests talk
// to it over HTTP, on real Redis + Postgres and on the embedded parts, and each ends with the
// ledger equal to the usage the client saw, or with a refusal and nothing debited.

// bothModes runs fn on real Redis + Postgres and on the embedded parts.
func bothModes(t *testing.T, fn func(t *testing.T, real bool)) {
	t.Run("real", func(t *testing.T) { t.Parallel(); fn(t, true) })
	t.Run("embedded", func(t *testing.T) { t.Parallel(); fn(t, false) })
}

// testUpstream stands in front of the fake upstream and behaves like a real provider's edge: it
// records the headers it receives, answers with its own Server, cookie, organization, request-id
// and rate-limit headers (and tries to set escrow's), and, when interim is set, sends a 103 Early
// Hints and an unsolicited 100 Continue before each answer.
type testUpstream struct {
	fake    *fakeupstream.Server
	interim bool
	url     string

	mu   sync.Mutex
	seen []http.Header
}

func startTestUpstream(t *testing.T, opts fakeupstream.Options, interim bool) *testUpstream {
	t.Helper()
	opts.KeepRequests = -1
	u := &testUpstream{fake: fakeupstream.New(opts), interim: interim}
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	u.url = srv.URL
	return u
}

func (u *testUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.seen = append(u.seen, r.Header.Clone())
	u.mu.Unlock()
	h := w.Header()
	if u.interim {
		h.Set("Link", "</hint.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusContinue)
		h.Del("Link")
	}
	h.Set("Server", "upstream/9.9")
	h.Add("Set-Cookie", "upstream_session=s3cret; HttpOnly")
	h.Set("OpenAI-Organization", "org-operator")
	h.Set("OpenAI-Project", "proj_operator")
	h.Set("OpenAI-Processing-Ms", "12")
	h.Set("X-Request-Id", "req_upstream_1")
	h.Set("X-Ratelimit-Remaining-Requests", "99")
	h.Set("X-Escrow-Balance", "999999999")
	h.Set("X-Escrow-Spoofed", "1")
	h.Set("X-Internal-Debug", "shard-7")
	h.Set("Alt-Svc", `h3=":443"`)
	u.fake.ServeHTTP(w, r)
}

func (u *testUpstream) requests() []http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]http.Header(nil), u.seen...)
}

func useUpstream(u *testUpstream) func(*Config) {
	return func(c *Config) { c.UpstreamURL, c.UpstreamAPIKey = u.url, "sk-operator-upstream" }
}

func chatBody(content string, extra map[string]any) []byte {
	m := chat(content)
	for k, v := range extra {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	return b
}

// completionTokens is the usage.completion_tokens of a JSON reply (the model's price is one
// micro-unit per output token, input free: it is the cost).
func completionTokens(t *testing.T, body []byte) int64 {
	t.Helper()
	var r struct {
		Usage *struct {
			CompletionTokens int64 `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &r); err != nil || r.Usage == nil {
		t.Fatalf("reply without usage: %v: %s", err, body)
	}
	return r.Usage.CompletionTokens
}

// expect sends body with Expect: 100-continue and reports whether the proxy answered 100.
func (p *testProxy) expect(key string, body []byte) (int, http.Header, []byte, bool) {
	p.t.Helper()
	var got100 atomic.Bool
	// The client never gives up waiting for the 100 (it would then send the body anyway): a
	// proxy that neither answers 100 nor answers at all fails the request at the context's
	// end, which only bounds that hang, instead of after a measured wait.
	tr := &http.Transport{ExpectContinueTimeout: time.Hour}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{Got100Continue: func() { got100.Store(true) }})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		p.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Expect", "100-continue")
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		p.t.Fatalf("%v (the client waited for a 100 Continue that never came?)", err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, out, got100.Load()
}

// TestExpectContinue (item 7): the proxy answers Expect: 100-continue itself and never forwards
// it; the upstream's interim responses (here a 103 and an unsolicited 100 before every answer)
// never commit the client's response. An upstream 500 reaches the client as that 500 and costs
// nothing; a body the upstream refuses (413) stays a refusal; a body over the proxy's limit is
// refused before it is sent; a success is charged exactly the usage the client saw.
func TestExpectContinue(t *testing.T) {
	t.Parallel()
	bothModes(t, func(t *testing.T, real bool) {
		up := startTestUpstream(t, fakeupstream.Options{MaxBodyBytes: 256 << 10}, true)
		p := startTestProxy(t, real, useUpstream(up), func(c *Config) { c.MaxBodyBytes = 1 << 20 })
		key := p.setup("acme", 10_000, 65)
		var charged int64
		for _, c := range []struct {
			name      string
			content   string
			pad       int
			expect    bool
			status    int
			errMarker string // in the error body: whose refusal it is
			proxy100  bool
		}{
			{"ok with Expect", "hello there world", 0, true, 200, "", true},
			{"ok, no Expect", "hello again", 0, false, 200, "", false},
			{"upstream 500 with Expect", "please [fail] now", 0, true, 500, "The server had an error", true},
			{"upstream 500, no Expect", "please [fail] again", 0, false, 500, "The server had an error", false},
			{"upstream refuses the body", "big", 512 << 10, true, 413, "larger than 262144 bytes", true},
			{"proxy refuses the body", "bigger", 2 << 20, true, 413, "limit of 1048576 bytes", false},
		} {
			body := chatBody(c.content+" "+strings.Repeat("x", c.pad), nil)
			var st int
			var b []byte
			var got100 bool
			if c.expect {
				st, _, b, got100 = p.expect(key, body)
			} else {
				st, _, b = p.do("POST", "/v1/chat/completions", key, body)
			}
			if st != c.status || got100 != c.proxy100 {
				t.Fatalf("%s: status %d, 100 Continue from the proxy: %v; want %d, %v: %.300s", c.name, st, got100, c.status, c.proxy100, b)
			}
			if st == http.StatusOK {
				charged += completionTokens(t, b)
				continue
			}
			var e struct {
				Error struct{ Message string } `json:"error"`
			}
			if err := json.Unmarshal(b, &e); err != nil || !strings.Contains(e.Error.Message, c.errMarker) {
				t.Fatalf("%s: error body %v: %.300s, want one saying %q", c.name, err, b, c.errMarker)
			}
		}
		for i, h := range up.requests() {
			if h.Get("Expect") != "" {
				t.Fatalf("upstream request %d carried Expect: %q", i, h.Get("Expect"))
			}
		}
		if n := len(up.requests()); n != 5 {
			t.Fatalf("the upstream saw %d requests, want 5 (all but the one the proxy refused)", n)
		}
		if b := p.settled("acme"); b.LedgerBalance != 10_000-charged || b.Available != 10_000-charged || charged == 0 {
			t.Fatalf("after the requests: %+v, want ledger and available %d (the usage the client saw)", b, 10_000-charged)
		}
	})
}

// TestUpstreamHeaders (item 8): request headers reach the upstream only from the allow-list,
// with the operator's key in place of the client's; response headers come back only from the
// allow-list, next to escrow's own, which the upstream cannot set.
func TestUpstreamHeaders(t *testing.T) {
	t.Parallel()
	clientHeaders := map[string]string{
		"Accept": "application/json", "User-Agent": "OpenAI/Python 1.99", "OpenAI-Beta": "assistants=v2",
		"OpenAI-Organization": "org-victim", "OpenAI-Project": "proj_victim", "Api-Key": "k1", "X-Api-Key": "k2",
		"Cookie": "a=b", "X-Escrow-Hold-Id": "0199-forged", "X-Escrow-Org": "other", "Idempotency-Key": "idem-1",
		"X-Stainless-OS": "Linux", "X-Forwarded-For": "10.9.9.9", "Forwarded": "for=10.9.9.9", "X-Trace-Id": "tr-1",
		"Accept-Language": "fr",
	}
	send := func(t *testing.T, p *testProxy, key string) (http.Header, []byte) {
		req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/chat/completions", bytes.NewReader(chatBody("hello headers", nil)))
		for k, v := range clientHeaders {
			req.Header.Set(k, v)
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		return resp.Header, b
	}
	checkUpstream := func(t *testing.T, h http.Header, allowed ...string) {
		t.Helper()
		ok := map[string]bool{"Authorization": true, "Content-Type": true, "Content-Length": true, "Accept-Encoding": true}
		for _, a := range allowed {
			ok[http.CanonicalHeaderKey(a)] = true
			if h.Get(a) != clientHeaders[a] {
				t.Errorf("upstream got %s: %q, want the client's %q", a, h.Get(a), clientHeaders[a])
			}
		}
		for k := range h {
			if !ok[k] {
				t.Errorf("header %s reached the upstream: %q", k, h[k])
			}
		}
		if got := h.Get("Authorization"); got != "Bearer sk-operator-upstream" {
			t.Errorf("upstream Authorization %q, want the operator's key", got)
		}
	}
	checkClient := func(t *testing.T, h http.Header, upstreamID string, allowed ...string) {
		t.Helper()
		ok := map[string]bool{"Content-Type": true, "Content-Length": true, "Date": true, "X-Request-Id": true, "X-Upstream-Request-Id": true}
		for _, a := range allowed {
			ok[http.CanonicalHeaderKey(a)] = true
			if h.Get(a) == "" {
				t.Errorf("response header %s did not come back", a)
			}
		}
		for k := range h {
			if !ok[k] && !strings.HasPrefix(k, "X-Escrow-") {
				t.Errorf("header %s reached the client: %q", k, h[k])
			}
		}
		if h.Get("X-Escrow-Spoofed") != "" || h.Get("X-Escrow-Balance") == "999999999" || h.Get("X-Escrow-Hold-Id") == "" {
			t.Errorf("the upstream set escrow's headers: %v", h)
		}
		if h.Get("X-Request-Id") != h.Get("X-Escrow-Hold-Id") || h.Get("X-Upstream-Request-Id") != upstreamID {
			t.Errorf("request ids: x-request-id %q, hold %q, upstream %q", h.Get("X-Request-Id"), h.Get("X-Escrow-Hold-Id"), h.Get("X-Upstream-Request-Id"))
		}
	}
	bothModes(t, func(t *testing.T, real bool) {
		up := startTestUpstream(t, fakeupstream.Options{}, false)
		p := startTestProxy(t, real, useUpstream(up))
		key := p.setup("acme", 10_000, 65)
		h, b := send(t, p, key)
		checkUpstream(t, up.requests()[0], "Accept", "User-Agent", "OpenAI-Beta")
		// One set of rate-limit headers (issue 34): the upstream's (the operator's quota) are
		// dropped; this org has no limits, so there are none (checkClient refuses any other).
		checkClient(t, h, "req_upstream_1", "OpenAI-Processing-Ms")
		charged := completionTokens(t, b)
		if bal := p.settled("acme"); bal.LedgerBalance != 10_000-charged || bal.Available != 10_000-charged {
			t.Fatalf("after the request: %+v, want %d", bal, 10_000-charged)
		}
	})
	t.Run("upstream rate limits renamed", func(t *testing.T) {
		t.Parallel()
		up := startTestUpstream(t, fakeupstream.Options{}, false)
		p := startTestProxy(t, false, useUpstream(up), func(c *Config) { c.UpstreamRateLimit = "rename" })
		key := p.setup("acme", 10_000, 65)
		h, _ := send(t, p, key)
		if h.Get("X-Upstream-Ratelimit-Remaining-Requests") != "99" || len(h.Values("X-Ratelimit-Remaining-Requests")) != 0 {
			t.Fatalf("ESCROW_UPSTREAM_RATELIMIT=rename: %v", h)
		}
	})
	t.Run("configured", func(t *testing.T) {
		t.Parallel()
		up := startTestUpstream(t, fakeupstream.Options{}, false)
		p := startTestProxy(t, false, useUpstream(up), func(c *Config) {
			c.UpstreamRequestHeaders, c.UpstreamResponseHeaders = "Idempotency-Key,x-trace-*", "none"
		})
		key := p.setup("acme", 10_000, 65)
		h, b := send(t, p, key)
		checkUpstream(t, up.requests()[0], "Idempotency-Key", "X-Trace-Id")
		checkClient(t, h, "") // X-Request-Id is not listed: the upstream's id stays behind
		charged := completionTokens(t, b)
		if bal := p.settled("acme"); bal.LedgerBalance != 10_000-charged {
			t.Fatalf("after the request: %+v, want %d", bal, 10_000-charged)
		}
	})
}

// rawConn dials the proxy; rcvbuf > 0 sets a small receive buffer before connecting.
func rawConn(t *testing.T, addr string, rcvbuf int) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second}
	if rcvbuf > 0 {
		d.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf)
			}); err != nil {
				return err
			}
			return serr
		}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// untilClosed reads c until the server closes it and returns the responses read on the way
// and how long it took since begin, or an error when c is still open after limit.
func untilClosed(c net.Conn, begin time.Time, limit time.Duration) ([]int, time.Duration, error) {
	start := time.Now()
	_ = c.SetReadDeadline(start.Add(limit))
	br := bufio.NewReader(c)
	var statuses []int
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return statuses, time.Since(begin), fmt.Errorf("connection still open after %s", limit)
			}
			return statuses, time.Since(begin), nil
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		statuses = append(statuses, resp.StatusCode)
	}
}

// TestSlowClientsCutOff (item 9): connections that announce a body and never send it, that
// never finish their headers, or that sit idle after a response are closed by the server, not
// before the configured bounds; the announced bodies hold nothing and nothing is debited. How
// long each took is measured from before the connection was dialled, so the server's own clock
// for it started later: at least the bound at any speed. The upper limit only ends a hang (the
// bug held them open for good).
func TestSlowClientsCutOff(t *testing.T) {
	t.Parallel()
	const (
		headerTimeout = 300 * time.Millisecond
		readTimeout   = 600 * time.Millisecond
		idleTimeout   = 400 * time.Millisecond
		hangLimit     = time.Minute
	)
	bothModes(t, func(t *testing.T, real bool) {
		p := startTestProxy(t, real, func(c *Config) {
			c.ReadHeaderTimeout, c.ReadTimeout, c.IdleTimeout = headerTimeout, readTimeout, idleTimeout
		})
		key := p.setup("acme", 10_000, 65)
		addr := strings.TrimPrefix(p.base, "http://")
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for i := range 10 {
			begin := time.Now()
			c := rawConn(t, addr, 0)
			wg.Add(1)
			go func() {
				defer wg.Done()
				fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n", key)
				statuses, took, err := untilClosed(c, begin, hangLimit)
				if err != nil {
					errs <- fmt.Errorf("slow body %d: %w", i, err)
				}
				for _, s := range statuses {
					if s < 400 {
						errs <- fmt.Errorf("slow body %d: status %d", i, s)
					}
				}
				if took < readTimeout {
					errs <- fmt.Errorf("slow body %d: closed after %s, before the read timeout", i, took)
				}
			}()
		}
		begin := time.Now()
		hc, ic := rawConn(t, addr, 0), rawConn(t, addr, 0)
		wg.Add(1)
		go func() {
			defer wg.Done()
			fmt.Fprintf(hc, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
			if _, took, err := untilClosed(hc, begin, hangLimit); err != nil {
				errs <- fmt.Errorf("slow headers: %w", err)
			} else if took < headerTimeout {
				errs <- fmt.Errorf("slow headers: closed after %s", took)
			}
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := ic
			start := time.Now() // before the server's idle clock starts (after its answer)
			fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
			br := bufio.NewReader(c)
			_ = c.SetReadDeadline(time.Now().Add(hangLimit))
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != http.StatusOK || resp.Close {
				errs <- fmt.Errorf("keep-alive request: %v %v", resp, err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = c.SetReadDeadline(time.Now().Add(hangLimit))
			if _, err := br.ReadByte(); err == nil {
				errs <- errors.New("idle connection: unexpected byte")
			} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
				errs <- fmt.Errorf("idle connection still open after %s", hangLimit)
			} else if took := time.Since(start); took < idleTimeout {
				errs <- fmt.Errorf("idle connection closed after %s, before the idle timeout", took)
			}
		}()
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if b := p.settled("acme"); b.LedgerBalance != 10_000 || b.Available != 10_000 {
			t.Fatalf("after the slow clients: %+v, want nothing debited", b)
		}
	})
}

// TestLongResponsesOutliveTimeouts (item 9): the read and write timeouts bound the request and
// each write, not the response: a stream that runs for four times the timeouts, and a JSON
// reply whose first byte comes later than the write timeout, arrive whole and are charged what
// the client saw.
func TestLongResponsesOutliveTimeouts(t *testing.T) {
	t.Parallel()
	const timeout = 250 * time.Millisecond
	bothModes(t, func(t *testing.T, real bool) {
		p := startTestProxy(t, real, func(c *Config) {
			c.ReadHeaderTimeout, c.ReadTimeout, c.WriteTimeout, c.IdleTimeout = timeout, timeout, timeout, timeout
		})
		key := p.setup("acme", 10_000, 65)
		// 6 chunks, 200 ms apart.
		st, _, b := p.do("POST", "/v1/chat/completions", key, chatBody("[slow] stream please", map[string]any{
			"stream": true, "max_tokens": 6, "stream_options": map[string]any{"include_usage": true}}))
		if st != http.StatusOK || !bytes.Contains(b, []byte("data: [DONE]")) {
			t.Fatalf("stream: %d, cut short: %s", st, b)
		}
		var streamed int64
		for _, line := range strings.Split(string(b), "\n") {
			if data, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(data, `"completion_tokens"`) {
				streamed = completionTokens(t, []byte(data))
			}
		}
		// A JSON reply that waits 200 ms per word: 800 ms before its first byte.
		st, _, jb := p.do("POST", "/v1/chat/completions", key, chatBody("[slow] json please", map[string]any{"max_tokens": 4}))
		if st != http.StatusOK {
			t.Fatalf("slow JSON: %d %s", st, jb)
		}
		charged := streamed + completionTokens(t, jb)
		if streamed != 6 || charged != 10 {
			t.Fatalf("usage seen: stream %d, total %d; want 6 and 10", streamed, charged)
		}
		if bal := p.settled("acme"); bal.LedgerBalance != 10_000-charged || bal.Available != 10_000-charged {
			t.Fatalf("after the requests: %+v, want %d", bal, 10_000-charged)
		}
	})
}

// TestStalledReaderCutOff (item 9): a client that stops reading a long stream is cut off within
// the write timeout; the proxy then reads the upstream on and records the real usage, so the
// request ends (its hold settles) instead of waiting on the client forever. Embedded parts only:
// the write path does not depend on them, and the stream must outgrow the kernel's socket
// buffers (several MB on loopback), which is slow under the race detector.
func TestStalledReaderCutOff(t *testing.T) {
	t.Parallel()
	{
		p := startTestProxy(t, false, func(c *Config) { c.WriteTimeout = 300 * time.Millisecond })
		key := p.setup("acme", 1_000_000, 65)
		p.admin("PUT", "/models/big", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
			"max_input_tokens": 1000, "max_output_tokens": 100_000, "max_cost": 100_000, "default_hold": 100_000}, http.StatusOK, nil)
		const tokens = 30_000 // about 7 MB of events: beyond what the sockets buffer (tcp_wmem max is 4 MB)
		body, _ := json.Marshal(map[string]any{"model": "big", "stream": true, "max_tokens": tokens,
			"messages": []map[string]string{{"role": "user", "content": "go on [fill]"}}}) // [fill]: the fake fills its cap
		c := rawConn(t, strings.TrimPrefix(p.base, "http://"), 4096)
		fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", key, len(body), body)
		// The client reads nothing. The request must still end: its hold settles, charged the
		// upstream's real usage (the client hung up mid-stream: read on, bounded).
		deadline := time.Now().Add(30 * time.Second)
		for p.balance("acme").LedgerBalance == 1_000_000 {
			if time.Now().After(deadline) {
				t.Fatalf("the stalled request never ended: %+v", p.balance("acme"))
			}
			time.Sleep(20 * time.Millisecond)
		}
		if b := p.settled("acme"); b.LedgerBalance != 1_000_000-tokens || b.Available != 1_000_000-tokens {
			t.Fatalf("after the stalled stream: %+v, want %d (the real usage)", b, 1_000_000-tokens)
		}
		// And the proxy closed the connection: what the client reads now ends without [DONE].
		_ = c.SetReadDeadline(time.Now().Add(time.Minute))
		got, err := io.ReadAll(c)
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("the stalled connection is still open (%d bytes read)", len(got))
		}
		if bytes.Contains(got, []byte("[DONE]")) || len(got) == 0 {
			t.Fatalf("the stalled client received %d bytes, [DONE] included: %v", len(got), bytes.Contains(got, []byte("[DONE]")))
		}
	}
}
