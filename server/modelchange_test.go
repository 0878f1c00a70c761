package server

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
)

// startSharedProxies starts n proxies on one real Redis and one Postgres schema, as a
// deployment of several proxy processes runs, each with tweak applied.
func startSharedProxies(t *testing.T, n int, tweak ...func(*Config)) []*testProxy {
	t.Helper()
	env := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	var ps []*testProxy
	for range n {
		ps = append(ps, startTestProxy(t, false, append([]func(*Config){func(c *Config) {
			c.RedisURL, c.DatabaseURL, c.Prefix = env.URL, pg.URL, env.Prefix
		}}, tweak...)...))
	}
	return ps
}

// TestModelChangeReachesEveryProxy (issue 22 item 7): two proxies share Redis and Postgres;
// proxy B has the model's prices cached when an admin call on proxy A changes them. Every
// request B takes after the call returned is priced at the new price (PATCH, then PUT), and
// after a DELETE returned B serves no request for the model.
func TestModelChangeReachesEveryProxy(t *testing.T) {
	t.Parallel()
	ps := startSharedProxies(t, 2)
	a, b := ps[0], ps[1]
	key := a.setup("payer", 10_000_000, 50_000) // model m: 1 µ per output token, input free
	ask := func(p *testProxy, key, model string, tokens int) (int, int64, string) {
		t.Helper()
		resp, body := p.send("/v1/chat/completions", key, `{"model":"`+model+`","messages":[{"role":"user","content":"hi"}],"max_tokens":`+strconv.Itoa(tokens)+`}`, nil)
		if resp.StatusCode != http.StatusOK {
			return resp.StatusCode, 0, body
		}
		return resp.StatusCode, atoi(t, "x-escrow-cost", resp.Header.Get("X-Escrow-Cost")), body
	}
	if st, cost, body := ask(b, key, "m", 7); st != 200 || cost != 7 {
		t.Fatalf("before the change: %d cost %d %s, want 7", st, cost, body)
	}
	a.admin("PATCH", "/models/m", map[string]any{"output_price": 10_000_000}, http.StatusOK, nil)
	if st, cost, body := ask(b, key, "m", 7); st != 200 || cost != 70 {
		t.Fatalf("right after the PATCH returned: %d cost %d %s, want 70 (the new price)", st, cost, body)
	}
	a.admin("PUT", "/models/m", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 3_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": 50_000, "default_hold": 50_000}, http.StatusOK, nil)
	if st, cost, body := ask(b, key, "m", 7); st != 200 || cost != 21 {
		t.Fatalf("right after the PUT returned: %d cost %d %s, want 21 (the new price)", st, cost, body)
	}

	// A model no request has used yet: B has it cached (a request refused for its balance),
	// A deletes it, and B refuses it from then on.
	a.admin("PUT", "/models/fresh", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": 1000, "default_hold": 1000}, http.StatusOK, nil)
	a.admin("POST", "/orgs", map[string]string{"id": "broke"}, http.StatusCreated, nil)
	var k struct{ ID, Key string }
	a.admin("POST", "/orgs/broke/keys", nil, http.StatusCreated, &k)
	if st, _, body := ask(b, k.Key, "fresh", 7); st != http.StatusTooManyRequests && st != http.StatusPaymentRequired {
		t.Fatalf("a broke org: %d %s, want a refusal for its balance", st, body)
	}
	a.admin("DELETE", "/models/fresh", nil, http.StatusNoContent, nil)
	if st, _, body := ask(b, key, "fresh", 7); st != http.StatusNotFound {
		t.Fatalf("right after the DELETE returned: %d %s, want 404", st, body)
	}
}

// TestDeleteModelInFlight (issue 22 item 7): a DELETE of a model with a request in flight on
// another proxy is refused with 409 model_in_flight, and the model keeps serving; once the
// request is over the model has usage, and stays.
func TestDeleteModelInFlight(t *testing.T) {
	t.Parallel()
	g := startGatedModel(t, false, 10_000_000)
	a, b, key, arrived, release := g.a, g.b, g.key, g.arrived, g.release

	type result struct {
		status int
		body   string
	}
	inFlight := make(chan result, 1)
	go func() {
		resp, body := b.send("/v1/chat/completions", key, `{"model":"slow","messages":[{"role":"user","content":"wait for me"}]}`, nil)
		inFlight <- result{resp.StatusCode, body}
	}()
	select {
	case <-arrived:
	case r := <-inFlight:
		t.Fatalf("the request ended before reaching the upstream: %d %s", r.status, r.body)
	}
	st, _, body := a.do("DELETE", "/admin/v1/models/slow", testAdmin, nil)
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	if st != http.StatusConflict || e.Error.Code != "model_in_flight" {
		t.Fatalf("DELETE with a request in flight: %d %s, want 409 model_in_flight", st, body)
	}
	release()
	if r := <-inFlight; r.status != http.StatusOK {
		t.Fatalf("the request in flight: %d %s", r.status, r.body)
	}
	if resp, body := b.send("/v1/chat/completions", key, `{"model":"slow","messages":[{"role":"user","content":"hi"}]}`, nil); resp.StatusCode != http.StatusOK {
		t.Fatalf("the model after a refused delete: %d %s", resp.StatusCode, body)
	}
	a.admin("GET", "/models/slow", nil, http.StatusOK, nil)
}

// gatedModel is two proxies sharing Redis and the ledger, in front of an upstream that holds
// requests until release, and an org "payer" with a key for the model "slow" (1 per output
// token). A request whose body says "wait for me" signals arrived when it reaches the upstream.
type gatedModel struct {
	a, b    *testProxy
	key     string
	arrived chan struct{}
	release func() // lets every held request go (idempotent; also run at cleanup)
}

// startGatedModel starts a gatedModel: with all, every request waits for release; else only
// the "wait for me" ones.
func startGatedModel(t *testing.T, all bool, credit int64) gatedModel {
	t.Helper()
	gate := make(chan struct{})
	var once sync.Once
	g := gatedModel{arrived: make(chan struct{}, 1), release: func() { once.Do(func() { close(gate) }) }}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		waits := strings.Contains(string(body), "wait for me")
		if waits {
			g.arrived <- struct{}{}
		}
		if waits || all {
			<-gate
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","model":"slow","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`)
	}))
	t.Cleanup(up.Close)
	ps := startSharedProxies(t, 2, func(c *Config) { c.UpstreamURL, c.UpstreamAPIKey = up.URL, "sk-test-upstream" })
	// Before the proxies stop (cleanups run last first): a request still waiting ends.
	t.Cleanup(g.release)
	g.a, g.b = ps[0], ps[1]
	g.key = g.a.setup("payer", credit, 50_000)
	g.a.admin("PUT", "/models/slow", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": 1000, "default_hold": 1000}, http.StatusOK, nil)
	return g
}
