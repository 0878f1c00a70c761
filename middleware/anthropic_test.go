package middleware

import (
	"bytes"
	"context"
	"encoding/json"
	"github.com/llmescrow/escrow/endpoint"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

func TestParseMessages(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name     string
		body     string
		plain    bool
		cap      int64
		stream   bool
		features []string
	}{
		{"text", `{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`, true, 100, false, nil},
		{"blocks and system", `{"model":"claude-x","max_tokens":5,"stream":true,"system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],
			"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral","ttl":"5m"}}]}]}`, true, 5, true, nil},
		{"thinking is output", `{"model":"m","max_tokens":2000,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[]}`, true, 2000, false, nil},
		{"image", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"http://x"}}]}]}`, true, 1, false, nil}, // the image rule (issue 32)
		{"file image", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"file","file_id":"f"}}]}]}`, false, 1, false, nil},
		{"document", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"url","url":"http://x"}}]}]}`, false, 1, false, nil},
		{"client tools", `{"model":"m","max_tokens":1,"tools":[{"name":"f","input_schema":{}},{"type":"bash_20250124","name":"bash"},{"type":"custom","name":"g"}],"messages":[]}`, true, 1, false, nil}, // bytes + overhead
		{"server tools", `{"model":"m","max_tokens":1,"tools":[{"type":"web_search_20250305","name":"web_search"},{"type":"code_execution_20250825","name":"code_execution"}],"messages":[]}`,
			false, 1, false, []string{"tool:web_search_20250305", "tool:code_execution_20250825"}},
		{"mcp servers", `{"model":"m","max_tokens":1,"mcp_servers":[{"type":"url","url":"https://x","name":"x"}],"messages":[]}`, false, 1, false, []string{"mcp_servers"}},
		{"no mcp servers", `{"model":"m","max_tokens":1,"mcp_servers":[],"messages":[]}`, false, 1, false, nil},
		{"container", `{"model":"m","max_tokens":1,"container":"c1","messages":[]}`, false, 1, false, []string{"container"}},
		// The 1-hour cache is priced (Prices.Prices[pricing.CacheWrite1h]); another lifetime is not.
		{"1h cache", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"1h"}}]}]}]}`,
			true, 1, false, nil},
		{"1h cache on a tool", `{"model":"m","max_tokens":1,"tools":[{"name":"f","input_schema":{},"cache_control":{"type":"ephemeral","ttl":"1h"}}],"messages":[]}`,
			true, 1, false, nil},
		{"24h cache", `{"model":"m","max_tokens":1,"system":[{"type":"text","text":"x","cache_control":{"type":"ephemeral","ttl":"24h"}}],"messages":[]}`,
			true, 1, false, []string{"cache_ttl:24h"}},
		{"priority speed geo", `{"model":"m","max_tokens":1,"speed":"fast","inference_geo":"us","service_tier":"auto","messages":[]}`,
			false, 1, false, []string{"speed:fast", "inference_geo:us"}},
		{"unknown field", `{"model":"m","max_tokens":1,"future":{"x":1},"messages":[]}`, false, 1, false, nil},
	}
	for _, c := range cases {
		r, e := parseMessages(specMessages, []byte(c.body))
		if e != nil {
			t.Fatalf("%s: %v", c.name, e)
		}
		if r.Spec != endpoint.Messages || r.Bounded != c.plain || r.OutputCap != c.cap || r.Stream != c.stream || r.N != 1 ||
			!slices.Equal(r.Features, c.features) || r.Size != len(c.body) {
			t.Errorf("%s: %+v", c.name, r)
		}
	}
}

