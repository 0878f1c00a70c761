package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/pricing"
)

const anthUpstreamKey = "sk-ant-upstream-secret"

// anthProxy is a proxy whose Messages API routes go to a fake Anthropic upstream that requires
// the upstream key as x-api-key.
type anthProxy struct {
	*testProxy
	fake *fakeupstream.Server
}

// eachAnthropicMode runs fn on real Redis + Postgres and on the embedded parts, each proxy
// with ESCROW_ANTHROPIC_URL pointing at its own fake Anthropic upstream.
func eachAnthropicMode(t *testing.T, fn func(t *testing.T, p anthProxy)) {
	for _, real := range []bool{true, false} {
		name := map[bool]string{true: "real", false: "embedded"}[real]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			fake := fakeupstream.New(fakeupstream.Options{APIKey: anthUpstreamKey})
			up := httptest.NewServer(fake)
			t.Cleanup(up.Close)
			p := startTestProxy(t, real, func(c *Config) { c.AnthropicURL, c.AnthropicAPIKey = up.URL, anthUpstreamKey })
			fn(t, anthProxy{p, fake})
		})
	}
}

// claudePrices: per 1M tokens 3.000001 input, 3.750001 cache write, 0.300001 cache read,
// 15.000001 output (micro-units), so that every count moves the exact cost.
var claudePrices = pricing.Prices{pricing.Input: 3_000_001, pricing.CacheWrite: 3_750_001, pricing.CachedInput: 300_001, pricing.Output: 15_000_001}

