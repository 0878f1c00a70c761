package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/openai/openai-go/v3"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

func ptr(s string) *string { return &s }

// TestRouteTable: an exact name beats the longest prefix, which beats shorter ones; styles are
// separate tables; a model no route serves has none.
func TestRouteTable(t *testing.T) {
	t.Parallel()
	env := map[string]string{"KEY_B": "sk-b"}
	tab, err := newRouteTable([]Route{
		{Prefix: ptr(""), Upstream: "http://all", APIKey: "sk-all"},
		{Prefix: ptr("gpt-"), Upstream: "http://gpt", APIKey: "sk-gpt"},
		{Prefix: ptr("gpt-4o"), Upstream: "http://gpt4o", APIKeyEnv: "KEY_B"},
		{Model: "gpt-4o-mini", Upstream: "http://mini", APIKey: "sk-mini", Rename: "gpt-4o-mini-2024-07-18"},
		{Prefix: ptr("claude-"), Upstream: "https://api.anthropic.com", APIKey: "sk-ant", Style: StyleAnthropic},
	}, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		style       Style
		model, host string
		upModel     string
	}{
		{StyleOpenAI, "gpt-4o-mini", "mini", "gpt-4o-mini-2024-07-18"},
		{StyleOpenAI, "gpt-4o-mini-x", "gpt4o", "gpt-4o-mini-x"},
		{StyleOpenAI, "gpt-4o", "gpt4o", "gpt-4o"},
		{StyleOpenAI, "gpt-3.5", "gpt", "gpt-3.5"},
		{StyleOpenAI, "claude-x", "all", "claude-x"},
		{StyleAnthropic, "claude-x", "api.anthropic.com", "claude-x"},
		{StyleAnthropic, "gpt-4o", "", ""},
	} {
		u := tab.lookup(tc.style, tc.model)
		if tc.host == "" {
			if u != nil {
				t.Errorf("%s %s: routed to %s, want none", tc.style, tc.model, u.base)
			}
			continue
		}
		if u == nil || u.base.Host != tc.host || u.upstreamModel(tc.model) != tc.upModel {
			t.Errorf("%s %s: %+v, want %s (%s)", tc.style, tc.model, u, tc.host, tc.upModel)
		}
	}
	if u := tab.lookup(StyleOpenAI, "gpt-4o"); u.key != "sk-b" {
		t.Errorf("api_key_env: key %q", u.key)
	}
	if tab.catchAll(StyleOpenAI) == nil || tab.catchAll(StyleAnthropic) != nil {
		t.Error("catch-all routes wrong")
	}
	if s := tab.String(); strings.Contains(s, "sk-") || !strings.Contains(s, "openai gpt-4o-mini → http://mini") {
		t.Errorf("String: %s", s)
	}

	// The upstream key goes in the header of the route's style, replacing the client's.
	h := http.Header{"Authorization": {"Bearer client"}, "X-Api-Key": {"client"}}
	tab.lookup(StyleAnthropic, "claude-x").setKey(h)
	if h.Get("X-Api-Key") != "sk-ant" || h.Get("Authorization") != "" {
		t.Errorf("anthropic style headers: %v", h)
	}
	tab.lookup(StyleOpenAI, "gpt-4o").setKey(h)
	if h.Get("Authorization") != "Bearer sk-b" || h.Get("X-Api-Key") != "" {
		t.Errorf("openai style headers: %v", h)
	}
}