// TestParseMessagesRefusals: a missing max_tokens and every key an upstream could read as a
// priced field but escrow would not (case, folding, duplicates) at each depth escrow prices.
func TestParseMessagesRefusals(t *testing.T) {
	t.Parallel()
	cases := []struct{ body, param string }{
		{`{"model":"m","messages":[]}`, "max_tokens"},
		{`{"max_tokens":1,"messages":[]}`, "model"},
		{`{"model":"m","max_tokens":0,"messages":[]}`, "max_tokens"},
		{`{"model":"m","max_tokens":1.5,"messages":[]}`, "max_tokens"},
		{`{"model":"m","max_tokens":1,"Max_Tokens":100000,"messages":[]}`, "Max_Tokens"},
		{`{"model":"m","max_tokens":1,"max_tokens":100000,"messages":[]}`, "max_tokens"},
		{`{"model":"m","Model":"n","max_tokens":1}`, "Model"},
		{`{"model":"m","max_tokens":1,"mcpServers":[{"url":"x"}]}`, "mcpServers"},
		{`{"model":"m","max_tokens":1,"tools":[{"name":"x","Type":"web_search_20250305"}]}`, "tools[0].Type"},
		{`{"model":"m","max_tokens":1,"tools":[{"type":"custom","type":"web_search_20250305"}]}`, "tools[0].type"},
		{`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","cache_control":{"type":"ephemeral","TTL":"1h"}}]}]}`,
			"messages[0].content[0].cache_control.TTL"},
		{`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"text","typ\u0065":"image"}]}]}]}`,
			"messages[0].content[0].content[0].type"},
		{`{"model":"m","max_tokens":1,"system":[{"type":"text","cache_control":{"type":"ephemeral"},"cache-control":{"ttl":"1h"}}]}`,
			"system[0].cache-control"},
		{`{"model":"m","max_tokens":1,"messages":[{"role":"user","Content":"x"}]}`, "messages[0].Content"},
		{`{"model":"m","max_tokens":1,"ſpeed":"fast"}`, "ſpeed"},
	}
	for _, c := range cases {
		_, e := parseMessages(specMessages, []byte(c.body))
		if e == nil || e.Status != http.StatusBadRequest || e.Param != c.param {
			t.Errorf("%s: got %+v, want a 400 on %q", c.body, e, c.param)
		}
	}
	if _, e := parseMessages(specMessages, []byte(`[1]`)); e == nil || e.Code != CodeInvalidJSON {
		t.Errorf("not an object: %+v", e)
	}
}

// TestAnthropicErrorShape: refusals on the Messages routes are in Anthropic's shape, typed by
// status, and an insufficient balance is a 402 billing_error that @anthropic-ai/sdk does not
// retry (x-should-retry: false; 402 is none of 408, 409, 429, 5xx).
func TestAnthropicErrorShape(t *testing.T) {
	t.Parallel()
	ins := (&Error{Status: 429, Type: TypeInsufficientQuota, Code: CodeInsufficientQuota, NoRetry: true, Message: "no money"}).forAnthropic()
	if ins.Status != http.StatusPaymentRequired || ins.Type != AnthropicBilling || !ins.NoRetry {
		t.Fatalf("insufficient balance: %+v", ins)
	}
	var body struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(ins.Body(), &body); err != nil || body.Type != "error" || body.Error.Type != AnthropicBilling ||
		!strings.Contains(body.Error.Message, "credit balance is too low") {
		t.Fatalf("body %s: %+v %v", ins.Body(), body, err)
	}
	rec := httptest.NewRecorder()
	_ = WriteError(echo.New().NewContext(httptest.NewRequest("POST", "/", nil), rec), ins)
	if rec.Code != 402 || rec.Header().Get("x-should-retry") != "false" {
		t.Fatalf("written: %d %v", rec.Code, rec.Header())
	}
	for status, typ := range map[int]string{400: AnthropicInvalidRequest, 401: AnthropicAuthentication, 403: AnthropicPermission,
		404: AnthropicNotFound, 405: AnthropicInvalidRequest, 413: AnthropicTooLarge, 429: AnthropicRateLimit, 500: AnthropicAPI,
		503: AnthropicOverloaded} {
		e := (&Error{Status: status, Type: TypeInvalidRequest, Code: "x", Message: "m"}).forAnthropic()
		if e.Status != status || e.Type != typ {
			t.Errorf("status %d: %d %s, want %s", status, e.Status, e.Type, typ)
		}
	}
	// A 429 that is not about the balance (too many in flight) stays a retryable 429.
	if e := (&Error{Status: 429, Code: CodeRateLimit, RetryAfter: 1}).forAnthropic(); e.Status != 429 || e.NoRetry {
		t.Errorf("rate limit: %+v", e)
	}
}

const anthStream = "event: message_start\n" +
	`data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-x","usage":{"input_tokens":12,"cache_creation_input_tokens":300,"cache_read_input_tokens":4000,"output_tokens":1}}}` + "\n\n" +
	"event: ping\ndata: {\"type\":\"ping\"}\n\n" +
	"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n" +
	"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n" +
	"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n" +
	"event: message_delta\n" + `data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":42}}` + "\n\n" +
	"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"

func runAnthSSE(stream string, step, maxEvent int) (seen, tail string, f *sseFilter) {
	var out bytes.Buffer
	f = &sseFilter{anthropic: true, maxEvent: maxEvent, emit: func(b []byte) { out.Write(b) }}
	b := []byte(stream)
	for len(b) > 0 {
		n := min(step, len(b))
		f.Write(b[:n])
		b = b[n:]
	}
	f.finish()
	return out.String(), string(f.release()), f
}

