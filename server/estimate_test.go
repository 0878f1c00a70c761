package server

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestReadOnConfigured: ESCROW_READ_ON sets how long the upstream is read on after a client
// hangs up (default 2m), and the proxy uses it: a stream that sends one chunk and then goes
// silent, whose client hangs up, is cut at that bound and charged an estimate — its hold, as
// the request is bounded (plain text with max_tokens) — marked estimated.
func TestReadOnConfigured(t *testing.T) {
	t.Parallel()
	if c, err := LoadConfig("t", nil, func(string) string { return "" }, io.Discard); err != nil || c.ReadOn != 2*time.Minute {
		t.Fatalf("default read-on %v (%v), want 2m", c.ReadOn, err)
	}
	env := map[string]string{"ESCROW_READ_ON": "150ms"}
	c, err := LoadConfig("t", nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || c.ReadOn != 150*time.Millisecond {
		t.Fatalf("ESCROW_READ_ON=150ms: %v (%v)", c.ReadOn, err)
	}
	bothModes(t, func(t *testing.T, real bool) {
		p := startTestProxy(t, real, func(c *Config) { c.ReadOn = 150 * time.Millisecond })
		key := p.setup("readon", 1_000_000, 1000)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		body := `{"model":"m","stream":true,"max_tokens":50,"messages":[{"role":"user","content":"[hang]"}]}`
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.base+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		id := res.Header.Get("x-request-id")
		if line, err := bufio.NewReader(res.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
			t.Fatalf("first line %q %v", line, err)
		}
		cancel() // the client hangs up; the upstream stays silent until escrow cuts it
		res.Body.Close()
		// The hold: 50 output tokens at 1 micro-unit (input is free on model m).
		if b := p.settled("readon"); b.LedgerBalance != 1_000_000-50 {
			t.Fatalf("after the hang-up: %+v, want the hold (50) charged", b)
		}
		r, err := p.app.ledger.Request(context.Background(), id)
		if err != nil || !r.Estimated || r.Cost != 50 || r.HoldAmount != 50 {
			t.Fatalf("request %+v %v", r, err)
		}
	})
}