// setupClaude prices "claude-t" and makes an org with funds and a key.
func (p anthProxy) setupClaude(org string, funds int64) string {
	p.admin("PUT", "/models/claude-t", map[string]any{"input_price": claudePrices[pricing.Input], "cached_input_price": claudePrices[pricing.CachedInput],
		"cache_write_input_price": claudePrices[pricing.CacheWrite], "output_price": claudePrices[pricing.Output],
		"max_input_tokens": 200_000, "max_output_tokens": 8192}, http.StatusOK, nil)
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	if funds > 0 {
		p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	}
	var k struct{ Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// messages posts to a Messages API route as the Anthropic SDK does (x-api-key,
// anthropic-version); extra headers are name, value pairs.
func (p anthProxy) messages(path, key, body string, hdr ...string) (int, http.Header, []byte) {
	p.t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.base+path, strings.NewReader(body))
	if err != nil {
		p.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("anthropic-version", "2023-06-01")
	if key != "" {
		req.Header.Set("x-api-key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		p.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, b
}

// anthErr decodes an error in Anthropic's shape; it fails unless the body is one.
func anthErr(t *testing.T, b []byte) (typ, msg string) {
	t.Helper()
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Type != "error" || e.Error.Type == "" || e.Error.Message == "" {
		t.Fatalf("not an Anthropic error: %s (%v)", b, err)
	}
	return e.Error.Type, e.Error.Message
}

type anthUsage struct {
	Input      int64 `json:"input_tokens"`
	CacheWrite int64 `json:"cache_creation_input_tokens"`
	CacheRead  int64 `json:"cache_read_input_tokens"`
	Output     int64 `json:"output_tokens"`
}

func (u anthUsage) usage() pricing.Usage {
	return pricing.Usage{Prompt: u.Input + u.CacheWrite + u.CacheRead, Completion: u.Output, Units: pricing.Units{pricing.CachedInput: u.CacheRead, pricing.CacheWrite: u.CacheWrite}}
}

// cachedBody: 2 system words + 10 user words (markers included) = 12 input tokens, of which
// the fake writes 3 to the cache and reads 4; 7 output tokens.
const cachedBody = `{"model":"claude-t","max_tokens":7,"system":"be brief","messages":[{"role":"user","content":[` +
	`{"type":"text","text":"alpha beta gamma delta epsilon zeta eta theta [cache_write:3] [cached:4]","cache_control":{"type":"ephemeral"}}]}]}`

// (5·3.000001 + 3·3.750001 + 4·0.300001 + 7·15.000001) = 132.450019 → 133 micro-units.
const cachedCost = 133

// TestAnthropicMessagesBilledExactly: a JSON and a streamed Messages request with cache writes
// and reads are billed to the micro-unit what the client's usage says at the model's prices;
// the ledger keeps the cache counts; the upstream gets the upstream key as x-api-key, never the
// client's, and the anthropic-version / anthropic-beta headers.
func TestAnthropicMessagesBilledExactly(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		key := p.setupClaude("anth", 10_000_000)
		st, h, b := p.messages("/v1/messages", key, cachedBody, "anthropic-beta", "prompt-caching-2024-07-31")
		if st != 200 {
			t.Fatalf("JSON: %d %s", st, b)
		}
		var msg struct {
			Type  string    `json:"type"`
			Usage anthUsage `json:"usage"`
		}
		if err := json.Unmarshal(b, &msg); err != nil || msg.Type != "message" {
			t.Fatalf("JSON reply %s: %v", b, err)
		}
		if msg.Usage != (anthUsage{Input: 5, CacheWrite: 3, CacheRead: 4, Output: 7}) {
			t.Fatalf("usage %+v", msg.Usage)
		}
		if c, err := claudePrices.Cost(msg.Usage.usage()); err != nil || c != cachedCost {
			t.Fatalf("cost of %+v = %d %v, want %d", msg.Usage, c, err, cachedCost)
		}
		ids := []string{h.Get("x-request-id")}
		seen, _ := p.fake.LastRequest()
		if seen.Header.Get("X-Api-Key") != anthUpstreamKey || seen.Header.Get("Authorization") != "" ||
			seen.Header.Get("Anthropic-Version") != "2023-06-01" || seen.Header.Get("Anthropic-Beta") != "prompt-caching-2024-07-31" {
			t.Fatalf("upstream headers: %v", seen.Header)
		}

		// The same request streamed; the client also authenticates with Authorization: Bearer.
		stream := strings.Replace(cachedBody, `"max_tokens":7`, `"max_tokens":7,"stream":true`, 1)
		req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/messages", strings.NewReader(stream))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("anthropic-version", "2023-06-01")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var u anthUsage
		events := map[string]int{}
		sc := bufio.NewScanner(res.Body)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			var ev struct {
				Type    string                     `json:"type"`
				Message *struct{ Usage anthUsage } `json:"message"`
				Usage   *anthUsage                 `json:"usage"`
			}
			if err := json.Unmarshal([]byte(data), &ev); err != nil {
				t.Fatalf("event %s: %v", data, err)
			}
			events[ev.Type]++
			switch ev.Type {
			case "message_start":
				u = ev.Message.Usage
			case "message_delta":
				u.Output = ev.Usage.Output // cumulative: the last one counts
			}
		}
		res.Body.Close()
		if res.StatusCode != 200 || events["message_start"] != 1 || events["message_delta"] != 1 || events["message_stop"] != 1 ||
			events["content_block_delta"] != 7 {
			t.Fatalf("stream %d: events %v", res.StatusCode, events)
		}
		if u != (anthUsage{Input: 5, CacheWrite: 3, CacheRead: 4, Output: 7}) {
			t.Fatalf("stream usage %+v", u)
		}
		ids = append(ids, res.Header.Get("x-request-id"))

		b2 := p.settled("anth")
		if b2.LedgerBalance != 10_000_000-2*cachedCost {
			t.Fatalf("balance %d, want %d", b2.LedgerBalance, 10_000_000-2*cachedCost)
		}
		for _, id := range ids {
			r, err := p.app.ledger.Request(context.Background(), id)
			if err != nil || r.Cost != cachedCost || !r.Usage.Equal(u.usage()) || r.Estimated || r.Endpoint != "/v1/messages" {
				t.Fatalf("request %s: %+v %v", id, r, err)
			}
		}
	})
}

// TestAnthropicRefusals: an insufficient balance is a 402 billing_error with x-should-retry:
// false (not retried by @anthropic-ai/sdk); a missing max_tokens, hostile keys and unpriced
// features are 400s in Anthropic's shape; none of them holds anything or reaches the upstream.
func TestAnthropicRefusals(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		poor := p.setupClaude("poor", 50)
		st, h, b := p.messages("/v1/messages", poor, cachedBody)
		typ, _ := anthErr(t, b)
		if st != http.StatusPaymentRequired || typ != "billing_error" || h.Get("x-should-retry") != "false" || h.Get("Retry-After") != "" {
			t.Fatalf("insufficient balance: %d %v %s", st, h, b)
		}

		key := p.setupClaude("rich", 10_000_000)
		noCap := `{"model":"claude-t","messages":[{"role":"user","content":"hi"}]}`
		st, _, b = p.messages("/v1/messages", key, noCap)
		if typ, msg := anthErr(t, b); st != 400 || typ != "invalid_request_error" || !strings.Contains(msg, "max_tokens") {
			t.Fatalf("missing max_tokens: %d %s", st, b)
		}
		hostile := []struct {
			body string
			hdr  []string
		}{
			{`{"model":"claude-t","max_tokens":1,"Max_tokens":8000,"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"max_tokens":8000,"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"tools":[{"name":"s","TYPE":"web_search_20250305"}],"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"5m","tt\u006c":"1h"}}]}]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"tools":[{"type":"web_search_20250305","name":"web_search","max_uses":5}],"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"mcp_servers":[{"type":"url","url":"https://mcp.example","name":"x"}],"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"system":[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"24h"}}],"messages":[]}`, nil},
			{`{"model":"claude-t","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`, []string{"anthropic-beta", "context-1m-2025-08-07"}},
			{`{"model":"claude-t","max_tokens":9000,"messages":[{"role":"user","content":"hi"}]}`, nil}, // above max_output_tokens
		}
		for _, c := range hostile {
			st, _, b := p.messages("/v1/messages", key, c.body, c.hdr...)
			if typ, _ := anthErr(t, b); st != 400 || typ != "invalid_request_error" {
				t.Fatalf("%s %v: %d %s", c.body, c.hdr, st, b)
			}
		}
		st, _, b = p.messages("/v1/messages", "", cachedBody)
		if typ, _ := anthErr(t, b); st != 401 || typ != "authentication_error" {
			t.Fatalf("no key: %d %s", st, b)
		}
		st, _, b = p.messages("/v1/messages", key, cachedBody, "Authorization", "Bearer "+poor) // Authorization wins
		if typ, _ := anthErr(t, b); st != http.StatusPaymentRequired || typ != "billing_error" {
			t.Fatalf("Authorization and x-api-key: %d %s", st, b)
		}
		if n := p.fake.Requests(); n != 0 {
			t.Fatalf("the upstream got %d requests", n)
		}
		for org, funds := range map[string]int64{"poor": 50, "rich": 10_000_000} {
			if b := p.settled(org); b.LedgerBalance != funds || b.Available != funds || b.Held != 0 {
				t.Fatalf("%s after refusals: %+v", org, b)
			}
		}
	})
}

