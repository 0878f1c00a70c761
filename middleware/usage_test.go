package middleware

import (
	"testing"

	"github.com/llmescrow/escrow/pricing"
)

func TestUsageFromBody(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		want       pricing.Usage
		ok         bool
	}{
		{"chat", `{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":3},"completion_tokens_details":{"reasoning_tokens":2}}}`,
			pricing.Usage{Prompt: 10, Completion: 5, Reasoning: 2, Units: pricing.Units{pricing.CachedInput: 3}}, true},
		{"responses", `{"output":[],"usage":{"input_tokens":8,"input_tokens_details":{"cached_tokens":1},"output_tokens":4,"output_tokens_details":{"reasoning_tokens":1},"total_tokens":12}}`,
			pricing.Usage{Prompt: 8, Completion: 4, Reasoning: 1, Units: pricing.Units{pricing.CachedInput: 1}}, true},
		{"embeddings", `{"data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}`, pricing.Usage{Prompt: 8}, true},
		{"null details", `{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":null}}`, pricing.Usage{Prompt: 1, Completion: 2}, true},
		{"no usage", `{"choices":[]}`, pricing.Usage{}, false},
		{"usage null", `{"usage":null}`, pricing.Usage{}, false},
		{"no input count", `{"usage":{"completion_tokens":2}}`, pricing.Usage{}, false},
		{"negative", `{"usage":{"prompt_tokens":-1}}`, pricing.Usage{}, false},
		{"fraction", `{"usage":{"prompt_tokens":1,"completion_tokens":2.5}}`, pricing.Usage{}, false},
		{"string", `{"usage":{"prompt_tokens":"1"}}`, pricing.Usage{}, false},
		{"bad cached", `{"usage":{"prompt_tokens":1,"prompt_tokens_details":{"cached_tokens":"x"}}}`, pricing.Usage{}, false},
		{"absurd", `{"usage":{"prompt_tokens":1000000000000000}}`, pricing.Usage{}, false},
		{"nested only", `{"x":{"usage":{"prompt_tokens":1}}}`, pricing.Usage{}, false},
		{"broken json", `{"usage":{"prompt_tokens":1}`, pricing.Usage{}, false},
	}
	for _, tt := range tests {
		got, ok := usageFromBody([]byte(tt.body))
		if ok != tt.ok || !got.Equal(tt.want) {
			t.Errorf("%s: got %+v %v, want %+v %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

func TestOutputBytesOfBody(t *testing.T) {
	t.Parallel()
	var s usageScanner
	s.Write([]byte(`{"choices":[{"message":{"content":"abcd"}},{"text":"xy"}]}`))
	if s.text != 6 {
		t.Fatalf("got %d", s.text)
	}
}