// TestSSEAnthropic: usage is message_start's input counts with message_delta's cumulative
// output over them, in writes of any size and with events too long to keep whole;
// message_stop is held back; the stream passes unchanged.
func TestSSEAnthropic(t *testing.T) {
	t.Parallel()
	want := pricing.Usage{Prompt: 4312, Completion: 42, Units: pricing.Units{pricing.CachedInput: 4000, pricing.CacheWrite: 300}}
	for _, maxEvent := range []int{1 << 20, 64} {
		for _, step := range []int{len(anthStream), 1, 3, 17} {
			seen, tail, f := runAnthSSE(anthStream, step, maxEvent)
			if !f.haveUsage || !f.usage.Equal(want) {
				t.Fatalf("max %d step %d: usage %+v %v", maxEvent, step, f.usage, f.haveUsage)
			}
			if seen+tail != anthStream {
				t.Fatalf("max %d step %d: stream changed:\n%q", maxEvent, step, seen+tail)
			}
			if strings.Contains(seen, "message_stop") || !strings.Contains(tail, "message_stop") {
				t.Fatalf("max %d step %d: message_stop not held back: tail %q", maxEvent, step, tail)
			}
			if maxEvent > 64 && (f.outChunks != 1 || f.outBytes != 5) {
				t.Fatalf("step %d: output counted %d chunks %d bytes", step, f.outChunks, f.outBytes)
			}
		}
	}
	// message_delta's counts win over message_start's (newer API versions repeat the input
	// counts there); the last message_delta wins.
	s := strings.Replace(anthStream, `"usage":{"output_tokens":42}`,
		`"usage":{"input_tokens":13,"cache_read_input_tokens":4001,"output_tokens":40}}`+"\n\n"+
			`event: message_delta`+"\n"+`data: {"type":"message_delta","usage":{"output_tokens":43}`, 1)
	_, _, f := runAnthSSE(s, 5, 1<<20)
	if u := (pricing.Usage{Prompt: 13 + 300 + 4001, Completion: 43, Units: pricing.Units{pricing.CachedInput: 4001, pricing.CacheWrite: 300}}); !f.haveUsage || !f.usage.Equal(u) {
		t.Fatalf("merged usage %+v %v, want %+v", f.usage, f.haveUsage, u)
	}
	// Without a message_delta the usage is not complete (message_start's output is 1): none.
	cut := anthStream[:strings.Index(anthStream, "event: message_delta")]
	if _, _, f := runAnthSSE(cut, 7, 1<<20); f.haveUsage {
		t.Fatalf("usage from message_start alone: %+v", f.usage)
	}
	// Case-variant and duplicate keys are read as a client's decoder reads them.
	v := strings.Replace(anthStream, `"usage":{"output_tokens":42}`, `"Usage":{"output_tokens":1,"OUTPUT_TOKENS":44}`, 1)
	if _, _, f := runAnthSSE(v, 9, 1<<20); f.usage.Completion != 44 {
		t.Fatalf("lenient keys: %+v", f.usage)
	}
}

// TestUsageFromAnthropicBody: a Messages JSON body's top-level usage, mapped onto
// pricing.Usage (Prompt = every input token); usage without output_tokens is none.
func TestUsageFromAnthropicBody(t *testing.T) {
	t.Parallel()
	body := `{"id":"msg_1","type":"message","content":[{"type":"text","text":"usage"}],"message":{"usage":{"input_tokens":1}},` +
		`"usage":{"input_tokens":7,"cache_creation_input_tokens":20,"cache_read_input_tokens":300,"output_tokens":9,"service_tier":"standard"}}`
	for _, step := range []int{len(body), 1, 4} {
		s := usageScanner{anthropic: true}
		for b := []byte(body); len(b) > 0; {
			n := min(step, len(b))
			s.Write(b[:n])
			b = b[n:]
		}
		s.finish()
		u, ok := s.usage()
		if want := (pricing.Usage{Prompt: 327, Completion: 9, Units: pricing.Units{pricing.CachedInput: 300, pricing.CacheWrite: 20}}); !ok || !u.Equal(want) {
			t.Fatalf("step %d: %+v %v, want %+v", step, u, ok, want)
		}
	}
	// cache_creation splits the writes by lifetime: the 1-hour ones are priced apart, and its
	// counts are never billed as less than they add up to.
	for _, c := range []struct {
		usage string
		want  pricing.Usage
	}{
		{`{"input_tokens":7,"cache_creation_input_tokens":20,"cache_read_input_tokens":300,"output_tokens":9,` +
			`"cache_creation":{"ephemeral_5m_input_tokens":5,"ephemeral_1h_input_tokens":15}}`,
			pricing.Usage{Prompt: 327, Completion: 9, Units: pricing.Units{pricing.CachedInput: 300, pricing.CacheWrite1h: 15, pricing.CacheWrite: 5}}},
		{`{"input_tokens":7,"cache_creation_input_tokens":20,"output_tokens":9,"Cache_Creation":{"ephemeral_1h_input_tokens":30}}`,
			pricing.Usage{Prompt: 37, Completion: 9, Units: pricing.Units{pricing.CacheWrite1h: 30}}},
		{`{"input_tokens":7,"output_tokens":9,"cache_creation":null}`, pricing.Usage{Prompt: 7, Completion: 9}},
	} {
		s := usageScanner{anthropic: true}
		s.Write([]byte(`{"usage":` + c.usage + `}`))
		s.finish()
		if u, ok := s.usage(); !ok || !u.Equal(c.want) {
			t.Errorf("%s: %+v %v, want %+v", c.usage, u, ok, c.want)
		}
	}
	for _, bad := range []string{`{"usage":{"input_tokens":7}}`, `{"usage":{"input_tokens":7,"output_tokens":-1}}`, `{"usage":{"output_tokens":7}}`,
		`{"usage":{"input_tokens":7,"output_tokens":1,"cache_read_input_tokens":"3"}}`,
		`{"usage":{"input_tokens":7,"output_tokens":1,"cache_creation":{"ephemeral_1h_input_tokens":-1}}}`,
		`{"usage":{"input_tokens":7,"output_tokens":1,"cache_creation":5}}`} {
		s := usageScanner{anthropic: true}
		s.Write([]byte(bad))
		s.finish()
		if u, ok := s.usage(); ok {
			t.Errorf("%s: usage %+v", bad, u)
		}
	}
}