func TestRouteTableRefusals(t *testing.T) {
	t.Parallel()
	for name, r := range map[string]Route{
		"model and prefix":  {Model: "a", Prefix: ptr("a"), Upstream: "http://x", APIKey: "k"},
		"neither":           {Upstream: "http://x", APIKey: "k"},
		"rename on prefix":  {Prefix: ptr("gpt-"), Upstream: "http://x", APIKey: "k", Rename: "gpt-4o"},
		"no key":            {Model: "a", Upstream: "http://x"},
		"empty key env":     {Model: "a", Upstream: "http://x", APIKeyEnv: "NOPE"},
		"key and key env":   {Model: "a", Upstream: "http://x", APIKey: "k", APIKeyEnv: "K"},
		"relative upstream": {Model: "a", Upstream: "/v1", APIKey: "k"},
		"ftp upstream":      {Model: "a", Upstream: "ftp://x", APIKey: "k"},
		"bad style":         {Model: "a", Upstream: "http://x", APIKey: "k", Style: "cohere"},
	} {
		if _, err := newRouteTable([]Route{r}, func(string) string { return "" }); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := newRouteTable([]Route{{Model: "a", Upstream: "http://x", APIKey: "k"}, {Model: "a", Upstream: "http://y", APIKey: "k"}}, os.Getenv); err == nil {
		t.Error("a model twice: accepted")
	}
	dir := t.TempDir()
	for name, body := range map[string]string{
		"typo":   `{"routes":[{"modle":"a","upstream":"http://x","api_key":"k"}]}`,
		"empty":  `{"routes":[]}`,
		"broken": `{"routes":[`,
	} {
		f := filepath.Join(dir, name+".json")
		if err := os.WriteFile(f, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := readRoutesFile(f); err == nil {
			t.Errorf("routes file %s: accepted", name)
		}
	}
	cfg := DefaultConfig()
	cfg.RoutesFile, cfg.UpstreamURL, cfg.UpstreamAPIKey = "r.json", "http://x", "k"
	if err := cfg.validate(); err == nil {
		t.Error("ESCROW_ROUTES_FILE with UPSTREAM_URL: accepted")
	}
	cfg = DefaultConfig()
	cfg.RoutesFile, cfg.AnthropicURL, cfg.AnthropicAPIKey = "r.json", "http://x", "k"
	if err := cfg.validate(); err == nil {
		t.Error("ESCROW_ROUTES_FILE with ESCROW_ANTHROPIC_URL: accepted")
	}
}

// twoUpstreams is a proxy on real Redis and Postgres in front of two fake upstreams, each with
// its own key, routed by model.
type twoUpstreams struct {
	p    *testProxy
	a, b *fakeupstream.Server
	logs *lockedBuffer
}

const (
	keyA = "sk-upstream-a-7f3c9e"
	keyB = "sk-upstream-b-51d0aa"
)

func startTwoUpstreams(t *testing.T) *twoUpstreams {
	t.Helper()
	a := fakeupstream.New(fakeupstream.Options{APIKey: keyA})
	b := fakeupstream.New(fakeupstream.Options{APIKey: keyB})
	sa, sb := httptest.NewServer(a), httptest.NewServer(b)
	t.Cleanup(sa.Close)
	t.Cleanup(sb.Close)
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close() // an upstream that refuses connections
	routes, _ := json.Marshal(map[string]any{"routes": []map[string]any{
		{"model": "model-a", "upstream": sa.URL, "api_key": keyA},
		{"prefix": "b-", "upstream": sb.URL, "api_key": keyB},
		{"model": "alias", "upstream": sb.URL, "api_key": keyB, "rename": "b-dear", "owned_by": "team-b"},
		{"model": "down", "upstream": down.URL, "api_key": keyA},
		{"prefix": "claude-", "upstream": sb.URL, "api_key": keyB, "style": "anthropic"},
	}})
	f := filepath.Join(t.TempDir(), "routes.json")
	if err := os.WriteFile(f, routes, 0o600); err != nil {
		t.Fatal(err)
	}
	logs := &lockedBuffer{}
	p := startTestProxy(t, true, func(c *Config) {
		c.RoutesFile = f
		c.Logger = slog.New(slog.NewTextHandler(logs, nil)) // the server adds the masking itself
	})
	return &twoUpstreams{p: p, a: a, b: b, logs: logs}
}

// TestTwoUpstreams: each model goes to its own upstream with that upstream's key, a renamed
// model reaches its upstream under the new name and is priced as the name the client used, a
// model without a route (priced or not) is a 404 model_not_found with nothing held, and the
// org is billed exactly, to the micro-unit, for what each upstream reported.
func TestTwoUpstreams(t *testing.T) {
	t.Parallel()
	u := startTwoUpstreams(t)
	p := u.p
	put := func(name string, in, cached, out int64) {
		p.admin("PUT", "/models/"+name, map[string]any{"input_price": in, "cached_input_price": cached, "output_price": out,
			"max_input_tokens": 100_000, "max_output_tokens": 1000, "default_hold": 50_000}, http.StatusOK, nil)
	}
	put("model-a", 1_500_000, 750_000, 3_000_000)
	put("b-cheap", 333_333, 0, 1_000_001)
	put("alias", 7_000_000, 7_000_000, 21_000_000) // priced as the dear model it serves
	put("b-dear", 1, 1, 1)                         // a cheap price on the renamed name: never used
	put("unrouted", 1, 1, 1)
	p.admin("POST", "/orgs", map[string]string{"id": "acme"}, http.StatusCreated, nil)
	p.admin("POST", "/orgs/acme/credits", map[string]any{"amount": 10_000_000, "reference": "init"}, http.StatusCreated, nil)
	var k struct{ Key string }
	p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)

	want := int64(10_000_000)
	prices := map[string]pricing.Prices{
		"model-a": {pricing.Input: 1_500_000, pricing.CachedInput: 750_000, pricing.Output: 3_000_000},
		"b-cheap": {pricing.Input: 333_333, pricing.Output: 1_000_001},
		"alias":   {pricing.Input: 7_000_000, pricing.CachedInput: 7_000_000, pricing.Output: 21_000_000},
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := range 12 {
		model := []string{"model-a", "b-cheap", "alias"}[i%3]
		content := strings.Repeat("word ", 3+i) + "[cached:2]"
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, _, body := p.do("POST", "/v1/chat/completions", k.Key, map[string]any{"model": model, "max_tokens": 7 + i,
				"messages": []map[string]string{{"role": "user", "content": content}}})
			if st != http.StatusOK {
				t.Errorf("%s: %d %s", model, st, body)
				return
			}
			var r struct{ Usage fakeupstream.ChatUsage }
			if err := json.Unmarshal(body, &r); err != nil {
				t.Error(err)
				return
			}
			c, err := prices[model].Cost(pricing.Usage{Prompt: int64(r.Usage.PromptTokens), Completion: int64(r.Usage.CompletionTokens), Units: pricing.Units{pricing.CachedInput: int64(r.Usage.PromptTokensDetails.CachedTokens)}})
			if err != nil || r.Usage.PromptTokens != 4+i || r.Usage.CompletionTokens != 7+i || r.Usage.PromptTokensDetails.CachedTokens != 2 {
				t.Errorf("%s: usage %+v %v", model, r.Usage, err)
			}
			mu.Lock()
			want -= c
			mu.Unlock()
		}()
	}
	wg.Wait()
	for name, st := range map[string]int{"unknown-model": 404, "unrouted": 404, "b-dear": 200} {
		status, _, body := p.do("POST", "/v1/chat/completions", k.Key, map[string]any{"model": name, "max_tokens": 1,
			"messages": []map[string]string{{"role": "user", "content": "hi"}}})
		if status != st || (st == 404 && !bytes.Contains(body, []byte(`"model_not_found"`))) {
			t.Fatalf("%s: %d %s, want %d", name, status, body, st)
		}
		if st == 200 {
			want-- // b-dear by its own name: 1 input and 1 output token at 1 per 1M, rounded up to 1
		}
	}
	if b := p.settled("acme"); b.LedgerBalance != want || b.Available != want {
		t.Fatalf("balance %+v, want exactly %d", b, want)
	}

	seenA, seenB := u.a.Seen(), u.b.Seen()
	if len(seenA) != 4 || len(seenB) != 9 {
		t.Fatalf("upstream A got %d requests, B %d; want 4 and 9", len(seenA), len(seenB))
	}
	for _, r := range seenA {
		if r.Model != "model-a" || r.Authorization != "Bearer "+keyA {
			t.Errorf("A got %q with %q", r.Model, r.Authorization)
		}
	}
	renamed := 0
	for _, r := range seenB {
		if r.Authorization != "Bearer "+keyB || (r.Model != "b-cheap" && r.Model != "b-dear") {
			t.Errorf("B got %q with %q", r.Model, r.Authorization)
		}
		if r.Model == "b-dear" {
			renamed++
		}
	}
	if renamed != 5 { // 4 through the alias, 1 by its own name
		t.Errorf("B got b-dear %d times, want 5", renamed)
	}

	// An upstream that cannot be reached: 502, nothing charged, and no key in any log line.
	if st, _, body := p.do("POST", "/v1/chat/completions", k.Key, chat("hi")); st != http.StatusNotFound {
		t.Fatalf("model m has no route: %d %s", st, body)
	}
	put("down", 1, 1, 1)
	if st, _, body := p.do("POST", "/v1/chat/completions", k.Key, map[string]any{"model": "down",
		"messages": []map[string]string{{"role": "user", "content": "hi"}}}); st != http.StatusBadGateway {
		t.Fatalf("down: %d %s", st, body)
	}
	p.app.log.Warn("a careless line", "key", keyA, "header", "Bearer "+keyB, "err", context.Canceled)
	if b := p.settled("acme"); b.LedgerBalance != want {
		t.Fatalf("after the failed upstream: %+v, want %d", b, want)
	}
	logs := u.logs.String()
	if !strings.Contains(logs, "upstream error") || !strings.Contains(logs, "a careless line") {
		t.Fatalf("expected log lines missing:\n%s", logs)
	}
	if strings.Contains(logs, keyA) || strings.Contains(logs, keyB) {
		t.Fatalf("an upstream key reached the log:\n%s", logs)
	}
}

// TestModelsEndpoint: GET /v1/models lists the priced models that have a route, in OpenAI's
// shape (read through the official SDK), unbilled and only for a valid key; GET
// /v1/models/{id} answers one of them or 404 model_not_found.
func TestModelsEndpoint(t *testing.T) {
	t.Parallel()
	u := startTwoUpstreams(t)
	p := u.p
	for _, m := range []string{"model-a", "b-1", "alias", "unrouted", "claude-9", "claude-1"} {
		p.admin("PUT", "/models/"+m, map[string]any{"input_price": 1, "output_price": 1, "default_hold": 10}, http.StatusOK, nil)
	}
	p.admin("POST", "/orgs", map[string]string{"id": "acme"}, http.StatusCreated, nil)
	p.admin("POST", "/orgs/acme/credits", map[string]any{"amount": 1000, "reference": "init"}, http.StatusCreated, nil)
	var k struct{ Key string }
	p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)

	for _, tok := range []string{"", "sk-wrong"} {
		if st, _, body := p.do("GET", "/v1/models", tok, nil); st != http.StatusUnauthorized || !bytes.Contains(body, []byte("invalid_api_key")) {
			t.Fatalf("token %q: %d %s", tok, st, body)
		}
	}
	st, _, body := p.do("GET", "/v1/models", k.Key, nil)
	var list struct {
		Object string
		Data   []map[string]any
	}
	if err := json.Unmarshal(body, &list); err != nil || st != 200 || list.Object != "list" {
		t.Fatalf("%d %s", st, body)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m["id"].(string))
		if m["object"] != "model" || m["created"] == nil || m["owned_by"] == nil || len(m) != 4 {
			t.Fatalf("model shape: %v", m)
		}
	}
	if strings.Join(ids, ",") != "alias,b-1,model-a" {
		t.Fatalf("listed %v, want the routed priced models alias, b-1, model-a", ids)
	}

	c := sdk(p, k.Key, http.DefaultTransport)
	ctx := context.Background()
	pager, err := c.Models.List(ctx)
	if err != nil || len(pager.Data) != 3 || pager.Data[0].ID != "alias" || pager.Data[0].OwnedBy != "team-b" {
		t.Fatalf("SDK list: %+v %v", pager, err)
	}
	m, err := c.Models.Get(ctx, "b-1")
	if err != nil || m.ID != "b-1" || m.Object != "model" || m.OwnedBy != "escrow" {
		t.Fatalf("SDK get: %+v %v", m, err)
	}
	_, err = c.Models.Get(ctx, "unrouted")
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("SDK get of an unrouted model: %v", err)
	}
	// With anthropic-version: the models of the anthropic-style routes, in Anthropic's shape.
	get := func(path string) (int, string) {
		req, _ := http.NewRequest("GET", p.base+path, nil)
		req.Header.Set("Authorization", "Bearer "+k.Key)
		req.Header.Set("anthropic-version", "2023-06-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return resp.StatusCode, b.String()
	}
	const wantList = `{"data":[{"type":"model","id":"claude-1","display_name":"claude-1","created_at":"1970-01-01T00:00:00Z"},` +
		`{"type":"model","id":"claude-9","display_name":"claude-9","created_at":"1970-01-01T00:00:00Z"}],"has_more":false,"first_id":"claude-1","last_id":"claude-9"}`
	if st, body := get("/v1/models"); st != 200 || strings.TrimSpace(body) != wantList {
		t.Fatalf("anthropic list: %d %s", st, body)
	}
	if st, body := get("/v1/models/claude-9"); st != 200 || !strings.Contains(body, `"id":"claude-9"`) {
		t.Fatalf("anthropic get: %d %s", st, body)
	}
	if st, body := get("/v1/models/model-a"); st != 404 || !strings.Contains(body, `"type":"not_found_error"`) {
		t.Fatalf("anthropic get of an openai-style model: %d %s", st, body)
	}

	// Other methods on the model paths are never forwarded (OpenAI's DELETE /v1/models/{id}
	// deletes a fine-tuned model with the operator's key).
	for _, m := range []string{"DELETE", "POST", "PUT"} {
		for _, path := range []string{"/v1/models", "/v1/models/b-1"} {
			if st, _, body := p.do(m, path, k.Key, nil); st/100 != 4 {
				t.Fatalf("%s %s: %d %s", m, path, st, body)
			}
		}
	}
	if b := p.settled("acme"); b.LedgerBalance != 1000 || b.Available != 1000 {
		t.Fatalf("listing billed something: %+v", b)
	}
	if n := len(u.a.Seen()) + len(u.b.Seen()); n != 0 {
		t.Fatalf("listing reached an upstream %d times", n)
	}
}

