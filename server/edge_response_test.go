package server

import (
	"bufio"
	"bytes"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// edgeModel is priced like gpt-4o-mini (micro-units per million tokens) with 16,384 output
// tokens allowed.
var edgePrices = pricing.Prices{pricing.Input: 150_000, pricing.CachedInput: 75_000, pricing.Output: 600_000}

// clientUsage is the usage a client reads from a JSON body or an event stream (the last usage
// object of a chat chunk, or response.completed's response.usage).
func clientUsage(t *testing.T, body []byte) (pricing.Usage, bool) {
	t.Helper()
	read := func(u gjson.Result) (pricing.Usage, bool) {
		if !u.IsObject() {
			return pricing.Usage{}, false
		}
		first := func(a, b string) int64 {
			if v := u.Get(a); v.Exists() {
				return v.Int()
			}
			return u.Get(b).Int()
		}
		return pricing.Usage{Prompt: first("prompt_tokens", "input_tokens"), Completion: first("completion_tokens", "output_tokens"), Reasoning: first("completion_tokens_details.reasoning_tokens", "output_tokens_details.reasoning_tokens"), Units: pricing.Units{pricing.CachedInput: first("prompt_tokens_details.cached_tokens", "input_tokens_details.cached_tokens")}}, true
	}
	if gjson.ValidBytes(body) {
		return read(gjson.GetBytes(body, "usage"))
	}
	var u pricing.Usage
	found := false
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(nil, 64<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		v := gjson.Parse(data)
		if v.Get("type").Str == "response.completed" {
			u, found = read(v.Get("response.usage"))
		} else if uu, ok := read(v.Get("usage")); ok {
			u, found = uu, true
		}
	}
	return u, found
}

// TestEdgeResponse (issue 10, item 1) over the whole proxy, on every backend: responses of any
// size and compressed ones are billed the usage the client sees, to the micro-unit; a 2xx whose
// usage cannot be read is charged its hold. Each request runs alone and the org settles after
// it, so the ledger's move is that request's charge.
func TestEdgeResponse(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		p.admin("PUT", "/models/gpt-4o-mini", map[string]any{"input_price": edgePrices[pricing.Input], "cached_input_price": edgePrices[pricing.CachedInput],
			"output_price": edgePrices[pricing.Output], "max_input_tokens": 128_000, "max_output_tokens": 16_384, "max_cost": 0, "default_hold": 5000}, http.StatusOK, nil)
		p.admin("POST", "/orgs", map[string]string{"id": "edge"}, http.StatusCreated, nil)
		p.admin("POST", "/orgs/edge/credits", map[string]any{"amount": 5_000_000, "reference": "init-edge"}, http.StatusCreated, nil)
		var k struct{ Key string }
		p.admin("POST", "/orgs/edge/keys", nil, http.StatusCreated, &k)
		msg := func(s string) string { return `"messages":[{"role":"user","content":"` + s + `"}]` }

		// First, alone on a fresh org: an unknown coding — its usage cannot be read, so the hold
		// is charged (the client's x-escrow-cost says so, as a trailer: the header left before
		// the end of a body escrow cannot read).
		before := p.settled("edge").LedgerBalance
		resp, body := p.send("/v1/chat/completions", k.Key, `{"model":"gpt-4o-mini",`+msg("[encoding:zstd] hello")+`,"max_tokens":100}`, nil)
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Encoding") != "zstd" || len(body) == 0 {
			t.Fatalf("unknown coding: %d %q %d bytes", resp.StatusCode, resp.Header.Get("Content-Encoding"), len(body))
		}
		hold, err := strconv.ParseInt(resp.Trailer.Get("X-Escrow-Cost"), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		var req struct {
			HoldAmount int64 `json:"hold_amount"`
			Estimated  bool  `json:"estimated"`
		}
		p.admin("GET", "/requests/"+resp.Header.Get("X-Request-Id"), nil, http.StatusOK, &req)
		if b := p.settled("edge"); hold <= 0 || hold != req.HoldAmount || !req.Estimated || b.LedgerBalance != before-hold {
			t.Fatalf("unreadable reply: ledger %d, want %d − hold %d (%+v)", b.LedgerBalance, before, hold, req)
		}

		for _, tc := range []struct{ name, path, body string }{
			{"n64 8.7 MB", "/v1/chat/completions", `{"model":"gpt-4o-mini",` + msg("write") + `,"n":64,"max_tokens":16384}`},
			{"logprobs", "/v1/chat/completions", `{"model":"gpt-4o-mini",` + msg("write") + `,"logprobs":true,"top_logprobs":20,"max_tokens":8192}`},
			{"gzip json", "/v1/chat/completions", `{"model":"gpt-4o-mini",` + msg("[encoding:gzip] [cached:1] hi there") + `,"max_tokens":50}`},
			{"br sse", "/v1/chat/completions", `{"model":"gpt-4o-mini",` + msg("[encoding:br] [reasoning:4] hi") + `,"max_tokens":50,"stream":true,"stream_options":{"include_usage":true}}`},
			{"deflate responses sse", "/v1/responses", `{"model":"gpt-4o-mini","input":"[encoding:deflate] [cached:2] hi you","max_output_tokens":60,"stream":true}`},
			{"giant response.completed", "/v1/responses", `{"model":"gpt-4o-mini","input":"story","max_output_tokens":4096,"stream":true,` +
				`"include":["message.output_text.logprobs"],"top_logprobs":20}`},
		} {
			before := p.settled("edge").LedgerBalance
			st, h, body := p.do("POST", tc.path, k.Key, tc.body)
			if st != http.StatusOK || h.Get("Content-Encoding") != "" {
				t.Fatalf("%s: %d %q %.200s", tc.name, st, h.Get("Content-Encoding"), body)
			}
			u, ok := clientUsage(t, body)
			if !ok || u.Completion == 0 {
				t.Fatalf("%s: no usage visible in %d bytes", tc.name, len(body))
			}
			want, err := edgePrices.Cost(u)
			if err != nil {
				t.Fatal(err)
			}
			if b := p.settled("edge"); b.LedgerBalance != before-want {
				t.Fatalf("%s: charged %d, the client saw usage %+v costing %d", tc.name, before-b.LedgerBalance, u, want)
			}
			t.Logf("%s: %d bytes, usage %+v, charged %d", tc.name, len(body), u, want)
		}
	})
}