// TestMessagesHold: a plain Messages request is held at its hard bound — body bytes at the
// highest input price (here the 1-hour cache-write one) plus max_tokens at the output price; an
// image in the body adds the image rule's 1,600 tokens (issue 32), and a request whose input the
// body does not bound (a file) keeps the learned max.
func TestMessagesHold(t *testing.T) {
	t.Parallel()
	m := ledger.Model{Name: "claude-x", Prices: pricing.Prices{pricing.Input: 3_000_000, pricing.CacheWrite: 3_750_000, pricing.CachedInput: 300_000, pricing.Output: 15_000_000, pricing.CacheWrite1h: 6_000_000}, MaxInputTokens: 200_000, MaxOutputTokens: 8192}
	body := `{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}`
	r, e := parseMessages(specMessages, []byte(body))
	if e != nil {
		t.Fatal(e)
	}
	hold, err := HoldAmount(context.Background(), HoldInput{Request: r, Model: m, LearnedMax: 500_000, Fallback: 1})
	want := (int64(len(body))*6_000_000 + 100*15_000_000 + 999_999) / 1_000_000
	if err != nil || hold != want {
		t.Fatalf("hold %d %v, want %d", hold, err, want)
	}
	// Priced with input and output only: a 1-hour cache write costs 2× the input price
	// (Prices.WithDefaults), and the bound covers it; the same body on chat/completions cannot
	// write the cache and is bounded at the input price.
	plain := ledger.Model{Name: "claude-x", Prices: pricing.Prices{pricing.Input: 3_000_000, pricing.Output: 15_000_000}, MaxOutputTokens: 8192}
	hold, err = HoldAmount(context.Background(), HoldInput{Request: r, Model: plain, Fallback: 1})
	if want := (int64(len(body))*6_000_000 + 100*15_000_000 + 999_999) / 1_000_000; err != nil || hold != want {
		t.Fatalf("hold without cache prices %d %v, want %d", hold, err, want)
	}
	chat := Request{Spec: endpoint.Chat, Bounded: true, OutputCap: 100, Size: len(body), N: 1}
	hold, err = HoldAmount(context.Background(), HoldInput{Request: chat, Model: plain, Fallback: 1})
	if want := (int64(len(body))*3_000_000 + 100*15_000_000 + 999_999) / 1_000_000; err != nil || hold != want {
		t.Fatalf("chat hold %d %v, want %d", hold, err, want)
	}
	img := `{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}]}`
	r, _ = parseMessages(specMessages, []byte(img))
	r.PartTokens = endpoint.Messages.ImageTokens("", 0) // as the middleware sets it (partTokens)
	hold, err = HoldAmount(context.Background(), HoldInput{Request: r, Model: m, LearnedMax: 500_000, Fallback: 1})
	if want := ((int64(len(img))+1600)*6_000_000 + 100*15_000_000 + 999_999) / 1_000_000; err != nil || hold != want || !r.Bounded || r.ImagesHigh != 1 {
		t.Fatalf("image hold %d %v, want its bound %d", hold, err, want)
	}
	file := `{"model":"claude-x","max_tokens":100,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"file","file_id":"file_1"}}]}]}`
	r, _ = parseMessages(specMessages, []byte(file))
	hold, err = HoldAmount(context.Background(), HoldInput{Request: r, Model: m, LearnedMax: 500_000, Fallback: 1})
	if err != nil || hold != 500_000 {
		t.Fatalf("file image hold %d %v, want the learned max 500000", hold, err)
	}
}