// TestModelPathsNotForwarded: with UPSTREAM_URL as the catch-all route, the model paths are
// still answered by the proxy: a DELETE /v1/models/{id} (which deletes a fine-tuned model at
// OpenAI) never reaches the upstream with the operator's key, and the list is the priced models.
func TestModelPathsNotForwarded(t *testing.T) {
	t.Parallel()
	up := fakeupstream.New(fakeupstream.Options{APIKey: "sk-op"})
	su := httptest.NewServer(up)
	t.Cleanup(su.Close)
	p := startTestProxy(t, false, func(c *Config) { c.UpstreamURL, c.UpstreamAPIKey = su.URL, "sk-op" })
	key := p.setup("acme", 1000, 65)
	for _, m := range []string{"DELETE", "POST"} {
		if st, _, body := p.do(m, "/v1/models/ft:gpt-4o:acme", key, nil); st/100 != 4 {
			t.Fatalf("%s: %d %s", m, st, body)
		}
	}
	if st, _, body := p.do("GET", "/v1/models", key, nil); st != 200 || !strings.Contains(string(body), `"id":"m"`) {
		t.Fatalf("list: %d %s", st, body)
	}
	if n := up.Requests(); n != 0 {
		t.Fatalf("the upstream got %d requests", n)
	}
}

