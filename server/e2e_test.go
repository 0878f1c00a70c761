package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

const testAdmin = "test-admin-token"

// testProxy is a proxy server running in-process on a random port.
type testProxy struct {
	t    *testing.T
	app  *Server
	base string
}

// config is the name the proxy's tests used for Config before the product moved out of
// examples/proxy; it keeps their tweak functions (func(c *Config)) as they were.
type config = Config

// startTestProxy starts the proxy: real Redis and Postgres when real is true, embedded parts
// (miniredis, the memory ledger) otherwise, as tweaked; the upstream is the fake one unless a
// tweak sets UpstreamURL or RoutesFile.
func startTestProxy(t *testing.T, real bool, tweak ...func(*Config)) *testProxy {
	t.Helper()
	return startTestProxyWith(t, real, nil, tweak...)
}

// startTestProxyWith is startTestProxy with options applied after its own (a later option wins).
func startTestProxyWith(t *testing.T, real bool, extra []Option, tweak ...func(*Config)) *testProxy {
	t.Helper()
	a := newTestApp(t, real, extra, tweak...)
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &testProxy{t: t, app: a, base: "http://" + a.Addr()}
}

// newTestApp makes (without starting it) the proxy startTestProxyWith starts, stopped when the
// test ends.
func newTestApp(t *testing.T, real bool, extra []Option, tweak ...func(*Config)) *Server {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Addr = "127.0.0.1:0"
	cfg.AdminToken = testAdmin
	cfg.DemoBalance = 0
	if real {
		env := testutil.RealRedis(t)
		pg := testutil.Postgres(t)
		cfg.RedisURL, cfg.DatabaseURL, cfg.Prefix = env.URL, pg.URL, env.Prefix
		// As for miniredis below: a burst of thousands queues for the client's connections
		// longer than the default pool (4 s) and read (3 s) timeouts when the machine is loaded
		// (a race build beside other packages' builds answered 183 of 2,000 requests 503). The
		// request path's own deadlines still bound each call.
		if !strings.Contains(cfg.RedisURL, "?") {
			cfg.RedisURL += "?pool_timeout=2m&read_timeout=1m"
		}
	}
	for _, f := range tweak {
		f(cfg)
	}
	if cfg.Logger == nil { // a tweak may set its own
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
		if testing.Verbose() {
			cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
		}
	}
	var opts []Option
	if cfg.RedisURL == "" {
		mini := miniredis.NewMiniRedis()
		if err := mini.StartAddr("127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		// miniredis runs every script in Go, one after another: a burst queues for the client's
		// 20 connections far longer than the default pool (4 s) and read (3 s) timeouts under the
		// race detector on a loaded machine. The request path's own deadlines still bound each call.
		rdb := redis.NewClient(&redis.Options{Addr: mini.Addr(), PoolTimeout: 2 * time.Minute, ReadTimeout: time.Minute,
			ContextTimeoutEnabled: true})
		t.Cleanup(func() { _ = rdb.Close(); mini.Close() }) // after the server's Stop (cleanups run last-in first-out)
		opts = append(opts, WithEmbeddedRedis(rdb))
	}
	if cfg.UpstreamURL == "" && cfg.RoutesFile == "" {
		opts = append(opts, WithUpstream(fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), "sk-fake-upstream"))
	}
	opts = append(opts, extra...)
	a, err := New(context.Background(), cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := a.Stop(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	return a
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// eachMode runs fn against the proxy on real Redis + Postgres, on its embedded parts,
// and on a private 3-master Redis Cluster with real Postgres: the same suite on every backend.
func eachMode(t *testing.T, fn func(t *testing.T, p *testProxy)) {
	eachModeWith(t, func(t *testing.T, start func(extra ...Option) *testProxy) { fn(t, start()) })
}

// eachModeWith is eachMode for a test that starts the proxy itself, with options of its own
// (applied after the mode's: a later option wins).
func eachModeWith(t *testing.T, fn func(t *testing.T, start func(extra ...Option) *testProxy)) {
	t.Run("real", func(t *testing.T) {
		t.Parallel()
		fn(t, func(extra ...Option) *testProxy { return startTestProxyWith(t, true, extra) })
	})
	t.Run("embedded", func(t *testing.T) {
		t.Parallel()
		fn(t, func(extra ...Option) *testProxy { return startTestProxyWith(t, false, extra) })
	})
	t.Run("cluster", func(t *testing.T) {
		t.Parallel()
		fn(t, func(extra ...Option) *testProxy { return startClusterProxy(t, testutil.StartRedisCluster(t), extra...) })
	})
}

// gatedUpstream is the fake upstream behind a gate: each request whose body contains marker
// ("": every request) waits until gate is closed (or its client gives up), so a test sees
// requests in flight for as long as it needs, however slow the machine, instead of for as long
// as a slow answer takes.
func gatedUpstream(gate <-chan struct{}, marker string) Option {
	fake := fakeupstream.New(fakeupstream.Options{KeepRequests: -1})
	return WithUpstream(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		if !bytes.Contains(body, []byte(marker)) {
			fake.ServeHTTP(w, r)
			return
		}
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
		fake.ServeHTTP(w, r)
	}), "sk-fake-upstream")
}

// startClusterProxy starts the proxy on the cluster (REDIS_URL with one URL per master) and a
// fresh Postgres schema, with extra options applied after its own (startTestProxyWith).
func startClusterProxy(t *testing.T, cl *testutil.RedisCluster, extra ...Option) *testProxy {
	t.Helper()
	urls := make([]string, 0, 3)
	for _, a := range cl.Addrs() {
		urls = append(urls, "redis://"+a)
	}
	pg := testutil.Postgres(t)
	return startTestProxyWith(t, false, extra, func(c *Config) {
		c.RedisURL, c.DatabaseURL, c.Prefix = strings.Join(urls, ","), pg.URL, testutil.RandomName("c")
	})
}

func (p *testProxy) do(method, path, token string, body any) (int, http.Header, []byte) {
	p.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
	case string:
		rd = strings.NewReader(b)
	default:
		j, _ := json.Marshal(b)
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, p.base+path, rd)
	if err != nil {
		p.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		p.t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, out
}

func (p *testProxy) admin(method, path string, body any, wantStatus int, out any) {
	p.t.Helper()
	st, _, b := p.do(method, "/admin/v1"+path, testAdmin, body)
	if st != wantStatus {
		p.t.Fatalf("%s %s: %d %s, want %d", method, path, st, b, wantStatus)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			p.t.Fatalf("%s %s: %v in %s", method, path, err, b)
		}
	}
}

