package middleware

import (
	"bytes"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/pricing"
)

// runSSE feeds stream to a filter in writes of size step (0: one write) and returns what the
// client saw before the release, the released tail, and the filter.
func runSSE(stream string, inject bool, step int) (seen, tail string, f *sseFilter) {
	return runSSEMax(stream, inject, step, 1<<20)
}

const chatStreamInjected = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}],\"usage\":null}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}\n\n" +
	"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":7,\"total_tokens\":18,\"prompt_tokens_details\":{\"cached_tokens\":4},\"completion_tokens_details\":{\"reasoning_tokens\":2}}}\n\n" +
	"data: [DONE]\n\n"

func TestSSEChatInjected(t *testing.T) {
	t.Parallel()
	for _, step := range []int{0, 1, 2, 3, 7, 64} {
		seen, tail, f := runSSE(chatStreamInjected, true, step)
		if !f.haveUsage || !f.usage.Equal(pricing.Usage{Prompt: 11, Completion: 7, Reasoning: 2, Units: pricing.Units{pricing.CachedInput: 4}}) {
			t.Fatalf("step %d: usage %+v %v", step, f.usage, f.haveUsage)
		}
		if strings.Contains(seen, "usage") || strings.Contains(tail, "usage") {
			t.Fatalf("step %d: client saw usage:\n%s", step, seen)
		}
		if strings.Count(seen, "data: ") != 3 || !strings.Contains(seen, `"content":"Hello"`) {
			t.Fatalf("step %d: chunks lost:\n%s", step, seen)
		}
		if strings.Contains(seen, "[DONE]") || tail != "data: [DONE]\n\n" {
			t.Fatalf("step %d: [DONE] not held back: seen %q tail %q", step, seen, tail)
		}
		if f.outChunks != 1 || f.outBytes != 5 {
			t.Fatalf("step %d: output counted %d chunks %d bytes", step, f.outChunks, f.outBytes)
		}
	}
}

func TestSSEChatClientAskedUnchanged(t *testing.T) {
	t.Parallel()
	for _, step := range []int{0, 1, 5} {
		seen, tail, f := runSSE(chatStreamInjected, false, step)
		if seen+tail != chatStreamInjected {
			t.Fatalf("step %d: stream changed:\n%s", step, seen+tail)
		}
		if tail != "data: [DONE]\n\n" || !f.haveUsage || f.usage.Prompt != 11 {
			t.Fatalf("step %d: tail %q usage %+v", step, tail, f.usage)
		}
	}
}

func TestSSEResponses(t *testing.T) {
	t.Parallel()
	stream := "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n" +
		"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi there\"}\n\n" +
		"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":10},\"output_tokens\":30,\"output_tokens_details\":{\"reasoning_tokens\":12}}}}\n\n"
	for _, inject := range []bool{false, true} {
		seen, tail, f := runSSE(strings.ReplaceAll(stream, "\n", "\r\n"), inject, 4)
		if !f.haveUsage || !f.usage.Equal(pricing.Usage{Prompt: 20, Completion: 30, Reasoning: 12, Units: pricing.Units{pricing.CachedInput: 10}}) {
			t.Fatalf("usage %+v", f.usage)
		}
		if strings.Contains(seen, "response.completed") || !strings.HasPrefix(tail, "event: response.completed") {
			t.Fatalf("completed event not held back: %q / %q", seen, tail)
		}
		if seen+tail != strings.ReplaceAll(stream, "\n", "\r\n") {
			t.Fatalf("Responses stream changed")
		}
		if f.outBytes != 8 {
			t.Fatalf("out bytes %d", f.outBytes)
		}
	}
}

func TestSSEIncompleteAndFailedCarryUsage(t *testing.T) {
	t.Parallel()
	for _, typ := range []string{"response.incomplete", "response.failed"} {
		_, tail, f := runSSE("data: {\"type\":\""+typ+"\",\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n", false, 0)
		if !f.haveUsage || f.usage.Prompt != 3 || f.usage.Completion != 1 || tail == "" {
			t.Fatalf("%s: usage %+v tail %q", typ, f.usage, tail)
		}
	}
}

func TestSSENoUsageInvented(t *testing.T) {
	t.Parallel()
	for _, s := range []string{
		"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n",
		"data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\n", // no input count
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":-1}}\n\n",
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1.5}}\n\n",
		"data: {\"type\":\"response.completed\",\"response\":{}}\n\n",
		": comment\n\nevent: x\n\n",
		"data: not json\n\n",
	} {
		if _, _, f := runSSE(s, true, 0); f.haveUsage {
			t.Errorf("usage %+v read from %q", f.usage, s)
		}
	}
}

