package middleware

import (
	"bytes"
	"context"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// mp3Frames is n MPEG-1 Layer III frames at 128 kbit/s, 44.1 kHz (417 bytes, 1,152 samples).
func mp3Frames(n int) []byte {
	return bytes.Repeat(append([]byte{0xff, 0xfb, 0x90, 0x00}, make([]byte, 413)...), n)
}

// uploadForm is a transcription upload of file (named name) with the model and more fields.
func uploadForm(t *testing.T, model, name string, file []byte, fields ...[2]string) (body, ct string, textBytes int64) {
	t.Helper()
	var b bytes.Buffer
	w := multipart.NewWriter(&b)
	for _, f := range append([][2]string{{"model", model}}, fields...) {
		must(t, w.WriteField(f[0], f[1]))
		textBytes += int64(len(f[1]))
	}
	fw, err := w.CreateFormFile("file", name)
	must(t, err)
	_, _ = fw.Write(file)
	must(t, w.Close())
	return b.String(), w.FormDataContentType(), textBytes
}

// TestTranscriptionsCompressed (issue 32): compressed uploads are bounded before the call —
// an MP3 of frames end to end by the duration its frames prove, an MP3 with junk between its
// frames and an Ogg file by their bytes at the format's floor (endpoint.AudioFloor) — and
// charged what the answer reports, which is at most the hold: the seconds for a whisper-style
// model, the tokens for a gpt-4o-transcribe-style one (held AudioTokensPerSecond a second of
// the bound plus the form's text, and the model's max output). A token-billed model without a
// max output is refused with nothing held.
func TestTranscriptionsCompressed(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "whisper-test", Prices: pricing.Prices{pricing.AudioSecond: 100}}))
		const inPrice, audioPrice, outPrice, maxOut = 2, 6, 10, 2000
		must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "gpt-4o-transcribe-test", MaxOutputTokens: maxOut,
			Prices: pricing.Prices{pricing.Input: inPrice * 1_000_000, pricing.AudioInput: audioPrice * 1_000_000, pricing.Output: outPrice * 1_000_000}}))
		must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "gpt-4o-transcribe-nomax",
			Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.AudioInput: 1_000_000, pricing.Output: 1_000_000}}))

		clean := mp3Frames(200) // 5.225 s: proven
		junk := append(append(mp3Frames(100), make([]byte, 1000)...), mp3Frames(100)...)
		ogg := append([]byte("OggS"), make([]byte, 4996)...) // 5,000 bytes at 10 a second: 500 s
		spent := int64(0)
		for _, c := range []struct {
			name, model, file string
			audio             []byte
			boundMs           int64
			fields            [][2]string
		}{
			{"mp3 proven", "whisper-test", "a.mp3", clean, 5225, nil},
			{"mp3 with junk", "whisper-test", "a.mp3", junk, int64(len(junk)), nil},
			{"ogg", "whisper-test", "a.ogg", ogg, 500_000, nil},
			{"tokens, mp3", "gpt-4o-transcribe-test", "a.mp3", clean, 5225, [][2]string{{"prompt", "names: Ada, Alan"}}},
			{"tokens, ogg", "gpt-4o-transcribe-test", "a.ogg", ogg, 500_000, nil},
			{"tokens, streamed", "gpt-4o-transcribe-test", "a.mp3", clean, 5225, [][2]string{{"stream", "true"}}},
			{"seconds, stream ignored", "whisper-test", "a.mp3", clean, 5225, [][2]string{{"stream", "true"}}},
		} {
			body, ct, text := uploadForm(t, c.model, c.file, c.audio, c.fields...)
			st, _, b := e.postH(endpoint.Transcriptions.Path, e.key, body, map[string]string{"Content-Type": ct})
			o := e.outcome()
			secs, _ := fakeupstream.AudioSeconds(c.audio)
			var hold, cost int64
			if c.model == "whisper-test" {
				hold, cost = (c.boundMs+999)/1000*100, secs*100
			} else {
				prompt := ""
				if len(c.fields) > 0 && c.fields[0][0] == "prompt" {
					prompt = c.fields[0][1]
				}
				hold = (text+(c.boundMs*endpoint.AudioTokensPerSecond+999)/1000)*audioPrice + maxOut*outPrice
				cost = secs*fakeupstream.TranscribeTokensPerSecond*audioPrice + int64(len(prompt))*inPrice + fakeupstream.TranscribeOutputTokens*outPrice
			}
			answer := gjson.Get(b, "text").String()
			if len(c.fields) > 0 && c.fields[0][0] == "stream" && c.model != "whisper-test" {
				answer = map[bool]string{true: "streamed"}[strings.Contains(b, "transcript.text.done")]
			}
			if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != hold || o.Cost != cost || cost > hold || answer == "" {
				t.Fatalf("%s: status %d outcome %+v: %s; want hold %d, cost %d", c.name, st, o, b, hold, cost)
			}
			if ev := e.rec.events()[len(e.rec.events())-1]; ev.Cost != cost || ev.Estimated {
				t.Fatalf("%s: event %+v", c.name, ev)
			}
			spent += cost
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-spent {
			t.Fatalf("ledger %+v, want %d", a, testCredit-spent)
		}
		body, ct, _ := uploadForm(t, "gpt-4o-transcribe-nomax", "a.mp3", clean)
		st, _, b := e.postH(endpoint.Transcriptions.Path, e.key, body, map[string]string{"Content-Type": ct})
		if o := e.outcome(); st != http.StatusBadRequest || o.HoldAmount != 0 || gjson.Get(b, "error.param").String() != "model" {
			t.Fatalf("no max output: status %d outcome %+v: %s", st, o, b)
		}
	})
}
