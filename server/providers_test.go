package server

import (
	"bufio"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/pricing"
)

const (
	keyOpenAI    = "sk-openai-upstream-3b9e"
	keyAnthropic = "sk-ant-upstream-c41f"
)

// providersProxy is one proxy in front of a fake OpenAI upstream and a fake Anthropic upstream,
// routed by model through a routes file: gpt-t → openai style, claude-t (and claude-alias,
// renamed to claude-t) → anthropic style.
type providersProxy struct {
	anthProxy
	openai, anthropic *fakeupstream.Server
}

func startProvidersProxy(t *testing.T, real bool) providersProxy {
	t.Helper()
	oa := fakeupstream.New(fakeupstream.Options{APIKey: keyOpenAI})
	an := fakeupstream.New(fakeupstream.Options{APIKey: keyAnthropic})
	so, sa := httptest.NewServer(oa), httptest.NewServer(an)
	t.Cleanup(so.Close)
	t.Cleanup(sa.Close)
	routes, _ := json.Marshal(map[string]any{"routes": []map[string]any{
		{"model": "gpt-t", "upstream": so.URL, "api_key": keyOpenAI},
		{"model": "claude-t", "upstream": sa.URL, "api_key": keyAnthropic, "style": "anthropic"},
		{"model": "claude-alias", "upstream": sa.URL, "api_key": keyAnthropic, "style": "anthropic", "rename": "claude-t"},
	}})
	f := filepath.Join(t.TempDir(), "routes.json")
	if err := os.WriteFile(f, routes, 0o600); err != nil {
		t.Fatal(err)
	}
	p := startTestProxy(t, real, func(c *Config) { c.RoutesFile = f })
	return providersProxy{anthProxy{p, an}, oa, an}
}

var gptPrices = pricing.Prices{pricing.Input: 1_500_001, pricing.CachedInput: 750_001, pricing.Output: 6_000_001}

// readAnthStream reads a Messages stream to its end: the usage of message_start with the last
// message_delta's output count.
func readAnthStream(t *testing.T, res *http.Response) anthUsage {
	t.Helper()
	defer res.Body.Close()
	var u anthUsage
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
		switch ev.Type {
		case "message_start":
			u = ev.Message.Usage
		case "message_delta":
			u.Output = ev.Usage.Output
		}
	}
	return u
}

// readChatStream reads a chat completion stream (with include_usage) to its end: its usage.
func readChatStream(t *testing.T, res *http.Response) fakeupstream.ChatUsage {
	t.Helper()
	defer res.Body.Close()
	var u fakeupstream.ChatUsage
	sc := bufio.NewScanner(res.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct{ Usage *fakeupstream.ChatUsage }
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		if ev.Usage != nil {
			u = *ev.Usage
		}
	}
	return u
}