func TestSSEOverlongEventPassesRaw(t *testing.T) {
	t.Parallel()
	big := "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("a", 3000) + "\"}}],\"usage\":null}\n\n"
	stream := big + "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n"
	var out bytes.Buffer
	f := &sseFilter{inject: true, maxEvent: 1000, emit: func(b []byte) { out.Write(b) }}
	for i := 0; i < len(stream); i += 100 {
		f.Write([]byte(stream[i:min(i+100, len(stream))]))
	}
	f.finish()
	if f.bigEvents != 1 || !strings.HasPrefix(out.String(), big) {
		t.Fatalf("big events %d, out starts %q", f.bigEvents, out.String()[:50])
	}
	if !f.haveUsage || f.usage.Prompt != 5 || string(f.release()) != "data: [DONE]\n\n" {
		t.Fatalf("the stream after the long event was not parsed: %+v", f.usage)
	}
}

func TestSSEHeldTailIsBounded(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	f := &sseFilter{maxEvent: 100, emit: func(b []byte) { out.Write(b) }}
	f.Write([]byte("data: [DONE]\n\n"))
	for range 30 {
		f.Write([]byte("data: {\"after\":\"the end\"}\n\n"))
	}
	if out.Len() == 0 || len(f.held) > 200 {
		t.Fatalf("held tail grew to %d", len(f.held))
	}
}

// TestSSEBigTerminalEventHeldAndRead: a response.completed event larger than the event limit
// passes as it comes but its end (last byte, line end, blank line) is held back until release,
// and its response.usage is read, in writes of any size.
func TestSSEBigTerminalEventHeldAndRead(t *testing.T) {
	t.Parallel()
	big := "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"output\":[{\"content\":[{\"text\":\"" +
		strings.Repeat("word ", 2000) + "\",\"usage\":{\"input_tokens\":999}}]}],\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":10},\"output_tokens\":30,\"output_tokens_details\":{\"reasoning_tokens\":12}}}}\n\n"
	stream := "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n" + big
	for _, crlf := range []bool{false, true} {
		s := stream
		if crlf {
			s = strings.ReplaceAll(stream, "\n", "\r\n")
		}
		for _, step := range []int{0, 1, 7, 4096} {
			var out bytes.Buffer
			f := &sseFilter{maxEvent: 1000, emit: func(b []byte) { out.Write(b) }}
			for b := []byte(s); len(b) > 0; {
				n := len(b)
				if step > 0 {
					n = min(step, n)
				}
				f.Write(b[:n])
				b = b[n:]
			}
			f.finish()
			seen := out.String()
			if f.bigEvents != 1 || !f.open || !f.holding || !f.terminal {
				t.Fatalf("crlf %v step %d: big %d open %v holding %v terminal %v", crlf, step, f.bigEvents, f.open, f.holding, f.terminal)
			}
			if len(seen) < len(s)-len(big)+len(big)/2 {
				t.Fatalf("crlf %v step %d: the big event did not stream (%d of %d bytes seen)", crlf, step, len(seen), len(s))
			}
			if !f.haveUsage || !f.usage.Equal(responsesUsage) {
				t.Fatalf("crlf %v step %d: usage %+v %v", crlf, step, f.usage, f.haveUsage)
			}
			// Held: the closing brace and the line ends, so the client has neither a complete JSON
			// value nor the blank line that dispatches the event.
			if tail := string(f.release()); seen+tail != s || strings.TrimRight(tail, "\r\n") != "}" {
				t.Fatalf("crlf %v step %d: tail %q; stream changed", crlf, step, tail)
			}
		}
	}
}

// TestSSELenientUsageKeys: an event's usage is read with the keys matched as a client's decoder
// matches them, in events kept whole and in events too long to keep alike.
func TestSSELenientUsageKeys(t *testing.T) {
	t.Parallel()
	for _, maxEvent := range []int{1 << 20, 40} {
		var out bytes.Buffer
		f := &sseFilter{maxEvent: maxEvent, emit: func(b []byte) { out.Write(b) }}
		f.Write([]byte("data: {\"choices\":[{\"delta\":{\"usage\":{\"prompt_tokens\":99}}}],\"Usage\":{\"Prompt_Tokens\":3,\"completion_tokens\":4}}\n\ndata: [DONE]\n\n"))
		f.finish()
		if !f.haveUsage || !f.usage.Equal(pricing.Usage{Prompt: 3, Completion: 4}) {
			t.Fatalf("maxEvent %d: usage %+v %v", maxEvent, f.usage, f.haveUsage)
		}
	}
}