type balanceView struct {
	Org           string `json:"org"`
	LedgerBalance int64  `json:"ledger_balance"`
	Available     int64  `json:"available"`
	Held          int64  `json:"held"`
	Holds         int    `json:"holds"`
}

func (p *testProxy) balance(org string) balanceView {
	var b balanceView
	p.admin("GET", "/orgs/"+org+"/balance", nil, http.StatusOK, &b)
	return b
}

// setup creates a model priced at 1 micro-unit per output token (input free) with maxCost
// output tokens at most, an org with the given balance, and a key. A plain request without a
// cap then holds its bound, maxCost (the model's max output at 1 each), as an unboundable one
// holds the learned max, maxCost too.
func (p *testProxy) setup(org string, funds, maxCost int64) string {
	p.admin("PUT", "/models/m", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": maxCost, "max_cost": maxCost, "default_hold": maxCost}, http.StatusOK, nil)
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	if funds > 0 {
		p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	}
	var k struct{ ID, Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// settled waits until the org has no holds and the ledger is fully reflected in Redis.
func (p *testProxy) settled(org string) balanceView {
	p.t.Helper()
	deadline := time.Now().Add(time.Minute) // bounds a hang: returns once settled
	for {
		b := p.balance(org)
		acct, err := p.app.ledger.Account(context.Background(), org)
		if err == nil && b.Holds == 0 && acct.Pending == 0 && acct.SettledSeq == acct.LedgerSeq && b.Available == b.LedgerBalance {
			return b
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("org %s never settled: %+v %+v %v", org, b, acct, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func chat(content string) map[string]any {
	return map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": content}}}
}

// TestFlowA: 20 concurrent requests on a funded org all succeed; while they are in flight the
// available balance is down by 20 holds; after the worker drains, available == ledger ==
// start − Σ real costs and no hold is left.
func TestFlowA(t *testing.T) {
	t.Parallel()
	eachModeWith(t, func(t *testing.T, start func(...Option) *testProxy) {
		gate := make(chan struct{})
		p := start(gatedUpstream(gate, ""))
		defer func() {
			select {
			case <-gate:
			default:
				close(gate) // a failed test's requests end too
			}
		}()
		key := p.setup("acme", 10_000, 65)
		var wg sync.WaitGroup
		statuses := make([]int, 20)
		for i := range statuses {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				statuses[i], _, _ = p.do("POST", "/v1/chat/completions", key, chat("[slow] hello world"))
			}(i)
		}
		// While in flight (held at the upstream until the gate opens): 20 holds of 65.
		deadline := time.Now().Add(time.Minute) // bounds a hang
		var seen balanceView
		for time.Now().Before(deadline) {
			seen = p.balance("acme")
			if seen.Holds == 20 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if seen.Holds != 20 || seen.Held != 20*65 || seen.Available != 10_000-20*65 {
			t.Fatalf("in flight: %+v, want 20 holds of 65", seen)
		}
		close(gate)
		wg.Wait()
		for i, s := range statuses {
			if s != http.StatusOK {
				t.Fatalf("request %d: status %d", i, s)
			}
		}
		b := p.settled("acme")
		if b.Available != 10_000-20*20 || b.LedgerBalance != 10_000-20*20 {
			t.Fatalf("after settle: %+v, want %d", b, 10_000-20*20)
		}
	})
}

// TestFlowB: balance 200, max cost 65, real cost 20, 10 concurrent requests → exactly 3 pass and
// 7 get 429 balance_held (the 3 in flight hold what they need: retryable); final balance 140,
// and once it is there, a request is served again (the money was held, not gone).
func TestFlowB(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 200, 65)
		var wg sync.WaitGroup
		type result struct {
			status int
			hdr    http.Header
			body   []byte
		}
		res := make([]result, 10)
		for i := range res {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				s, h, b := p.do("POST", "/v1/chat/completions", key, chat("[slow] hi"))
				res[i] = result{s, h, b}
			}(i)
		}
		wg.Wait()
		ok, refused := 0, 0
		for _, r := range res {
			switch r.status {
			case http.StatusOK:
				ok++
			case http.StatusTooManyRequests:
				refused++
				var e struct {
					Error struct{ Type, Code string }
				}
				// Refused while the 3 served are in flight, whose holds would cover it: held,
				// not gone — retryable (DESIGN "Held is not gone").
				if err := json.Unmarshal(r.body, &e); err != nil || e.Error.Code != "balance_held" || e.Error.Type != "rate_limit_exceeded" {
					t.Fatalf("429 body: %s", r.body)
				}
				if r.hdr.Get("x-should-retry") == "false" || r.hdr.Get("Retry-After") == "" {
					t.Fatalf("429 balance_held not retryable: %v", r.hdr)
				}
			default:
				t.Fatalf("unexpected status %d: %s", r.status, r.body)
			}
		}
		if ok != 3 || refused != 7 {
			t.Fatalf("%d passed, %d refused; want 3 and 7", ok, refused)
		}
		if b := p.settled("acme"); b.Available != 140 || b.LedgerBalance != 140 {
			t.Fatalf("final: %+v, want 140", b)
		}
		if s, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); s != http.StatusOK {
			t.Fatalf("the retry after the settle: %d %s", s, b)
		}
	})
}

// TestFlowC: an upstream failure passes the upstream's 500 through and charges nothing.
func TestFlowC(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 1000, 65)
		st, _, body := p.do("POST", "/v1/chat/completions", key, chat("please [fail] now"))
		if st != http.StatusInternalServerError || !bytes.Contains(body, []byte(`"error"`)) {
			t.Fatalf("fail request: %d %s", st, body)
		}
		if b := p.settled("acme"); b.Available != 1000 || b.LedgerBalance != 1000 {
			t.Fatalf("after failure: %+v, want 1000", b)
		}
	})
}

