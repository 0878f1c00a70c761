package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestAudioTokensPriced (issue 32, adding one price class): chat's
// prompt_tokens_details.audio_tokens and completion_tokens_details.audio_tokens are billed at a
// model's audio_input and audio_output prices, set through the admin API like any class; a
// model without them keeps refusing a request with audio (400, param audio) and holds nothing.
// Each number is the ledger's charge through the whole proxy, JSON and streamed, on real Redis
// + Postgres and on the embedded parts.
func TestAudioTokensPriced(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startTestProxy(t, real)
			key := p.priceOrg("acme", 100_000_000)
			p.admin("PUT", "/models/gpt-text", map[string]any{"input_price": 2_500_000, "output_price": 10_000_000,
				"max_input_tokens": 128_000, "max_output_tokens": 1_000}, http.StatusOK, nil)
			var m ledger.Model
			p.admin("PUT", "/models/gpt-audio", map[string]any{"input_price": 2_500_000, "output_price": 10_000_000,
				"audio_input_price": 40_000_000, "audio_output_price": 80_000_000, "max_input_tokens": 128_000, "max_output_tokens": 1_000},
				http.StatusOK, &m)
			if m.Prices[pricing.AudioInput] != 40_000_000 || m.Prices[pricing.AudioOutput] != 80_000_000 {
				t.Fatalf("PUT answered %+v", m)
			}
			body := func(model string, stream bool) string {
				b, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 100, "stream": stream,
					"modalities": []string{"text", "audio"}, "audio": map[string]string{"voice": "alloy", "format": "wav"},
					"messages": []map[string]string{{"role": "user", "content": words(996) + " [audio_in:400] [audio_out:60] [cached:100] [fill]"}}})
				return string(b)
			}
			// 1,000 prompt tokens: 100 cached, 400 audio, 500 text; 100 completion tokens: 60
			// audio, 40 text. 500·2.5 + 100·2.5 (no cached price: the input price) + 400·40 +
			// 40·10 + 60·80 = 1,250 + 250 + 16,000 + 400 + 4,800.
			const want = 22_700
			for _, stream := range []bool{false, true} {
				if got := p.chargedOK("/v1/chat/completions", key, body("gpt-audio", stream), nil); got != want {
					t.Errorf("gpt-audio (stream %v): charged %d, want %d", stream, got, want)
				}
				res, b := p.send("/v1/chat/completions", key, body("gpt-text", stream), nil)
				if res.StatusCode != http.StatusBadRequest || !strings.Contains(b, `"param":"audio"`) {
					t.Fatalf("gpt-text with audio (stream %v): %d %s", stream, res.StatusCode, b)
				}
			}
			// The usage event keeps the classes' units.
			res, _ := p.send("/v1/chat/completions", key, body("gpt-audio", false), nil)
			var r ledger.RequestInfo
			p.admin("GET", "/requests/"+res.Header.Get("X-Request-Id"), nil, http.StatusOK, &r)
			if u := r.Usage; u.Prompt != 1_000 || u.Completion != 100 || u.Of(pricing.AudioInput) != 400 || u.Of(pricing.AudioOutput) != 60 ||
				u.Of(pricing.CachedInput) != 100 || r.Cost != want {
				t.Fatalf("request %+v", r)
			}
		})
	}
}
