package server

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// sdkMediaCall is what sdktest/media.mjs reports of one call.
type sdkMediaCall struct {
	RequestID string          `json:"requestId"`
	Cost      string          `json:"cost"`
	Status    int             `json:"status"`
	Images    int64           `json:"images"`
	Size      string          `json:"size"`
	Quality   string          `json:"quality"`
	Chars     int64           `json:"chars"`
	Input     string          `json:"input"`
	Audio     string          `json:"audio"`
	Text      string          `json:"text"`
	Results   int             `json:"results"`
	Partials  int             `json:"partials"`
	Usage     json.RawMessage `json:"usage"`
}

// TestOpenAINodeSDKMedia (issue 32) drives the media endpoints with the official openai npm
// package (sdktest/media.mjs) on real Redis + Postgres and on the embedded parts: for each
// call, what the SDK saw proves the price — images.generate (n × the per-image price of the
// size and quality, the upstream's defaults when none is sent), images.edit (a multipart
// upload, likewise), the same two for a gpt-image model (the usage in the answer at its token
// prices) and a gpt-image stream with partial images (the usage of its completed event), audio.speech.create (the characters it sent, the audio bytes unchanged),
// audio.transcriptions.create and .translations.create (the seconds the answer reports of a WAV
// or an MP3 upload; the tokens it reports for a token-billed model), moderations.create (free) — and the ledger charged exactly that, the x-escrow-cost
// the SDK got back; the org's balance fell by the sum.
func TestOpenAINodeSDKMedia(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			p := startTestProxy(t, real)
			const funds = 100_000_000
			key := p.priceOrg("sdk-media", funds)
			perImage := map[string]int64{"1024x1024_standard": 40_000, "1024x1024_hd": 80_000}
			p.admin("PUT", "/models/dall-e-3", map[string]any{"per_image_1024x1024_standard_price": perImage["1024x1024_standard"],
				"per_image_1024x1024_hd_price": perImage["1024x1024_hd"]}, http.StatusOK, nil)
			const charPrice, secondPrice = 15_000_000, 100 // per 1M characters; per second
			p.admin("PUT", "/models/tts-1", map[string]any{"characters_price": charPrice}, http.StatusOK, nil)
			p.admin("PUT", "/models/whisper-1", map[string]any{"audio_second_price": secondPrice}, http.StatusOK, nil)
			const textIn, imageIn, imageOut = 5, 10, 40 // gpt-image: per token
			p.admin("PUT", "/models/gpt-image-1", map[string]any{"input_price": textIn * 1_000_000, "image_input_price": imageIn * 1_000_000,
				"image_output_price": imageOut * 1_000_000}, http.StatusOK, nil)
			const tIn, tAudio, tOut = 2, 6, 10 // gpt-4o-transcribe: per token
			p.admin("PUT", "/models/gpt-4o-transcribe", map[string]any{"input_price": tIn * 1_000_000, "audio_input_price": tAudio * 1_000_000,
				"output_price": tOut * 1_000_000, "max_output_tokens": 2000}, http.StatusOK, nil)

			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			out := runSDK(ctx, t, node, "media.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + key,
				"ESCROW_IMAGE_MODEL=dall-e-3", "ESCROW_SPEECH_MODEL=tts-1", "ESCROW_AUDIO_MODEL=whisper-1",
				"ESCROW_TOKEN_IMAGE_MODEL=gpt-image-1", "ESCROW_TRANSCRIBE_MODEL=gpt-4o-transcribe"}, nil)
			var res map[string]sdkMediaCall
			if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
				t.Fatalf("node output %s: %v", out, err)
			}
			var total int64
			check := func(name string, want int64) {
				t.Helper()
				c, ok := res[name]
				if !ok || c.Status != http.StatusOK || c.RequestID == "" {
					t.Fatalf("%s: the SDK saw %+v", name, c)
				}
				if got := p.charge(c.RequestID); got != want || (c.Cost != strconv.FormatInt(want, 10) && name != "tokenStream") {
					t.Errorf("%s: the ledger charged %d, x-escrow-cost %q; what the SDK saw proves %d", name, got, c.Cost, want)
				}
				total += want
			}
			for _, name := range []string{"generate", "generateDefault", "edit"} {
				c := res[name]
				if want := map[string]int64{"generate": 3, "generateDefault": 1, "edit": 2}[name]; c.Images != want {
					t.Fatalf("%s: the SDK got %d images, want %d", name, c.Images, want)
				}
				check(name, c.Images*perImage[c.Size+"_"+c.Quality])
			}

			sp := res["speech"]
			if audio, _ := base64.StdEncoding.DecodeString(sp.Audio); !bytes.Equal(audio, fakeupstream.SpeechBytes(sp.Input, "alloy")) {
				t.Fatalf("speech: the SDK got %d bytes, not the upstream's audio", len(audio))
			}
			check("speech", (sp.Chars*charPrice+999_999)/1_000_000)

			for _, name := range []string{"transcription", "translation", "transcriptionMp3"} {
				var u struct {
					Type    string `json:"type"`
					Seconds int64  `json:"seconds"`
				}
				if err := json.Unmarshal(res[name].Usage, &u); err != nil || u.Type != "duration" || u.Seconds <= 0 || res[name].Text == "" {
					t.Fatalf("%s: the SDK saw %+v (usage %s)", name, res[name], res[name].Usage)
				}
				check(name, u.Seconds*secondPrice)
			}

			// gpt-4o-transcribe of an MP3: the tokens the SDK got are the bill.
			var tu struct {
				Type         string `json:"type"`
				Input        int64  `json:"input_tokens"`
				Output       int64  `json:"output_tokens"`
				InputDetails struct {
					Audio int64 `json:"audio_tokens"`
					Text  int64 `json:"text_tokens"`
				} `json:"input_token_details"`
			}
			if err := json.Unmarshal(res["transcriptionTokens"].Usage, &tu); err != nil || tu.Type != "tokens" || tu.InputDetails.Audio <= 0 ||
				tu.InputDetails.Audio+tu.InputDetails.Text != tu.Input {
				t.Fatalf("transcriptionTokens: the SDK saw %+v (usage %s)", res["transcriptionTokens"], res["transcriptionTokens"].Usage)
			}
			check("transcriptionTokens", tu.InputDetails.Audio*tAudio+tu.InputDetails.Text*tIn+tu.Output*tOut)

			// gpt-image: the usage the SDK got is the bill.
			if res["tokenStream"].Partials != 2 {
				t.Errorf("tokenStream: the SDK read %d partial images, want 2", res["tokenStream"].Partials)
			}
			if res["tokenStream"].Cost != "" {
				// A stream's cost is not a header (x-escrow-include-cost would put it in an SSE comment).
				t.Errorf("tokenStream: x-escrow-cost %q on a stream", res["tokenStream"].Cost)
			}
			for _, name := range []string{"tokenGenerate", "tokenEdit", "tokenStream"} {
				var u fakeupstream.ImageTokenUsage
				if err := json.Unmarshal(res[name].Usage, &u); err != nil || u.OutputTokens <= 0 || res[name].Images <= 0 ||
					(name == "tokenEdit") != (u.InputDetails.ImageTokens > 0) {
					t.Fatalf("%s: the SDK saw %+v (usage %s)", name, res[name], res[name].Usage)
				}
				check(name, u.InputDetails.TextTokens*textIn+u.InputDetails.ImageTokens*imageIn+u.OutputTokens*imageOut)
			}

			if res["moderation"].Results != 2 {
				t.Fatalf("moderation: the SDK saw %+v", res["moderation"])
			}
			check("moderation", 0)

			if b := p.settled("sdk-media"); b.LedgerBalance != funds-total || b.Available != funds-total {
				t.Errorf("balance after the SDK's calls: %+v, want %d (charged %d)", b, funds-total, total)
			}
			var sum int64
			for _, c := range p.charges("sdk-media") {
				sum -= c.Delta
			}
			if sum != total {
				t.Errorf("charge entries sum to %d, want %d", sum, total)
			}
			t.Logf("SDK media calls charged %d in all: %s", total, out[:min(len(out), 300)])
		})
	}
}