// TestRecharge: an org at 0 is refused, a credit lands, the next request passes at once; the
// same payment reference again credits nothing.
func TestRecharge(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 0, 65)
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); st != http.StatusTooManyRequests {
			t.Fatalf("at 0: %d %s", st, b)
		}
		var e1, e2 struct{ Seq, Delta int64 }
		p.admin("POST", "/orgs/acme/credits", map[string]any{"amount": 500, "reference": "pay_123"}, http.StatusCreated, &e1)
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); st != http.StatusOK {
			t.Fatalf("after credit: %d %s", st, b)
		}
		p.admin("POST", "/orgs/acme/credits", map[string]any{"amount": 500, "reference": "pay_123"}, http.StatusOK, &e2)
		if e1 != e2 {
			t.Fatalf("repeated credit returned %+v, original %+v", e2, e1)
		}
		p.admin("POST", "/orgs", map[string]string{"id": "other"}, http.StatusCreated, nil)
		st, _, b := p.do("POST", "/admin/v1/orgs/other/credits", testAdmin, map[string]any{"amount": 500, "reference": "pay_123"})
		if st != http.StatusConflict || bytes.Contains(b, []byte("acme")) {
			t.Fatalf("reference of another org: %d %s", st, b)
		}
		if b := p.settled("acme"); b.LedgerBalance != 480 {
			t.Fatalf("final: %+v, want 500 − 20", b)
		}
	})
}

// TestAdminAuth: the admin API needs its token.
func TestAdminAuth(t *testing.T) {
	t.Parallel()
	p := startTestProxy(t, false)
	for _, tok := range []string{"", "wrong"} {
		if st, _, _ := p.do("POST", "/admin/v1/orgs", tok, map[string]string{"id": "x"}); st != http.StatusUnauthorized {
			t.Fatalf("token %q: %d", tok, st)
		}
	}
	// Without a token (and outside the embedded demo, which makes one) there is no admin API.
	off := startTestProxy(t, true, func(c *Config) { c.AdminToken = "" })
	for _, tok := range []string{"", testAdmin} {
		if st, _, _ := off.do("POST", "/admin/v1/orgs", tok, map[string]string{"id": "x"}); st != http.StatusNotFound {
			t.Fatalf("admin API without a token configured, token %q: %d, want 404", tok, st)
		}
	}
}

var _ = fmt.Sprint