// TestWithRoutes: routes given by a program come before the configured catch-all (here the
// in-process upstream of WithUpstream), so one embedded proxy serves two upstreams.
func TestWithRoutes(t *testing.T) {
	t.Parallel()
	a := fakeupstream.New(fakeupstream.Options{APIKey: "sk-a-in-process"})
	b := fakeupstream.New(fakeupstream.Options{APIKey: "sk-b-routed"})
	sb := httptest.NewServer(b)
	t.Cleanup(sb.Close)
	mini := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { _ = rdb.Close() })
	cfg := DefaultConfig()
	cfg.Addr, cfg.Logger = "127.0.0.1:0", slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	s, err := New(ctx, cfg, WithEmbeddedRedis(rdb), WithUpstream(a, "sk-a-in-process"),
		WithRoutes(Route{Model: "claude-x", Upstream: sb.URL, APIKey: "sk-b-routed", Rename: "b-model"}))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop(context.Background()) })
	ops := s.Ops()
	for _, m := range []string{"m", "claude-x"} {
		if err := ops.PutModel(ctx, ledger.Model{Name: m, Prices: pricing.Prices{pricing.Output: 1_000_000}, DefaultHold: 100}); err != nil {
			t.Fatal(err)
		}
	}
	if err := ops.Ledger().CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ops.Credit(ctx, "acme", 1000, "init"); err != nil {
		t.Fatal(err)
	}
	_, key, err := ops.Ledger().CreateKey(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	p := &testProxy{t: t, app: s, base: "http://" + s.Addr()}
	for _, m := range []string{"m", "claude-x"} {
		if st, _, body := p.do("POST", "/v1/chat/completions", key, map[string]any{"model": m, "max_tokens": 3,
			"messages": []map[string]string{{"role": "user", "content": "hi"}}}); st != 200 {
			t.Fatalf("%s: %d %s", m, st, body)
		}
	}
	ra, _ := a.LastRequest()
	rb, _ := b.LastRequest()
	if a.Requests() != 1 || b.Requests() != 1 || ra.Model != "m" || rb.Model != "b-model" || rb.Authorization != "Bearer sk-b-routed" {
		t.Fatalf("A %d %+v, B %d %+v", a.Requests(), ra.Model, b.Requests(), rb)
	}
	if _, err := New(ctx, cfg, WithEmbeddedRedis(rdb), WithUpstream(a, "k-a"), WithRoutes(Route{Prefix: ptr(""), Upstream: sb.URL, APIKey: "k"})); err == nil {
		t.Fatal("two catch-all routes: accepted")
	}
}
