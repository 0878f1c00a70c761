package middleware

import (
	"bytes"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

func FuzzRequestFields(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","stream":true,"stream_options":{"include_usage":false},"max_tokens":5,"n":2,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","input":[{"type":"message","content":[{"type":"input_text","text":"a"}]}],"tools":[{"type":"web_search"}]}`,
		`{"model":"m","mod\u0065l":"x"}`, `{"model":"m","Model":"x"}`, `{"model":"m","tools":[{"type":"function","Type":"web_search"}]}`,
		"{\"model\":\"m\",\"\u017ftream\":true}", `{"model":"m","messages":[{"content":[{"type":"text","type":"input_audio"}]}]}`, `[]`, `{`, `{"model":"m","stream_options":null}`, `{"model":"m","max_tokens":1e2}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if tb := bytes.TrimSpace(body); gjson.ValidBytes(body) && len(tb) > 0 && (tb[0] == '{' || tb[0] == '[') {
			// The raw walker agrees with gjson on every member of a valid object or array.
			obj := tb[0] == '{'
			var keys, raws []string
			gjson.ParseBytes(body).ForEach(func(k, v gjson.Result) bool {
				keys, raws = append(keys, k.String()), append(raws, v.Raw)
				return true
			})
			i := 0
			forEachRaw(string(body), func(k, v string) bool {
				if i >= len(keys) || (obj && k != keys[i]) || v != raws[i] {
					t.Fatalf("member %d: walker %q=%q, gjson %q %q", i, k, v, keys, raws)
				}
				i++
				return true
			})
			if i != len(keys) {
				t.Fatalf("walker saw %d members, gjson %d", i, len(keys))
			}
		}
		r, e := parseRequest(EndpointChat, body)
		if e != nil {
			if e.Status != 400 || e.Code == "" {
				t.Fatalf("bad error %+v", e)
			}
			return
		}
		if !gjson.ValidBytes(body) || r.Model == "" || r.N < 1 || r.OutputCap < 0 || r.Size != len(body) {
			t.Fatalf("accepted %q as %+v", body, r)
		}
		// The fields priced are the ones every upstream reads (lenient, last-wins, first-wins).
		checkOneReading(t, EndpointChat, body, r)
		if r.OutputCap > 0 && !bytes.Contains(body, []byte(strconv.FormatInt(r.OutputCap, 10))) {
			t.Fatalf("output cap %d not in the body", r.OutputCap)
		}
		out, err := injectIncludeUsage(body)
		if err != nil {
			return // sjson refuses some odd but valid bodies; the middleware answers 500 then
		}
		r2, e2 := parseRequest(EndpointChat, out)
		if e2 != nil || !r2.IncludeUsage || r2.Model != r.Model || r2.OutputCap != r.OutputCap || r2.N != r.N || r2.Stream != r.Stream {
			t.Fatalf("inject changed the request: %q -> %q: %+v %v", body, out, r2, e2)
		}
	})
}

