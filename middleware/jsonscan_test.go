package middleware

import (
	"bytes"
	"encoding/json"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// scanSplit runs the scanner over body cut into writes of step bytes (0: one write).
func scanSplit(body []byte, step int) *usageScanner {
	s := &usageScanner{}
	if step <= 0 {
		step = len(body) + 1
	}
	for b := body; len(b) > 0; {
		n := min(step, len(b))
		s.Write(b[:n])
		b = b[n:]
	}
	s.finish()
	return s
}

func TestUsageScanner(t *testing.T) {
	t.Parallel()
	u := func(p, c int64) pricing.Usage { return pricing.Usage{Prompt: p, Completion: c} }
	tests := []struct {
		name, body string
		want       pricing.Usage
		ok         bool
	}{
		{"plain", `{"id":"x","usage":{"prompt_tokens":3,"completion_tokens":4}}`, u(3, 4), true},
		{"usage first", `{"usage":{"prompt_tokens":3,"completion_tokens":4},"choices":[]}`, u(3, 4), true},
		{"case variant key", `{"USAGE":{"prompt_tokens":3,"completion_tokens":4}}`, u(3, 4), true},
		{"escaped key", `{"us\u0061ge":{"prompt_tokens":3}}`, u(3, 0), true},
		{"long s folds to s", `{"u` + "\u017f" + `age":{"prompt_tokens":3}}`, u(3, 0), true},
		{"escaped long s", `{"u\u017fage":{"prompt_tokens":3}}`, u(3, 0), true},
		{"last duplicate wins", `{"usage":{"prompt_tokens":1},"Usage":{"prompt_tokens":9,"completion_tokens":2}}`, u(9, 2), true},
		{"last null wins", `{"usage":{"prompt_tokens":1},"usage":null}`, pricing.Usage{}, false},
		{"inner names folded", `{"usage":{"Prompt_Tokens":5,"COMPLETION_TOKENS":6}}`, u(5, 6), true},
		{"nested usage ignored", `{"choices":[{"message":{"content":"x","usage":{"prompt_tokens":99}}}],"data":{"usage":{"prompt_tokens":98}}}`, pricing.Usage{}, false},
		{"nested before top", `{"choices":[{"usage":{"prompt_tokens":99}}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`, u(2, 1), true},
		{"usage in a string", `{"content":"\"usage\":{\"prompt_tokens\":99}","usage":{"prompt_tokens":2}}`, u(2, 0), true},
		{"top-level array", `[{"usage":{"prompt_tokens":2}}]`, pricing.Usage{}, false},
		{"syntax error after usage", `{"usage":{"prompt_tokens":2},"x":tru}`, pricing.Usage{}, false},
		{"trailing garbage", `{"usage":{"prompt_tokens":2}} {}`, pricing.Usage{}, false},
		{"bad escape", `{"a":"\q","usage":{"prompt_tokens":2}}`, pricing.Usage{}, false},
		{"bad number", `{"a":01,"usage":{"prompt_tokens":2}}`, pricing.Usage{}, false},
		{"numbers", `{"a":[-0.5e+10,0,12.25,1E3,-7],"usage":{"prompt_tokens":2}}`, u(2, 0), true},
		{"whitespace", " \r\n\t{ \"usage\" : { \"prompt_tokens\" : 2 } } \n", u(2, 0), true},
		{"cut short keeps what was read", `{"usage":{"prompt_tokens":2},"choices":[{"mess`, u(2, 0), true},
	}
	for _, tt := range tests {
		for _, step := range []int{0, 1, 2, 3, 7} {
			s := scanSplit([]byte(tt.body), step)
			got, ok := s.usage()
			if ok != tt.ok || !got.Equal(tt.want) {
				t.Errorf("%s (step %d): got %+v %v, want %+v %v", tt.name, step, got, ok, tt.want, tt.ok)
			}
		}
		// Wherever encoding/json reads the document, the scanner agrees with it.
		if json.Valid([]byte(tt.body)) {
			raw, found := clientUsageRaw([]byte(tt.body))
			want, wantOK := pricing.Usage{}, false
			if found {
				want, wantOK = usageOf(gjson.ParseBytes(raw))
			}
			if !want.Equal(tt.want) || wantOK != tt.ok {
				t.Errorf("%s: encoding/json reads %+v %v", tt.name, want, wantOK)
			}
		}
	}
}

func TestUsageScannerResponsesEvent(t *testing.T) {
	t.Parallel()
	ev := `{"type":"response.completed","sequence_number":9,"response":{"id":"r","output":[{"content":[{"text":"hi","usage":{"input_tokens":99}}]}],` +
		`"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":10},"output_tokens":30,"output_tokens_details":{"reasoning_tokens":12}}}}`
	for _, step := range []int{0, 1, 5} {
		s := scanSplit([]byte(ev), step)
		typ, ok := s.typeString()
		if !ok || typ != "response.completed" {
			t.Fatalf("type %q %v", typ, ok)
		}
		got, ok := s.responseUsage()
		if !ok || !got.Equal(responsesUsage) {
			t.Fatalf("step %d: response.usage %+v %v", step, got, ok)
		}
		if _, ok := s.usage(); ok {
			t.Fatal("response.usage taken as the top-level usage")
		}
	}
}

func TestUsageScannerLimits(t *testing.T) {
	t.Parallel()
	// Nesting past encoding/json's limit is an error, not a stack overflow.
	deep := strings.Repeat("[", maxScanDepth+1) + strings.Repeat("]", maxScanDepth+1)
	if s := scanSplit([]byte(deep), 0); !s.failed {
		t.Fatal("nesting past the limit accepted")
	}
	ok := strings.Repeat("[", maxScanDepth) + strings.Repeat("]", maxScanDepth)
	if s := scanSplit([]byte(ok), 0); !s.complete() {
		t.Fatal("nesting at the limit refused")
	}
	// A usage value too long to capture is unreadable, and it clears an earlier one.
	huge := `{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2,"pad":"` + strings.Repeat("x", maxCapture) + `"}}`
	if _, ok := scanSplit([]byte(huge), 4096).usage(); ok {
		t.Fatal("usage read from a value past the capture limit")
	}
}

// bigChatResponse is a chat completion of about size bytes: n choices of logprob-laden content,
// usage at the end, like OpenAI's n/logprobs responses.
func bigChatResponse(size int) []byte {
	var b bytes.Buffer
	b.WriteString(`{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[`)
	for i := 0; b.Len() < size-300; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"index":%d,"message":{"role":"assistant","content":"tok%d tok \"quoted\" \u00e9"},"logprobs":{"content":[{"token":"tok","logprob":-0.0123,"bytes":[116,111,107],"top_logprobs":[{"token":"a","logprob":-1.5e-3},{"token":"usage","logprob":-2}]}]},"finish_reason":"length"}`, i, i)
	}
	b.WriteString(`],"usage":{"prompt_tokens":17,"completion_tokens":1048576,"total_tokens":1048593,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}`)
	return b.Bytes()
}

func TestUsageScannerBigBodyAnySplit(t *testing.T) {
	t.Parallel()
	body := bigChatResponse(1 << 20)
	want := pricing.Usage{Prompt: 17, Completion: 1048576}
	for _, step := range []int{0, 1, 13, 4096, 32 << 10} {
		s := scanSplit(body, step)
		if got, ok := s.usage(); !ok || !got.Equal(want) || !s.complete() {
			t.Fatalf("step %d: %+v %v complete %v", step, got, ok, s.complete())
		}
	}
	if raw, _ := clientUsageRaw(body); gjson.GetBytes(raw, "completion_tokens").Int() != 1048576 {
		t.Fatal("encoding/json disagrees")
	}
}

// FuzzUsageScanner: any split of the input into writes finds what one write finds, the scanner
// never panics, and on valid JSON it takes the usage a client's decoder reads.
func FuzzUsageScanner(f *testing.F) {
	f.Add([]byte(`{"usage":{"prompt_tokens":10,"completion_tokens":5}}`), uint16(1), uint16(3))
	f.Add([]byte(`{"choices":[{"usage":{"prompt_tokens":1}}],"Usage":{"prompt_tokens":2},"usage":{"input_tokens":3}}`), uint16(2), uint16(7))
	f.Add([]byte(`{"type":"response.completed","response":{"usage":{"input_tokens":8,"output_tokens":4}}}`), uint16(5), uint16(1))
	f.Add([]byte(`{"us\u0061ge":{"prompt_tokens":1e2},"x":[1.5,-0,true,false,null,"\ud83d\ude00"]}`), uint16(3), uint16(11))
	f.Add(bigChatResponse(4096), uint16(100), uint16(7))
	f.Fuzz(func(t *testing.T, body []byte, a, b uint16) {
		whole := scanSplit(body, 0)
		wu, wok := whole.usage()
		wr, wrok := whole.responseUsage()
		wt, wtok := whole.typeString()
		// Writes of alternating sizes a and b.
		s := &usageScanner{}
		sizes := [2]int{int(a%512) + 1, int(b%512) + 1}
		for i, rest := 0, body; len(rest) > 0; i++ {
			n := min(sizes[i%2], len(rest))
			s.Write(rest[:n])
			rest = rest[n:]
		}
		s.finish()
		u, ok := s.usage()
		r, rok := s.responseUsage()
		typ, tok := s.typeString()
		if !u.Equal(wu) || ok != wok || !r.Equal(wr) || rok != wrok || typ != wt || tok != wtok || s.complete() != whole.complete() || s.text != whole.text {
			t.Fatalf("split %v differs: usage %+v %v / %+v %v, response %+v %v / %+v %v, type %q / %q",
				sizes, u, ok, wu, wok, r, rok, wr, wrok, typ, wt)
		}
		if json.Valid(body) {
			if !whole.complete() {
				t.Fatalf("valid JSON not read to its end: %q", body)
			}
			raw, found := clientUsageRaw(body)
			want, wantOK := pricing.Usage{}, false
			if found {
				want, wantOK = usageOf(gjson.ParseBytes(raw))
			}
			if !u.Equal(want) || ok != wantOK {
				t.Fatalf("%q: scanner %+v %v, encoding/json %+v %v", body, u, ok, want, wantOK)
			}
		}
	})
}

// BenchmarkUsageExtractor is the streaming extractor's cost per MiB of response (MB/s), in
// 32 KiB writes as a proxy passes them, on a logprob-heavy chat body and an embeddings body
// (numbers).
func BenchmarkUsageExtractor(b *testing.B) {
	embed := func(size int) []byte {
		var e bytes.Buffer
		e.WriteString(`{"object":"list","data":[{"object":"embedding","index":0,"embedding":[`)
		for i := 0; e.Len() < size-100; i++ {
			if i > 0 {
				e.WriteByte(',')
			}
			e.WriteString(strconv.FormatFloat(float64(i%977)/977-0.5, 'f', 8, 64))
		}
		e.WriteString(`]}],"model":"e","usage":{"prompt_tokens":8,"total_tokens":8}}`)
		return e.Bytes()
	}
	for _, c := range []struct {
		name string
		body []byte
	}{{"chat_logprobs_8MiB", bigChatResponse(8 << 20)}, {"embeddings_8MiB", embed(8 << 20)}} {
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			b.ReportAllocs()
			var s usageScanner
			for b.Loop() {
				s.reset()
				for p := c.body; len(p) > 0; {
					n := min(32<<10, len(p))
					s.Write(p[:n])
					p = p[n:]
				}
				s.finish()
				if _, ok := s.usage(); !ok {
					b.Fatal("no usage")
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/(float64(len(c.body))/(1<<20))/1e3, "µs/MiB")
		})
		// The whole-body lookup it replaces (gjson, the body buffered), under the same load.
		b.Run(c.name+"_gjson_whole_body", func(b *testing.B) {
			b.SetBytes(int64(len(c.body)))
			for b.Loop() {
				if !gjson.ValidBytes(c.body) || !gjson.GetBytes(c.body, "usage").IsObject() {
					b.Fatal("no usage")
				}
			}
		})
	}
}

// BenchmarkUsageExtractorMemory shows the extractor's memory flat in the response size: bytes
// allocated per response and the live heap after it, from 1 MiB to 64 MiB.
func BenchmarkUsageExtractorMemory(b *testing.B) {
	chunk := bigChatResponse(1 << 20)
	chunk = chunk[:bytes.LastIndex(chunk, []byte(`],"usage"`))] // choices, open
	for _, mib := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("%dMiB", mib), func(b *testing.B) {
			b.SetBytes(int64(mib) << 20)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			for b.Loop() {
				s := &usageScanner{}
				s.Write(chunk)
				for range mib - 1 {
					s.Write([]byte(`,`))
					s.Write(chunk[bytes.IndexByte(chunk, '[')+1:])
				}
				s.Write([]byte(`],"usage":{"prompt_tokens":1,"completion_tokens":2}}`))
				s.finish()
				if _, ok := s.usage(); !ok || !s.complete() {
					b.Fatal("no usage")
				}
				runtime.KeepAlive(s)
			}
			runtime.ReadMemStats(&after)
			b.ReportMetric(float64(after.TotalAlloc-before.TotalAlloc)/float64(b.N), "alloc-B/response")
			b.ReportMetric(float64(after.HeapInuse)/(1<<20), "heap-MiB")
		})
	}
}

// TestUsageScannerLinear: a long string of escapes is read in linear time: 8 MiB of escapes
// take seconds; a search for the closing quote per escape, as an earlier version did, reads
// 4 Mi × 4 MiB bytes: hours, far past any test binary's -timeout, which then fails the run.
// No bound of its own: wall-clock time on a shared machine is not CPU time.
func TestUsageScannerLinear(t *testing.T) {
	t.Parallel()
	body := []byte(`{"content":"` + strings.Repeat(`\n`, 4<<20) + `","usage":{"prompt_tokens":1}}`)
	s := scanSplit(body, 1<<20)
	if u, ok := s.usage(); !ok || u.Prompt != 1 {
		t.Fatalf("usage %+v %v", u, ok)
	}
}
