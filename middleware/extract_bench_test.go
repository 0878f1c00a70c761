package middleware

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
)

// bigChatBody is a plain chat request of about size bytes (many short messages).
func bigChatBody(size int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"gpt-test","stream":true,"max_completion_tokens":100,"messages":[`)
	for i := 0; b.Len() < size-200; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`{"role":"user","content":"message number ` + strconv.Itoa(i) + ` with some text in it, \"quoted\" and ünïcode"}`)
	}
	b.WriteString(`],"temperature":0.5}`)
	return []byte(b.String())
}

// TestRequestFieldsNoFullDecode proves the field extraction does not decode the body: its
// allocations do not grow with the body (a full decode allocates per message).
func TestRequestFieldsNoFullDecode(t *testing.T) {
	small, big := bigChatBody(1<<10), bigChatBody(1<<20)
	// AllocsPerRun counts every allocation in the process, so goroutines left by other tests
	// (background releases, learned-max raises) can only add to it: the least of a few runs is
	// the parser's own count.
	allocs := func(body []byte) float64 {
		least := -1.0
		for range 5 {
			n := testing.AllocsPerRun(20, func() {
				if _, e := parseRequest(EndpointChat, body); e != nil {
					t.Fatal(e)
				}
			})
			if least < 0 || n < least {
				least = n
			}
		}
		return least
	}
	as, ab := allocs(small), allocs(big)
	var full map[string]any
	af := testing.AllocsPerRun(3, func() { _ = json.Unmarshal(big, &full) })
	t.Logf("allocs per parse: 1 KiB body %.0f, 1 MiB body %.0f; encoding/json full decode of 1 MiB: %.0f", as, ab, af)
	if ab > as+2 || ab > 20 {
		t.Fatalf("extraction allocations grow with the body: %.0f (1 KiB) vs %.0f (1 MiB)", as, ab)
	}
	if af < 100*ab {
		t.Fatalf("baseline sanity: a full decode should allocate far more (%.0f vs %.0f)", af, ab)
	}
}

// BenchmarkRequestFields1MiB compares the extraction with encoding/json on a 1 MiB body:
// gjson (ours) against Unmarshal into a map (full decode) and into a struct of the few fields
// (still a full scan with reflection).
func BenchmarkRequestFields1MiB(b *testing.B) {
	body := bigChatBody(1 << 20)
	b.Run("gjson", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if _, e := parseRequest(EndpointChat, body); e != nil {
				b.Fatal(e)
			}
		}
	})
	b.Run("encoding_json_map", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			var m map[string]any
			if err := json.Unmarshal(body, &m); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding_json_struct", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			var s struct {
				Model         string `json:"model"`
				Stream        bool   `json:"stream"`
				MaxCompletion int64  `json:"max_completion_tokens"`
				StreamOptions *struct {
					IncludeUsage bool `json:"include_usage"`
				} `json:"stream_options"`
			}
			if err := json.Unmarshal(body, &s); err != nil {
				b.Fatal(err)
			}
		}
	})
}