// TestProvidersOneProxy: one proxy fronts a fake OpenAI and a fake Anthropic upstream at once
// (a routes file, one route of each style). Chat completions (JSON and SSE) go to the OpenAI
// one with its key as Authorization: Bearer, Messages (JSON and SSE, cache writes and reads)
// and count_tokens to the Anthropic one with its key as x-api-key, a renamed Claude model under
// its new name; the org is billed exactly, to the micro-unit, the sum of what each upstream
// reported, each request in the ledger at its cost. A model without a route of the endpoint's
// style is a 404 in that endpoint's shape with nothing held; GET /v1/models lists each style's
// models in its shape, with x-api-key on the Anthropic one.
func TestProvidersOneProxy(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startProvidersProxy(t, real)
			const funds = 50_000_000
			key := p.setupClaude("multi", funds)
			p.admin("PUT", "/models/gpt-t", map[string]any{"input_price": gptPrices[pricing.Input], "cached_input_price": gptPrices[pricing.CachedInput],
				"output_price": gptPrices[pricing.Output], "max_input_tokens": 100_000, "max_output_tokens": 1000}, http.StatusOK, nil)
			p.admin("PUT", "/models/claude-alias", map[string]any{"input_price": claudePrices[pricing.Input], "cached_input_price": claudePrices[pricing.CachedInput],
				"cache_write_input_price": claudePrices[pricing.CacheWrite], "output_price": claudePrices[pricing.Output],
				"max_input_tokens": 200_000, "max_output_tokens": 8192}, http.StatusOK, nil)

			var total int64
			var ids []string
			costs := map[string]int64{}
			bill := func(id string, prices pricing.Prices, u pricing.Usage) {
				t.Helper()
				c, err := prices.Cost(u)
				if err != nil || id == "" {
					t.Fatalf("cost of %+v: %v (request id %q)", u, err, id)
				}
				total += c
				ids = append(ids, id)
				costs[id] = c
			}
			chatUsage := func(u fakeupstream.ChatUsage) pricing.Usage {
				return pricing.Usage{Prompt: int64(u.PromptTokens), Completion: int64(u.CompletionTokens), Units: pricing.Units{pricing.CachedInput: int64(u.PromptTokensDetails.CachedTokens)}}
			}

			for i := range 3 {
				// OpenAI style, JSON.
				st, h, b := p.do("POST", "/v1/chat/completions", key, map[string]any{"model": "gpt-t", "max_tokens": 5 + i,
					"messages": []map[string]string{{"role": "user", "content": strings.Repeat("w ", 4+i) + "[cached:2]"}}})
				var r struct{ Usage fakeupstream.ChatUsage }
				if st != 200 || json.Unmarshal(b, &r) != nil || r.Usage.CompletionTokens != 5+i || r.Usage.PromptTokensDetails.CachedTokens != 2 {
					t.Fatalf("chat %d: %d %s", i, st, b)
				}
				bill(h.Get("x-request-id"), gptPrices, chatUsage(r.Usage))

				// OpenAI style, SSE.
				body, _ := json.Marshal(map[string]any{"model": "gpt-t", "max_tokens": 3 + i, "stream": true, "stream_options": map[string]bool{"include_usage": true},
					"messages": []map[string]string{{"role": "user", "content": strings.Repeat("v ", 2+i)}}})
				req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/chat/completions", strings.NewReader(string(body)))
				req.Header.Set("Authorization", "Bearer "+key)
				res, err := http.DefaultClient.Do(req)
				if err != nil || res.StatusCode != 200 {
					t.Fatalf("chat stream %d: %v %v", i, res, err)
				}
				id := res.Header.Get("x-request-id")
				if u := readChatStream(t, res); u.CompletionTokens != 3+i {
					t.Fatalf("chat stream usage %+v", u)
				} else {
					bill(id, gptPrices, chatUsage(u))
				}

				// Anthropic style, JSON (x-api-key), with cache writes and reads.
				model := []string{"claude-t", "claude-alias", "claude-t"}[i]
				mb := strings.Replace(cachedBody, `"claude-t"`, `"`+model+`"`, 1)
				st, h, b = p.messages("/v1/messages", key, mb)
				var msg struct{ Usage anthUsage }
				if st != 200 || json.Unmarshal(b, &msg) != nil || msg.Usage != (anthUsage{Input: 5, CacheWrite: 3, CacheRead: 4, Output: 7}) {
					t.Fatalf("messages %s: %d %s", model, st, b)
				}
				bill(h.Get("x-request-id"), claudePrices, msg.Usage.usage())

				// Anthropic style, SSE.
				stream := strings.Replace(mb, `"max_tokens":7`, `"max_tokens":`+strconv.Itoa(4+i)+`,"stream":true`, 1)
				req, _ = http.NewRequest(http.MethodPost, p.base+"/v1/messages", strings.NewReader(stream))
				req.Header.Set("x-api-key", key)
				req.Header.Set("anthropic-version", "2023-06-01")
				res, err = http.DefaultClient.Do(req)
				if err != nil || res.StatusCode != 200 {
					t.Fatalf("messages stream %d: %v %v", i, res, err)
				}
				id = res.Header.Get("x-request-id")
				if u := readAnthStream(t, res); u != (anthUsage{Input: 5, CacheWrite: 3, CacheRead: 4, Output: int64(4 + i)}) {
					t.Fatalf("messages stream usage %+v", u)
				} else {
					bill(id, claudePrices, u.usage())
				}
			}

			// count_tokens: routed by its model to the Anthropic upstream, unbilled.
			st, _, b := p.messages("/v1/messages/count_tokens", key, `{"model":"claude-alias","messages":[{"role":"user","content":"c d e"}]}`)
			if st != 200 || !strings.Contains(string(b), `"input_tokens":3`) {
				t.Fatalf("count_tokens: %d %s", st, b)
			}

			// No route of the endpoint's style: 404 in the endpoint's shape, nothing held, nothing sent.
			seenO, seenA := p.openai.Requests(), p.anthropic.Requests()
			st, _, b = p.messages("/v1/messages", key, strings.Replace(cachedBody, `"claude-t"`, `"gpt-t"`, 1))
			if typ, msg := anthErr(t, b); st != 404 || typ != "not_found_error" || !strings.Contains(msg, "gpt-t") {
				t.Fatalf("gpt-t on /v1/messages: %d %s", st, b)
			}
			st, _, b = p.messages("/v1/messages/count_tokens", key, `{"model":"gpt-t","messages":[{"role":"user","content":"x"}]}`)
			if typ, _ := anthErr(t, b); st != 404 || typ != "not_found_error" {
				t.Fatalf("gpt-t on count_tokens: %d %s", st, b)
			}
			st, _, b = p.do("POST", "/v1/chat/completions", key, map[string]any{"model": "claude-t", "max_tokens": 1,
				"messages": []map[string]string{{"role": "user", "content": "hi"}}})
			if st != 404 || !strings.Contains(string(b), `"model_not_found"`) {
				t.Fatalf("claude-t on chat completions: %d %s", st, b)
			}
			if p.openai.Requests() != seenO || p.anthropic.Requests() != seenA {
				t.Fatalf("a refused request reached an upstream")
			}

			// The ledger: exactly the sum of what the upstreams reported, request by request.
			if bal := p.settled("multi"); bal.LedgerBalance != funds-total || bal.Available != funds-total || bal.Held != 0 {
				t.Fatalf("balance %+v, want exactly %d (Σ costs %d)", bal, funds-total, total)
			}
			var sum int64
			for _, id := range ids {
				r, err := p.app.ledger.Request(t.Context(), id)
				if err != nil || r.Cost != costs[id] || r.Estimated {
					t.Fatalf("request %s: %+v %v, want cost %d", id, r, err, costs[id])
				}
				sum += r.Cost
			}
			if sum != total || len(ids) != 12 {
				t.Fatalf("ledger Σ %d over %d requests, want %d", sum, len(ids), total)
			}

			// Each upstream got only its own requests, with its own key in its style's header.
			for _, r := range p.openai.Seen() {
				if r.Path != "/v1/chat/completions" || r.Model != "gpt-t" || r.Authorization != "Bearer "+keyOpenAI || r.Header.Get("X-Api-Key") != "" {
					t.Errorf("OpenAI upstream got %s %q auth %q x-api-key %q", r.Path, r.Model, r.Authorization, r.Header.Get("X-Api-Key"))
				}
			}
			renamed := 0
			for _, r := range p.anthropic.Seen() {
				if !strings.HasPrefix(r.Path, "/v1/messages") || r.Model != "claude-t" || r.Authorization != "" || r.Header.Get("X-Api-Key") != keyAnthropic {
					t.Errorf("Anthropic upstream got %s %q auth %q x-api-key %q", r.Path, r.Model, r.Authorization, r.Header.Get("X-Api-Key"))
				}
				if strings.Contains(string(r.Body), `"claude-alias"`) {
					renamed++
				}
			}
			if n := len(p.openai.Seen()); n != 6 {
				t.Errorf("OpenAI upstream got %d requests, want 6", n)
			}
			if n := len(p.anthropic.Seen()); n != 7 || renamed != 0 {
				t.Errorf("Anthropic upstream got %d requests (%d under the alias), want 7 (0)", n, renamed)
			}

			// GET /v1/models: OpenAI's shape with Bearer; Anthropic's with x-api-key and anthropic-version.
			st, _, b = p.do("GET", "/v1/models", key, nil)
			var ol struct{ Data []struct{ ID string } }
			if st != 200 || json.Unmarshal(b, &ol) != nil || len(ol.Data) != 1 || ol.Data[0].ID != "gpt-t" {
				t.Fatalf("OpenAI model list: %d %s", st, b)
			}
			req, _ := http.NewRequest(http.MethodGet, p.base+"/v1/models", nil)
			req.Header.Set("x-api-key", key)
			req.Header.Set("anthropic-version", "2023-06-01")
			res, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var al struct {
				Data []struct{ Type, ID string }
			}
			err = json.NewDecoder(res.Body).Decode(&al)
			res.Body.Close()
			if res.StatusCode != 200 || err != nil || len(al.Data) != 2 || al.Data[0].ID != "claude-alias" || al.Data[1].ID != "claude-t" || al.Data[0].Type != "model" {
				t.Fatalf("Anthropic model list: %d %+v %v", res.StatusCode, al, err)
			}
			req, _ = http.NewRequest(http.MethodGet, p.base+"/v1/models/claude-t", nil)
			req.Header.Set("x-api-key", "sk-nope")
			req.Header.Set("anthropic-version", "2023-06-01")
			if res, err := http.DefaultClient.Do(req); err != nil || res.StatusCode != 401 {
				t.Fatalf("unknown x-api-key on /v1/models: %v %v", res, err)
			} else {
				res.Body.Close()
			}
			if bal := p.settled("multi"); bal.LedgerBalance != funds-total {
				t.Fatalf("after the listing: %+v", bal)
			}
		})
	}
}
