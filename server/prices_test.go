package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// Issue 23, item 2: prices that cannot give tokens away. A model priced with only its input and
// output prices bills cached tokens and cache writes at the input price and 1-hour cache writes
// at 2× it (pricing.Prices.WithDefaults) — before, at 0 — and a 1-hour cache write is billed
// at the 1-hour price. Each number is the ledger's charge for one request through the whole
// proxy, on real Redis + Postgres and on the embedded parts.

// words is n filler words ("w w w …"): the fake upstreams count one input token per word.
func words(n int) string { return strings.TrimSpace(strings.Repeat("w ", n)) }

// chargedOK sends body to path, expects a 200, and returns the ledger's charge for it (the
// x-request-id's), checking that x-escrow-cost, when sent, says the same.
func (p *testProxy) chargedOK(path, key, body string, hdr map[string]string) int64 {
	p.t.Helper()
	if hdr == nil {
		hdr = map[string]string{}
	}
	if strings.HasPrefix(path, "/v1/messages") {
		hdr["anthropic-version"] = "2023-06-01"
	}
	res, b := p.send(path, key, body, hdr)
	if res.StatusCode != http.StatusOK {
		p.t.Fatalf("%s: %d %.300s", path, res.StatusCode, b)
	}
	id := res.Header.Get("X-Request-Id")
	c := p.charge(id)
	if h := res.Header.Get("X-Escrow-Cost"); h != "" && atoi(p.t, "x-escrow-cost", h) != c {
		p.t.Fatalf("%s: x-escrow-cost %s, ledger %d", path, h, c)
	}
	return c
}

// priceOrg makes an org with funds and a key.
func (p *testProxy) priceOrg(org string, funds int64) string {
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	var k struct{ Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// TestCachedTokensNeverFree: OpenAI chat with 99,000 of 100,000 prompt tokens cached on a model
// priced 0.15 / 0.60 per 1M with no cached price: the cached tokens cost the input price
// (15,006 micro-units, not the 156 of a cached price of 0); the same model with its cached
// price 0.075 costs the 7,581. The admin API shows the price billed.
func TestCachedTokensNeverFree(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startTestProxy(t, real)
			key := p.priceOrg("acme", 100_000_000)
			var m struct {
				Cached int64 `json:"cached_input_price"`
			}
			p.admin("PUT", "/models/mini-plain", map[string]any{"input_price": 150_000, "output_price": 600_000, "max_output_tokens": 16_384},
				http.StatusOK, &m)
			if m.Cached != 150_000 {
				t.Fatalf("PUT answered cached_input_price %d, want the input price", m.Cached)
			}
			p.admin("PUT", "/models/mini-cached", map[string]any{"input_price": 150_000, "cached_input_price": 75_000, "output_price": 600_000,
				"max_output_tokens": 16_384}, http.StatusOK, nil)
			// 99,999 filler words + a marker = 100,000 prompt tokens, 99,000 cached; 10 out.
			prompt := words(99_999) + " [cached:99000]"
			for model, want := range map[string]int64{
				"mini-plain":  1_000*150_000/1_000_000 + 99_000*150_000/1_000_000 + 10*600_000/1_000_000, // 15,006
				"mini-cached": 1_000*150_000/1_000_000 + 99_000*75_000/1_000_000 + 10*600_000/1_000_000,  // 7,581
			} {
				body, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 10, "messages": []map[string]string{{"role": "user", "content": prompt}}})
				if got := p.chargedOK("/v1/chat/completions", key, string(body), nil); got != want {
					t.Errorf("%s: charged %d, want %d", model, got, want)
				}
			}
		})
	}
}

// TestCacheWritesNeverFree: Anthropic Messages writing 100,000 and reading 50,000 cache tokens (4
// uncached input tokens, 10 output) on a model priced like Claude Opus (15 / 75 per 1M) with no
// cache prices: every cache token costs the input price, 2,250,810 micro-units (not the 810 of
// cache prices of 0); with Anthropic's cache prices (18.75 write, 1.50 read) it costs the issue's
// 1,950,810. 1-hour cache writes (cache_control ttl "1h", usage.cache_creation
// .ephemeral_1h_input_tokens) cost 2× the input price without a 1-hour price and that price
// with one, streamed or not; a ttl no price covers is still refused.
func TestCacheWritesNeverFree(t *testing.T) {
	t.Parallel()
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		key := p.priceOrg("acme", 100_000_000)
		p.admin("PUT", "/models/opus-plain", map[string]any{"input_price": 15_000_000, "output_price": 75_000_000, "max_output_tokens": 32_000},
			http.StatusOK, nil)
		p.admin("PUT", "/models/opus-priced", map[string]any{"input_price": 15_000_000, "cache_write_input_price": 18_750_000,
			"cached_input_price": 1_500_000, "cache_write_1h_input_price": 30_000_001, "output_price": 75_000_000, "max_output_tokens": 32_000},
			http.StatusOK, nil)
		msg := func(model, markers, ttl string, stream bool) string {
			cache := `{"type":"ephemeral"}`
			if ttl != "" {
				cache = `{"type":"ephemeral","ttl":"` + ttl + `"}`
			}
			// 150,002 filler words + 2 markers = 150,004 input tokens.
			return `{"model":"` + model + `","max_tokens":10,"stream":` + map[bool]string{true: "true", false: "false"}[stream] +
				`,"messages":[{"role":"user","content":[{"type":"text","text":"` + words(150_002) + " " + markers + `","cache_control":` + cache + `}]}]}`
		}
		const fiveMin, oneHour = "[cache_write:100000] [cached:50000]", "[cache_write_1h:100000] [cached:50000]"
		for _, c := range []struct {
			name, model, markers, ttl string
			want                      int64
		}{
			// 4·15 + 100,000·15 + 50,000·15 + 10·75 = 60 + 1,500,000 + 750,000 + 750
			{"5-minute writes, no cache prices", "opus-plain", fiveMin, "", 2_250_810},
			// 4·15 + 100,000·18.75 + 50,000·1.5 + 10·75 = 60 + 1,875,000 + 75,000 + 750
			{"5-minute writes, Anthropic's cache prices", "opus-priced", fiveMin, "5m", 1_950_810},
			// 4·15 + 100,000·30 + 50,000·15 + 10·75
			{"1-hour writes, no cache prices", "opus-plain", oneHour, "1h", 60 + 3_000_000 + 750_000 + 750},
			// 4·15 + 100,000·30.000001 + 50,000·1.5 + 10·75
			{"1-hour writes, a 1-hour price", "opus-priced", oneHour, "1h", 60 + 3_000_001 + 75_000 + 750},
		} {
			for _, stream := range []bool{false, true} {
				if got := p.chargedOK("/v1/messages", key, msg(c.model, c.markers, c.ttl, stream), nil); got != c.want {
					t.Errorf("%s (stream %v): charged %d, want %d", c.name, stream, got, c.want)
				}
			}
		}
		st, _, b := p.messages("/v1/messages", key, msg("opus-plain", fiveMin, "24h", false))
		if typ, _ := anthErr(t, b); st != http.StatusBadRequest || typ != "invalid_request_error" {
			t.Fatalf("ttl 24h: %d %s", st, b)
		}
	})
}
