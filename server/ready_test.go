package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
)

// TestReadyzSaysNoAddress: /readyz has no authentication, so with Redis down it answers 503
// {"redis":"down"} and nothing of the dial error (address, port, user).
func TestReadyzSaysNoAddress(t *testing.T) {
	t.Parallel()
	rs := testutil.StartRedisServer(t)
	pg := testutil.Postgres(t)
	p := startTestProxy(t, false, func(c *Config) {
		c.RedisURL, c.DatabaseURL, c.Prefix = rs.URL(), pg.URL, testutil.RandomName("r")
	})
	if st, _, b := p.do("GET", "/readyz", "", nil); st != http.StatusOK || !strings.Contains(string(b), `"redis":"ok"`) {
		t.Fatalf("readyz with Redis up: %d %s", st, b)
	}
	rs.Stop()
	st, _, b := p.do("GET", "/readyz", "", nil)
	var checks map[string]string
	if err := json.Unmarshal(b, &checks); err != nil || st != http.StatusServiceUnavailable {
		t.Fatalf("readyz with Redis down: %d %s (%v)", st, b, err)
	}
	if checks["redis"] != "down" || checks["ledger"] != "ok" {
		t.Fatalf("readyz with Redis down: %s, want redis down and ledger ok", b)
	}
	for _, leak := range []string{strconv.Itoa(rs.Port()), "127.0.0.1", "dial", "postgres"} {
		if strings.Contains(string(b), leak) {
			t.Fatalf("readyz tells %q: %s", leak, b)
		}
	}
}

// TestEchoErrorCodes: errors of the router itself are OpenAI-shaped with a snake_case code
// (never the status text, which has spaces and capitals).
func TestEchoErrorCodes(t *testing.T) {
	t.Parallel()
	p := startTestProxy(t, false)
	for _, tc := range []struct {
		method, path string
		status       int
		code         string
	}{
		{"GET", "/nowhere", http.StatusNotFound, "not_found"},
		{"POST", "/healthz", http.StatusMethodNotAllowed, "method_not_allowed"},
	} {
		st, _, b := p.do(tc.method, tc.path, "", nil)
		var e struct {
			Error struct{ Type, Code string }
		}
		if err := json.Unmarshal(b, &e); err != nil || st != tc.status || e.Error.Code != tc.code || e.Error.Type != "invalid_request_error" {
			t.Errorf("%s %s: %d %s, want %d code %s", tc.method, tc.path, st, b, tc.status, tc.code)
		}
	}
	for status, want := range map[int]string{413: "request_entity_too_large", 503: "service_unavailable", 418: "im_a_teapot", 599: "http_599"} {
		if got := statusCode(status); got != want {
			t.Errorf("statusCode(%d) = %q, want %q", status, got, want)
		}
	}
}

// TestMetricsBacklog: on Postgres, /metrics carries the ledger's backlog, and it is 0 once
// everything is settled; the Redis command counter names each script call by its script, the
// worker's settle included (what make bench divides by the requests).
func TestMetricsBacklog(t *testing.T) {
	t.Parallel()
	p := startTestProxy(t, true)
	key := p.setup("acme", 1000, 65)
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); st != http.StatusOK {
		t.Fatalf("request: %d %s", st, b)
	}
	p.settled("acme")
	_, _, m := p.do("GET", "/metrics", "", nil)
	for _, want := range []string{"\nescrow_worker_pending_events 0\n", "\nescrow_worker_unsettled_entries 0\n"} {
		if !strings.Contains(string(m), want) {
			t.Fatalf("metrics lack %q:\n%s", strings.TrimSpace(want), grepLines(string(m), "escrow_worker"))
		}
	}
	lines := grepLines(string(m), "escrow_redis_commands_total{")
	for _, script := range []string{"reserve", "finish", "settle"} {
		if !strings.Contains(lines, `command="evalsha:`+script+`"`) {
			t.Errorf("no %s script calls counted:\n%s", script, lines)
		}
	}
	if strings.Contains(lines, `command="evalsha"`) {
		t.Errorf("a script call counted without its name:\n%s", lines)
	}
}

// TestMetricsSpend: the spend counter by model adds up to what the ledger charged, and a
// request for a model nobody priced leaves no label behind (the client chooses that string).
func TestMetricsSpend(t *testing.T) {
	t.Parallel()
	p := startTestProxy(t, false)
	key := p.setup("acme", 10_000, 65)
	for _, q := range []string{"hi", "hello there"} {
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat(q)); st != http.StatusOK {
			t.Fatalf("request: %d %s", st, b)
		}
	}
	if st, _, _ := p.do("POST", "/v1/chat/completions", key, map[string]any{"model": "made-up-model", "messages": []map[string]string{{"role": "user", "content": "x"}}}); st != http.StatusNotFound {
		t.Fatalf("unpriced model: %d", st)
	}
	b := p.settled("acme")
	_, _, m := p.do("GET", "/metrics", "", nil)
	want := fmt.Sprintf("\nescrow_spend_microunits_total{model=\"m\",outcome=\"recorded\"} %d\n", 10_000-b.LedgerBalance)
	if !strings.Contains(string(m), want) || strings.Contains(string(m), "made-up-model") {
		t.Fatalf("metrics: want %q and no made-up-model:\n%s", strings.TrimSpace(want), grepLines(string(m), "escrow_"))
	}
	if !strings.Contains(string(m), "escrow_tokens_total{kind=\"completion\",model=\"m\"}") {
		t.Fatalf("no token counter:\n%s", grepLines(string(m), "escrow_tokens"))
	}
}