// TestAnthropicCountTokens: count_tokens is authenticated, passed to the upstream with the
// upstream key, and never billed.
func TestAnthropicCountTokens(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		key := p.setupClaude("ct", 1000)
		body := `{"model":"claude-t","system":"a b","messages":[{"role":"user","content":"c d e"}]}`
		st, _, b := p.messages("/v1/messages/count_tokens", key, body)
		if st != 200 || !bytes.Equal(bytes.TrimSpace(b), []byte(`{"input_tokens":5}`)) {
			t.Fatalf("count_tokens: %d %s", st, b)
		}
		if seen, _ := p.fake.LastRequest(); seen.Path != "/v1/messages/count_tokens" || seen.Header.Get("X-Api-Key") != anthUpstreamKey {
			t.Fatalf("upstream saw %s %v", seen.Path, seen.Header)
		}
		st, _, b = p.messages("/v1/messages/count_tokens", "sk-nope", body)
		if typ, _ := anthErr(t, b); st != 401 || typ != "authentication_error" {
			t.Fatalf("unknown key: %d %s", st, b)
		}
		if n := p.fake.Requests(); n != 1 {
			t.Fatalf("upstream requests %d, want 1", n)
		}
		if bal := p.settled("ct"); bal.LedgerBalance != 1000 || bal.Available != 1000 {
			t.Fatalf("count_tokens billed: %+v", bal)
		}
		if acct, err := p.app.ledger.Account(context.Background(), "ct"); err != nil || acct.LedgerSeq != 1 {
			t.Fatalf("ledger entries beyond the credit: %+v %v", acct, err)
		}
	})
}