func FuzzSSE(f *testing.F) {
	f.Add([]byte(chatStreamInjected), uint8(3), true)
	f.Add([]byte("event: response.completed\r\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}}\r\n\r\n"), uint8(1), false)
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\ndata: [DONE]"), uint8(0), true)
	// Lone CRs, CRs and LFs mixed, a CRLF cut between two writes.
	f.Add([]byte(loneCR(chatStreamInjected)), uint8(5), true)
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\r\rdata: [DONE]\r\r"), uint8(0), true)
	f.Add([]byte("event: response.completed\rdata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}}\r\r"), uint8(2), false)
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\r\n\rdata: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\r\ndata: [DONE]\r\n\r\n"), uint8(1), true)
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\r\n\r\ndata: [DONE]\r\n\r\n"), uint8(2), true)
	// Member names fold as a client's decoder folds them.
	f.Add([]byte("data: {\"choices\":[],\"Usage\":{\"Prompt_Tokens\":9,\"completion_token\\u0073\":1}}\n\ndata: [DONE]\n\n"), uint8(4), false)
	f.Fuzz(func(t *testing.T, stream []byte, step uint8, inject bool) {
		run := func(stream []byte) (*sseFilter, []byte) {
			var out bytes.Buffer
			flt := &sseFilter{inject: inject, maxEvent: 256, emit: func(b []byte) { out.Write(b) }}
			s := int(step)
			if s == 0 {
				s = len(stream) + 1
			}
			for b := stream; len(b) > 0; {
				n := min(s, len(b))
				flt.Write(b[:n])
				b = b[n:]
			}
			flt.finish()
			out.Write(flt.release())
			return flt, out.Bytes()
		}
		flt, got := run(stream)
		out := bytes.NewBuffer(got)
		if !bytes.Contains(stream, []byte{'\r'}) {
			// The same stream with every line end a lone CR reads the same.
			cr, crOut := run(bytes.ReplaceAll(stream, []byte{'\n'}, []byte{'\r'}))
			if cr.haveUsage != flt.haveUsage || !cr.usage.Equal(flt.usage) || cr.terminal != flt.terminal || cr.upstreamError != flt.upstreamError ||
				!bytes.Equal(bytes.ReplaceAll(crOut, []byte{'\r'}, []byte{'\n'}), got) {
				t.Fatalf("lone CRs read otherwise: usage %+v %v, want %+v %v; out %q, want %q", cr.usage, cr.haveUsage, flt.usage, flt.haveUsage, crOut, got)
			}
		}
		if !inject && !bytes.Equal(out.Bytes(), stream) {
			t.Fatalf("stream changed without injection:\n%q\n%q", stream, out.Bytes())
		}
		if inject && out.Len() > len(stream) {
			t.Fatalf("injection mode grew the stream: %d > %d", out.Len(), len(stream))
		}
		if flt.haveUsage {
			u := flt.usage
			if u.Prompt < 0 || u.Completion < 0 || u.Of(pricing.CachedInput) < 0 || u.Reasoning < 0 ||
				!(namesMember(stream, "prompt_tokens") || namesMember(stream, "input_tokens")) {
				t.Fatalf("usage %+v invented from %q", u, stream)
			}
			for _, n := range []int64{u.Prompt, u.Completion, u.Of(pricing.CachedInput), u.Reasoning} {
				if n != 0 && !bytes.Contains(stream, []byte(strconv.FormatInt(n, 10))) {
					t.Fatalf("count %d of %+v not in %q", n, u, stream)
				}
			}
		}
	})
}

func FuzzUsage(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens":10,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":3}}}`))
	f.Add([]byte(`{"usage":{"input_tokens":8,"output_tokens":4,"output_tokens_details":{"reasoning_tokens":1}}}`))
	f.Add([]byte(`{"usage":{"prompt_tokens":-1}}`))
	f.Add([]byte(`{"Usage":{"Prompt_Tokens":2},"usage":{"prompt_tokens":3}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		u, ok := usageFromBody(body)
		if !ok {
			if !u.Equal(pricing.Usage{}) {
				t.Fatalf("usage %+v without ok", u)
			}
		} else if u.Prompt < 0 || u.Completion < 0 || u.Of(pricing.CachedInput) < 0 || u.Reasoning < 0 || u.Prompt > maxTokens {
			t.Fatalf("bad counts %+v", u)
		}
		if !json.Valid(body) {
			return
		}
		// The usage billed is the usage a client's decoder reads (encoding/json: case-folded
		// names, the last duplicate wins).
		raw, found := clientUsageRaw(body)
		want, wantOK := pricing.Usage{}, false
		if found {
			want, wantOK = usageOf(gjson.ParseBytes(raw))
		}
		if !u.Equal(want) || ok != wantOK {
			t.Fatalf("%s: billed %+v %v, a client reads %+v %v (raw %s)", body, u, ok, want, wantOK, raw)
		}
		for _, n := range []int64{u.Prompt, u.Completion, u.Of(pricing.CachedInput), u.Reasoning} {
			if n != 0 && !strings.Contains(string(raw), strconv.FormatInt(n, 10)) {
				t.Fatalf("count %d not in %s", n, raw)
			}
		}
	})
}

// clientUsageRaw is the top-level usage value encoding/json gives a client.
func clientUsageRaw(body []byte) (json.RawMessage, bool) {
	var v struct{ Usage json.RawMessage }
	if json.Unmarshal(body, &v) != nil || v.Usage == nil {
		return nil, false
	}
	return v.Usage, true
}
