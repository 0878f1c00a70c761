package middleware

import (
	"bytes"
	"github.com/llmescrow/escrow/endpoint"
	"strconv"
	"strings"
	"testing"

	"github.com/tidwall/gjson"

	"github.com/llmescrow/escrow/pricing"
)

// FuzzMessagesRequest: parseMessages never panics, refuses with a 400 or accepts a valid object
// with a model and a positive max_tokens that is in the body.
func FuzzMessagesRequest(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","max_tokens":5,"stream":true,"system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","max_tokens":1,"tools":[{"type":"web_search_20250305","name":"web_search"}]}`,
		`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","content":[{"type":"text","cache_control":{"ttl":"1h"}}]}]}]}`,
		`{"model":"m","Max_Tokens":2,"max_tokens":1}`, `{"model":"m"}`, `[]`, `{`, "{\"model\":\"m\",\"max_tokens\":1,\"\u017fpeed\":\"fast\"}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		r, e := parseMessages(specMessages, body)
		if e != nil {
			if e.Status != 400 || e.Code == "" || e.forAnthropic().Type != AnthropicInvalidRequest {
				t.Fatalf("bad error %+v", e)
			}
			return
		}
		if !gjson.ValidBytes(body) || r.Model == "" || r.OutputCap < 1 || r.N != 1 || r.Size != len(body) || r.Spec != endpoint.Messages {
			t.Fatalf("accepted %q as %+v", body, r)
		}
		if !bytes.Contains(body, []byte(strconv.FormatInt(r.OutputCap, 10))) {
			t.Fatalf("max_tokens %d not in the body", r.OutputCap)
		}
	})
}

// namesMember reports whether some data payload of the SSE stream (a data line alone, or an
// event's data lines joined) holds, at any depth, a member whose name folds to name as
// encoding/json folds it (escapes decoded, strings.EqualFold).
func namesMember(stream []byte, name string) bool {
	var has func(v gjson.Result) bool
	has = func(v gjson.Result) bool {
		found := false
		v.ForEach(func(k, m gjson.Result) bool {
			found = strings.EqualFold(k.String(), name) || ((m.IsObject() || m.IsArray()) && has(m))
			return !found
		})
		return found
	}
	var event []string
	check := func(p string) bool { return has(gjson.Parse(p)) }
	for _, l := range append(strings.Split(strings.ReplaceAll(strings.ReplaceAll(string(stream), "\r\n", "\n"), "\r", "\n"), "\n"), "") {
		if l == "" {
			if check(strings.Join(event, "\n")) {
				return true
			}
			event = event[:0]
			continue
		}
		if p, ok := strings.CutPrefix(l, "data:"); ok {
			p = strings.TrimPrefix(p, " ")
			if check(p) {
				return true
			}
			event = append(event, p)
		}
	}
	return false
}

// FuzzAnthropicSSE: the Messages stream filter never changes the stream, reads the same usage
// whatever the writes' sizes, and never invents counts.
func FuzzAnthropicSSE(f *testing.F) {
	f.Add([]byte(anthStream), uint8(3))
	f.Add([]byte("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":3,\"output_tokens\":2}}\n\n"), uint8(1))
	// member names fold as a client's decoder folds them (found by the fuzzer: the check once
	// looked for the exact bytes "output_tokens").
	f.Add([]byte("data:{\"tYpe\":\"message_delta\",\"usAge\":{\"input_tokens\":0,\"output_toke\\u004es\":0}}"), uint8(7))
	f.Fuzz(func(t *testing.T, stream []byte, step uint8) {
		run := func(s int) *sseFilter {
			var out bytes.Buffer
			flt := &sseFilter{anthropic: true, maxEvent: 256, emit: func(b []byte) { out.Write(b) }}
			for b := stream; len(b) > 0; {
				n := min(s, len(b))
				flt.Write(b[:n])
				b = b[n:]
			}
			flt.finish()
			out.Write(flt.release())
			if !bytes.Equal(out.Bytes(), stream) {
				t.Fatalf("stream changed:\n%q\n%q", stream, out.Bytes())
			}
			return flt
		}
		whole, parts := run(len(stream)+1), run(max(int(step), 1))
		if whole.haveUsage != parts.haveUsage || !whole.usage.Equal(parts.usage) {
			t.Fatalf("usage depends on the writes: %+v %v vs %+v %v", whole.usage, whole.haveUsage, parts.usage, parts.haveUsage)
		}
		if u := whole.usage; whole.haveUsage {
			if u.Prompt < u.Of(pricing.CachedInput)+u.Of(pricing.CacheWrite)+u.Of(pricing.CacheWrite1h) || u.Completion < 0 || !namesMember(stream, "output_tokens") {
				t.Fatalf("usage %+v from %q", u, stream)
			}
		}
	})
}
