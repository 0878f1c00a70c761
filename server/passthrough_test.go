package server

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestAnthropicBetasAndQuery (issue 22 item 6): the anthropic-beta header is read as the
// upstream reads it (commas, spaces and quotes trimmed) and a beta that may change what is
// billed is refused by name, also quoted, hidden behind ';' or a space, or sent as the body's
// anthropic_beta; the betas that pass reach the upstream as the list checked; of the client's
// query string only the allow-listed parameters reach the upstream.
func TestAnthropicBetasAndQuery(t *testing.T) {
	t.Parallel()
	fake := fakeupstream.New(fakeupstream.Options{APIKey: anthUpstreamKey})
	up := httptest.NewServer(fake)
	t.Cleanup(up.Close)
	p := anthProxy{startTestProxy(t, true, func(c *Config) { c.AnthropicURL, c.AnthropicAPIKey = up.URL, anthUpstreamKey }), fake}
	key := p.setupClaude("betas", 10_000_000)
	body := `{"model":"claude-t","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`
	withBetas := func(list string) string {
		return strings.Replace(body, `"max_tokens":5`, `"max_tokens":5,"anthropic_beta":`+list, 1)
	}

	refused := []struct {
		name, body, beta, want string
	}{
		{"quoted", body, `"context-1m-2025-08-07"`, "context-1m-2025-08-07"},
		{"quoted list", body, `"prompt-caching-2024-07-31, context-1m-2025-08-07"`, "context-1m-2025-08-07"},
		{"semicolon", body, "prompt-caching-2024-07-31;context-1m-2025-08-07", "context-1m-2025-08-07"},
		{"space", body, "prompt-caching-2024-07-31 context-1m-2025-08-07", "context-1m-2025-08-07"},
		{"upper case", body, "Context-1M-2025-08-07", "context-1m-2025-08-07"},
		{"unknown beta", body, "code-execution-2025-05-22", "code-execution-2025-05-22"},
		{"body", withBetas(`["context-1m-2025-08-07"]`), "", "context-1m-2025-08-07"},
		{"body list", withBetas(`["prompt-caching-2024-07-31,files-api-2025-04-14"]`), "", "files-api-2025-04-14"},
		{"body not a list", withBetas(`"context-1m-2025-08-07"`), "", "anthropic_beta"},
	}
	for _, c := range refused {
		var hdr []string
		if c.beta != "" {
			hdr = []string{"anthropic-beta", c.beta}
		}
		st, _, b := p.messages("/v1/messages", key, c.body, hdr...)
		if typ, msg := anthErr(t, b); st != http.StatusBadRequest || typ != "invalid_request_error" || !strings.Contains(msg, c.want) {
			t.Errorf("%s: %d %s, want a 400 naming %s", c.name, st, b, c.want)
		}
	}
	if n := p.fake.Requests(); n != 0 {
		t.Fatalf("the upstream got %d of the refused requests", n)
	}
	// The header on an OpenAI-style path (a gateway there may pass it on to Anthropic).
	req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/chat/completions",
		strings.NewReader(`{"model":"claude-t","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("anthropic-beta", "context-1m-2025-08-07")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	chatBody, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusBadRequest || !strings.Contains(string(chatBody), "context-1m-2025-08-07") {
		t.Errorf("anthropic-beta on /v1/chat/completions: %d %s, want a 400 naming the beta", res.StatusCode, chatBody)
	}

	st, _, b := p.messages("/v1/messages?beta=true&foo=bar&api-version=1", key, withBetas(`["prompt-caching-2024-07-31"]`),
		"anthropic-beta", ` Prompt-Caching-2024-07-31 , 'interleaved-thinking-2025-05-14',`)
	if st != http.StatusOK {
		t.Fatalf("safe betas: %d %s", st, b)
	}
	seen, _ := p.fake.LastRequest()
	if got := seen.Header.Values("Anthropic-Beta"); len(got) != 1 || got[0] != "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14" {
		t.Errorf("upstream anthropic-beta %q", got)
	}
	if seen.Query != "beta=true" {
		t.Errorf("upstream query %q, want beta=true only", seen.Query)
	}
	st, _, b = p.messages("/v1/messages?beta=context-1m-2025-08-07", key, body)
	if seen, _ := p.fake.LastRequest(); st != http.StatusOK || seen.Query != "" {
		t.Errorf("beta with a value other than true or false: %d %s, upstream query %q", st, b, seen.Query)
	}
	p.settled("betas")
}

// TestUpstreamQuery: the upstream URL's own query is kept; of the client's, only the
// parameters allowed on its path, with an allowed value.
func TestUpstreamQuery(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ base, in, want string }{
		{"", "/v1/chat/completions?x=1&api-version=2", ""},
		{"api-version=2024-10-21", "/v1/chat/completions?api-version=1&x=1", "api-version=2024-10-21"},
		{"", "/v1/messages?beta=true&x=1", "beta=true"},
		{"k=v", "/v1/messages?beta=true", "k=v&beta=true"},
		{"", "/v1/messages/count_tokens?beta=true", "beta=true"},
		{"", "/v1/messages?beta=yes", ""},
		{"", "/v1/responses?beta=true", ""},
	} {
		u, err := url.Parse(c.in)
		if err != nil {
			t.Fatal(err)
		}
		if got := upstreamQuery(c.base, u); got != c.want {
			t.Errorf("upstreamQuery(%q, %q) = %q, want %q", c.base, c.in, got, c.want)
		}
	}
}

// TestEdgeSettings: ESCROW_TRUSTED_PROXIES takes CIDRs and addresses and refuses anything else;
// ESCROW_WEBHOOK_ALLOW_PRIVATE is off by default.
func TestEdgeSettings(t *testing.T) {
	t.Parallel()
	load := func(env map[string]string) (*Config, error) {
		return LoadConfig("t", nil, func(k string) string { return env[k] }, io.Discard)
	}
	for _, bad := range []string{"10.0.0.0/33", "proxy.internal", "10.0.0.0/8;192.0.2.1", "*"} {
		if _, err := load(map[string]string{"ESCROW_TRUSTED_PROXIES": bad}); !errors.Is(err, ErrConfig) {
			t.Errorf("ESCROW_TRUSTED_PROXIES=%q: %v, want a configuration error", bad, err)
		}
	}
	c, err := load(map[string]string{"ESCROW_TRUSTED_PROXIES": "10.0.0.0/8, 192.0.2.7,2001:db8::/32", "ESCROW_WEBHOOK_ALLOW_PRIVATE": "1"})
	if err != nil || !c.WebhookAllowPrivate {
		t.Fatalf("%+v, %v", c, err)
	}
	nets, err := parseCIDRs(c.TrustedProxies)
	if err != nil || len(nets) != 3 || nets[1].String() != "192.0.2.7/32" {
		t.Fatalf("%v, %v", nets, err)
	}
	if d := DefaultConfig(); d.TrustedProxies != "" || d.WebhookAllowPrivate {
		t.Fatalf("defaults: trusted proxies %q, private webhooks %v", d.TrustedProxies, d.WebhookAllowPrivate)
	}
	c = DefaultConfig()
	c.TrustedProxies = "not a range"
	if err := c.validate(); !errors.Is(err, ErrConfig) {
		t.Fatalf("a Config built by hand with a bad range: %v", err)
	}
}
