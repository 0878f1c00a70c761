package server

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestHeaderPolicy: names match case-insensitively, a trailing * is a prefix, and the
// never-list beats any allow pattern, "*" included.
func TestHeaderPolicy(t *testing.T) {
	t.Parallel()
	list, err := parseHeaderList("accept, OpenAI-Beta ,X-Trace-*,*", neverRequestHeaders)
	if err != nil {
		t.Fatal(err)
	}
	p := newHeaderPolicy(alwaysRequestHeaders, list, neverRequestHeaders)
	for name, want := range map[string]bool{
		"Accept": true, "accept": true, "Openai-Beta": true, "X-Trace-Id": true, "x-trace-span": true,
		"Content-Type": true, "X-Custom": true, // "*"
		"Authorization": false, "Cookie": false, "Api-Key": false, "X-Api-Key": false,
		"Openai-Organization": false, "openai-project": false, "X-Escrow-Hold-Id": false, "x-escrow-anything": false,
		"Expect": false, "Connection": false, "Transfer-Encoding": false, "X-Forwarded-For": false, "Forwarded": false,
	} {
		if got := p.allows(name); got != want {
			t.Errorf("allows(%q) = %v, want %v", name, got, want)
		}
	}
	def, _ := parseHeaderList(defaultRequestHeaders, neverRequestHeaders)
	p = newHeaderPolicy(alwaysRequestHeaders, def, neverRequestHeaders)
	h := http.Header{"Content-Type": {"application/json"}, "Accept": {"*/*"}, "User-Agent": {"sdk"}, "Openai-Beta": {"assistants=v2"},
		"Authorization": {"Bearer sk-esc"}, "Idempotency-Key": {"k"}, "X-Stainless-Os": {"Linux"}, "Cookie": {"a=b"}}
	p.filter(h)
	if len(h) != 4 || h.Get("Openai-Beta") == "" || h.Get("User-Agent") == "" || h.Get("Accept") == "" || h.Get("Content-Type") == "" {
		t.Errorf("default request policy kept %v", h)
	}
}

// TestHeaderSettings: the lists are validated when the configuration is loaded; a header that
// must never cross cannot be listed.
func TestHeaderSettings(t *testing.T) {
	t.Parallel()
	load := func(env map[string]string) error {
		_, err := LoadConfig("t", nil, func(k string) string { return env[k] }, io.Discard)
		return err
	}
	for _, bad := range []map[string]string{
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "Accept,Authorization"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "openai-organization"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "X-Escrow-*"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "X-Escrow-Foo*"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "Expect"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "Bad Header"},
		{"ESCROW_UPSTREAM_RESPONSE_HEADERS": "Set-Cookie"},
		{"ESCROW_UPSTREAM_RESPONSE_HEADERS": "server"},
		{"ESCROW_READ_HEADER_TIMEOUT": "2m", "ESCROW_READ_TIMEOUT": "1m"},
		{"ESCROW_WRITE_TIMEOUT": "0s"},
	} {
		if err := load(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("%v: %v, want a configuration error", bad, err)
		}
	}
	for _, good := range []map[string]string{
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "none"},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS": "Accept,Idempotency-Key,X-*"},
		{"ESCROW_UPSTREAM_RESPONSE_HEADERS": "X-Request-Id, x-ratelimit-*"},
		{"ESCROW_READ_TIMEOUT": "5s", "ESCROW_READ_HEADER_TIMEOUT": "5s", "ESCROW_IDLE_TIMEOUT": "1s"},
	} {
		if err := load(good); err != nil {
			t.Errorf("%v: %v", good, err)
		}
	}
	c := DefaultConfig()
	if c.ReadHeaderTimeout != 10e9 || c.ReadTimeout != 60e9 || c.WriteTimeout != 60e9 || c.IdleTimeout != 120e9 ||
		c.UpstreamRequestHeaders != defaultRequestHeaders || !strings.Contains(c.UpstreamResponseHeaders, "X-Ratelimit-*") {
		t.Errorf("defaults: %+v", c)
	}
}
