package server

import (
	"net/http"
	"testing"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestMediaEndpoints (issue 32, new endpoints on the specs) through the whole proxy, on real
// Redis + Postgres and on the embedded parts: image generations are charged n × the per-image
// price of their size and quality, speech the characters of its input × the characters price
// (the audio bytes unchanged), moderations nothing; prices set through the admin API as classes.
func TestMediaEndpoints(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startTestProxy(t, real)
			key := p.priceOrg("acme", 100_000_000)
			p.admin("PUT", "/models/dall-e-3", map[string]any{"per_image_1024x1024_standard_price": 40_000,
				"per_image_1024x1024_hd_price": 80_000}, http.StatusOK, nil)
			p.admin("PUT", "/models/tts-1", map[string]any{"characters_price": 15_000_000}, http.StatusOK, nil)

			if got := p.chargedOK("/v1/images/generations", key, `{"model":"dall-e-3","prompt":"a cat","n":3,"quality":"hd"}`, nil); got != 240_000 {
				t.Errorf("images: charged %d, want 240000", got)
			}
			res, b := p.send("/v1/images/generations", key, `{"model":"dall-e-3","prompt":"a cat","size":"256x256"}`, nil)
			if res.StatusCode != http.StatusBadRequest {
				t.Fatalf("unpriced size: %d %s", res.StatusCode, b)
			}
			res, b = p.send("/v1/audio/speech", key, `{"model":"tts-1","voice":"alloy","input":"Hello, world!"}`, nil)
			if res.StatusCode != http.StatusOK || b != string(fakeupstream.SpeechBytes("Hello, world!", "alloy")) {
				t.Fatalf("speech: %d %q", res.StatusCode, b)
			}
			if got := p.charge(res.Header.Get("X-Request-Id")); got != 13*15 {
				t.Errorf("speech: charged %d, want %d", got, 13*15)
			}
			if got := p.chargedOK("/v1/moderations", key, `{"input":"fine?"}`, nil); got != 0 {
				t.Errorf("moderations: charged %d, want 0", got)
			}
		})
	}
}