// TestAnthropicClientHangsUp: a client that leaves a Messages stream after its first event is
// still billed exactly the usage the upstream reports at the end of the stream (the proxy
// reads on into the void), never the hold and never nothing.
func TestAnthropicClientHangsUp(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		key := p.setupClaude("hang", 10_000_000)
		body := strings.Replace(cachedBody, `"max_tokens":7`, `"max_tokens":7,"stream":true`, 1)
		body = strings.Replace(body, "alpha", "[slow]", 1) // one word every 200 ms; the same counts
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, p.base+"/v1/messages", strings.NewReader(body))
		req.Header.Set("x-api-key", key)
		req.Header.Set("anthropic-version", "2023-06-01")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(res.Body).ReadString('\n')
		if err != nil || line != "event: message_start\n" {
			t.Fatalf("first line %q %v", line, err)
		}
		cancel()
		res.Body.Close()
		if b := p.settled("hang"); b.LedgerBalance != 10_000_000-cachedCost {
			t.Fatalf("after the hang-up: %+v, want the ledger at %d", b, 10_000_000-cachedCost)
		}
	})
}

// TestAnthropicStreamError: a stream the upstream ends with an error event after message_start
// (overloaded_error mid-stream) is billed by the one rule for responses that end without
// readable usage, marked estimated: a bounded request (plain text with max_tokens: its hold is
// its bound) is charged its hold; an unbounded one message_start's exact input counts plus the
// streamed output counted generously — not its hold.
func TestAnthropicStreamError(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		key := p.setupClaude("err", 10_000_000)
		body := strings.Replace(cachedBody, `"max_tokens":7`, `"max_tokens":7,"stream":true`, 1)
		body = strings.Replace(body, "alpha", "[error_after:2]", 1)
		st, h, b := p.messages("/v1/messages", key, body)
		if st != 200 || !strings.Contains(string(b), "event: error") || strings.Contains(string(b), "message_stop") {
			t.Fatalf("stream %d:\n%s", st, b)
		}
		r, err := p.app.ledger.Request(context.Background(), h.Get("x-request-id"))
		if err != nil || !r.Estimated || r.Cost != r.HoldAmount || r.HoldAmount <= 0 {
			t.Fatalf("bounded: request %+v %v, want estimated at its hold", r, err)
		}
		hold := r.HoldAmount
		if bal := p.settled("err"); bal.LedgerBalance != 10_000_000-hold {
			t.Fatalf("balance %+v, want the hold %d charged", bal, hold)
		}

		// A field escrow does not price makes the request unbounded. Input 5 plain + 3 written
		// + 4 read (message_start); output: "tok1" and " tok2" streamed, 9 bytes counted
		// generously as ⌈9/4⌉ = 3 tokens.
		body = strings.Replace(body, `"stream":true`, `"stream":true,"x_unpriced":1`, 1)
		st, h, b = p.messages("/v1/messages", key, body)
		if st != 200 || !strings.Contains(string(b), "event: error") {
			t.Fatalf("stream %d:\n%s", st, b)
		}
		want, _ := claudePrices.Cost(pricing.Usage{Prompt: 12, Completion: 3, Units: pricing.Units{pricing.CachedInput: 4, pricing.CacheWrite: 3}})
		if bal := p.settled("err"); bal.LedgerBalance != 10_000_000-hold-want {
			t.Fatalf("balance %+v, want %d more charged", bal, want)
		}
		r, err = p.app.ledger.Request(context.Background(), h.Get("x-request-id"))
		if err != nil || !r.Estimated || r.Cost != want || r.Cost >= r.HoldAmount || r.Usage.Of(pricing.CacheWrite) != 3 || r.Usage.Of(pricing.CachedInput) != 4 {
			t.Fatalf("unbounded: request %+v %v", r, err)
		}
	})
}
