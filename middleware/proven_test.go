package middleware

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// Proven and free endpoints (proven.go) over HTTP against internal/fakeupstream: moderations
// are free but counted by request limits; images per image and speech per character are held
// and charged exactly what the request proves.

// useFake sends the env's upstream requests to a fresh fake upstream.
func (e *testEnv) useFake() {
	fake := fakeupstream.New(fakeupstream.Options{KeepRequests: -1})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		r.Body = io.NopCloser(bytes.NewReader(body))
		fake.ServeHTTP(w, r)
	})
}

// TestModerationsFree: a moderation is served with a zero hold and a usage event of cost 0
// (attributed to its org, key and model): the ledger is unchanged; a requests limit counts it,
// so with a cap of 1 the next one is refused (429) and never reaches the upstream.
func TestModerationsFree(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, false, 20, balance.Limits{Version: 1}, nil)
		e.useFake()
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "lim_req", Scope: balance.Scope{Kind: balance.ScopeKey, ID: e.keyID}, Window: balance.Lifetime, Cap: 1, Unit: balance.Requests}}
		})
		body := `{"model":"omni-moderation-latest","input":"is this fine?"}`
		st, _, b := e.postH(endpoint.Moderations.Path, e.key, body, nil)
		o := e.outcome()
		if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != 0 || o.Cost != 0 {
			t.Fatalf("status %d outcome %+v: %s", st, o, b)
		}
		if !gjson.Get(b, "results.0.flagged").Exists() {
			t.Fatalf("body %s", b)
		}
		evs := e.rec.events()
		if len(evs) != 1 || evs[0].Cost != 0 || evs[0].Endpoint != endpoint.Moderations.Path || evs[0].Model != "omni-moderation-latest" ||
			evs[0].KeyID != e.keyID || evs[0].Org != e.org {
			t.Fatalf("events %+v", evs)
		}
		if a := e.accountOf(e.org); a.Balance != testCredit {
			t.Fatalf("ledger %+v: a free request changed it", a)
		}
		if s := e.state(); s.Exists && (s.Balance != testCredit || s.Held != 0) {
			t.Fatalf("hot balance %+v: money held for a free request", s)
		}
		// No model given: attributed to the upstream's default model.
		st, _, b = e.postH(endpoint.Moderations.Path, e.key, `{"input":"again"}`, nil)
		o = e.outcome()
		if st != http.StatusTooManyRequests || o.Kind != OutcomeRefused || !strings.Contains(b, "lim_req") {
			t.Fatalf("second moderation over a requests limit of 1: status %d outcome %+v: %s", st, o, b)
		}
		if n := len(e.upstreamRequests()); n != 1 {
			t.Fatalf("upstream called %d times", n)
		}
	})
}

// TestModerationsDefaultModel: a moderation without a model is attributed to the upstream's
// default (omni-moderation-latest), which needs no price.
func TestModerationsDefaultModel(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{mini: true, finish: true})
	e.useFake()
	st, _, b := e.postH(endpoint.Moderations.Path, e.key, `{"input":["a","b"]}`, nil)
	o := e.outcome()
	if st != http.StatusOK || o.Kind != OutcomeRecorded || o.Cost != 0 || len(gjson.Get(b, "results").Array()) != 2 {
		t.Fatalf("status %d outcome %+v: %s", st, o, b)
	}
	if evs := e.rec.events(); len(evs) != 1 || evs[0].Model != endpoint.Moderations.DefaultModel {
		t.Fatalf("events %+v", evs)
	}
}

// imageModel prices dall-e style images per image by size × quality (micro-units).
var imageModel = ledger.Model{Name: "dall-e-test", Prices: pricing.Prices{
	pricing.PerImage("1024x1024", "standard"): 40_000,
	pricing.PerImage("1024x1024", "hd"):       80_000,
	pricing.PerImage("1792x1024", "hd"):       120_000,
}}

// TestImagesPerImage: the hold is n × the per-image price of the size and quality asked for
// (the upstream's defaults when absent), known before the call, and the charge is exactly that
// for the n images returned; the org's ledger goes down by that much. n multiplies.
func TestImagesPerImage(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), imageModel))
		spent := int64(0)
		for _, c := range []struct {
			body string
			n    int64
			want int64
		}{
			{`{"model":"dall-e-test","prompt":"a cat"}`, 1, 40_000},
			{`{"model":"dall-e-test","prompt":"a cat","size":"1024x1024","quality":"hd"}`, 1, 80_000},
			{`{"model":"dall-e-test","prompt":"a cat","size":"1792x1024","quality":"hd","n":3,"response_format":"b64_json"}`, 3, 360_000},
			{`{"model":"dall-e-test","prompt":"a cat","n":4,"quality":"standard","style":"vivid"}`, 4, 160_000},
		} {
			st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, c.body, nil)
			o := e.outcome()
			if st != http.StatusOK || o.Kind != OutcomeRecorded {
				t.Fatalf("%s: status %d outcome %+v: %s", c.body, st, o, b)
			}
			if got := int64(len(gjson.Get(b, "data").Array())); got != c.n {
				t.Fatalf("%s: %d images returned, want %d", c.body, got, c.n)
			}
			if o.HoldAmount != c.want || o.Cost != c.want {
				t.Fatalf("%s: hold %d cost %d, want both %d", c.body, o.HoldAmount, o.Cost, c.want)
			}
			ev := e.rec.events()[len(e.rec.events())-1]
			if ev.Cost != c.want || ev.Estimated || ev.Endpoint != endpoint.ImagesGenerations.Path {
				t.Fatalf("%s: event %+v", c.body, ev)
			}
			spent += c.want
			if a := e.accountOf(e.org); a.Balance != testCredit-spent {
				t.Fatalf("%s: ledger %+v, want balance %d", c.body, a, testCredit-spent)
			}
		}
	})
}

// TestImagesUnpricedRefused: a size or quality the model has no per-image price for (or, for a
// token-billed gpt-image model, no published token count) is a 400 naming it, with nothing held, debited or sent upstream; so are n above 10 and streaming.
func TestImagesUnpricedRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{mini: true, finish: true})
	e.useFake()
	must(t, e.ledger.PutModel(context.Background(), imageModel))
	must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "gpt-image-test",
		Prices: pricing.Prices{pricing.Input: 5_000_000, pricing.ImageOutput: 40_000_000}}))
	for _, c := range []struct{ body, param, names string }{
		{`{"model":"dall-e-test","prompt":"a cat","size":"512x512"}`, "size", "per_image_512x512_standard"},
		{`{"model":"dall-e-test","prompt":"a cat","size":"1792x1024","quality":"standard"}`, "size", "per_image_1792x1024_standard"},
		{`{"model":"gpt-image-test","prompt":"a cat","size":"1792x1024","quality":"high"}`, "size", "'1792x1024'"},
		{`{"model":"gpt-image-test","prompt":"a cat","quality":"hd"}`, "size", "'hd'"},
		{`{"model":"dall-e-test","prompt":"a cat","n":11}`, "n", "10"},
		{`{"model":"dall-e-test","prompt":"a cat","stream":true}`, "stream", "Streaming"},
		{`{"model":"dall-e-test","prompt":"a cat","size":"1024x1024","quality":"h d"}`, "size", "'h d'"},
	} {
		st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, c.body, nil)
		o := e.outcome()
		if st != http.StatusBadRequest || o.Kind != OutcomeRefused || o.HoldAmount != 0 ||
			gjson.Get(b, "error.param").String() != c.param || !strings.Contains(gjson.Get(b, "error.message").String(), c.names) {
			t.Fatalf("%s: status %d outcome %+v: %s; want a 400 on %s naming %s", c.body, st, o, b, c.param, c.names)
		}
	}
	e.assertNothingDebited()
	if n := len(e.upstreamRequests()); n != 0 {
		t.Fatalf("%d refused requests reached the upstream", n)
	}
}

// speechModel prices text-to-speech per 1M characters: 15 per character.
var speechModel = ledger.Model{Name: "tts-test", Prices: pricing.Prices{pricing.Characters: 15_000_000}}

// TestSpeechPerCharacter: speech is held and charged the characters of its input (Unicode
// code points, after JSON unescaping) × the characters price, and the audio bytes pass through
// unchanged; a model without a characters price is refused with nothing held.
func TestSpeechPerCharacter(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), speechModel))
		input := "Héllo, wörld — ☃\n" // 17 characters, 23 bytes
		body := `{"model":"tts-test","voice":"alloy","input":"Héllo, wörld \u2014 ☃\n","response_format":"mp3"}`
		st, h, b := e.postH(endpoint.Speech.Path, e.key, body, nil)
		o := e.outcome()
		const want = 17 * 15
		if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != want || o.Cost != want {
			t.Fatalf("status %d outcome %+v, want hold = cost = %d", st, o, want)
		}
		if audio := fakeupstream.SpeechBytes(input, "alloy"); b != string(audio) || h.Get("Content-Type") != "audio/mpeg" {
			t.Fatalf("audio changed on the way: %q (%s), want %q", b, h.Get("Content-Type"), audio)
		}
		ev := e.rec.events()[0]
		if ev.Cost != want || ev.Estimated || ev.Usage.Of(pricing.Characters) != 17 {
			t.Fatalf("event %+v", ev)
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-want {
			t.Fatalf("ledger %+v", a)
		}

		// A model without a characters price (priced per token only) is refused.
		st, _, b = e.postH(endpoint.Speech.Path, e.key, `{"model":"`+testModel+`","voice":"alloy","input":"hi"}`, nil)
		o = e.outcome()
		if st != http.StatusBadRequest || o.Kind != OutcomeRefused || o.HoldAmount != 0 || !strings.Contains(b, "characters") {
			t.Fatalf("status %d outcome %+v: %s", st, o, b)
		}
		if n := len(e.upstreamRequests()); n != 1 {
			t.Fatalf("upstream called %d times", n)
		}
	})
}

// form builds a multipart/form-data body: fields (name, value) in order, and an image file.
func form(t *testing.T, fields ...[2]string) (string, string) {
	t.Helper()
	var b bytes.Buffer
	w := multipart.NewWriter(&b)
	for _, f := range fields {
		must(t, w.WriteField(f[0], f[1]))
	}
	fw, err := w.CreateFormFile("image", "cat.png")
	must(t, err)
	_, _ = fw.Write([]byte("\x89PNG\r\n\x1a\n fake image bytes \x00\xff"))
	must(t, w.Close())
	return b.String(), w.FormDataContentType()
}

// TestImagesEditsMultipart: an image edit (multipart) is priced like a generation — n × the
// per-image price of its size and quality, held and charged exactly — and its body reaches the
// upstream byte for byte; a routed model is renamed in the form with the file intact. A field
// escrow reads that comes twice, as a file or in another spelling, an unpriced size, and a body
// that is not multipart are refused with nothing held.
func TestImagesEditsMultipart(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true, cfg: func(c *Config) {
			c.Route = func(_ echo.Context, model string) (string, error) {
				if model == "dall-e-routed" {
					return "dall-e-test", nil
				}
				return "", nil
			}
		}})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), imageModel))
		must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "dall-e-routed", Prices: imageModel.Prices}))
		path := endpoint.ImagesEdits.Path
		body, ct := form(t, [2]string{"model", "dall-e-test"}, [2]string{"prompt", "a hat"}, [2]string{"n", "2"}, [2]string{"size", "1024x1024"})
		st, _, b := e.postH(path, e.key, body, map[string]string{"Content-Type": ct})
		o := e.outcome()
		if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != 80_000 || o.Cost != 80_000 || len(gjson.Get(b, "data").Array()) != 2 {
			t.Fatalf("status %d outcome %+v: %s", st, o, b)
		}
		if sent := e.lastSent(); string(sent) != body {
			t.Fatalf("the upstream got another body:\n%q\nwant\n%q", sent, body)
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-80_000 {
			t.Fatalf("ledger %+v", a)
		}

		// Routed: the form's model is renamed, everything else kept.
		body, ct = form(t, [2]string{"prompt", "a hat"}, [2]string{"model", "dall-e-routed"}, [2]string{"quality", "hd"})
		st, _, b = e.postH(path, e.key, body, map[string]string{"Content-Type": ct})
		if o = e.outcome(); st != http.StatusOK || o.Cost != 80_000 {
			t.Fatalf("routed: status %d outcome %+v: %s", st, o, b)
		}
		if want := strings.Replace(body, "dall-e-routed", "dall-e-test", 1); string(e.lastSent()) != want {
			t.Fatalf("routed body:\n%q\nwant\n%q", e.lastSent(), want)
		}
		ups := len(e.upstreamRequests())

		for _, c := range []struct {
			fields [][2]string
			ct     string
			param  string
		}{
			{[][2]string{{"model", "dall-e-test"}, {"n", "1"}, {"n", "5"}}, "", "n"},
			{[][2]string{{"model", "dall-e-test"}, {"N", "5"}}, "", "n"},
			{[][2]string{{"model", "dall-e-test"}, {"n", " 5"}}, "", "n"},
			{[][2]string{{"model", "dall-e-test"}, {"n", "11"}}, "", "n"},
			{[][2]string{{"model", "dall-e-test"}, {"size", "512x512"}}, "", "size"},
			{[][2]string{{"model", "dall-e-test"}, {"stream", "true"}}, "", "stream"},
			{[][2]string{{"model", "dall-e-test"}}, "application/json", ""},
		} {
			body, ct := form(t, c.fields...)
			if c.ct != "" {
				ct = c.ct
			}
			st, _, b := e.postH(path, e.key, body, map[string]string{"Content-Type": ct})
			o := e.outcome()
			if st != http.StatusBadRequest || o.Kind != OutcomeRefused || o.HoldAmount != 0 || gjson.Get(b, "error.param").String() != c.param {
				t.Fatalf("%v (%s): status %d outcome %+v: %s, want a 400 on %q", c.fields, c.ct, st, o, b, c.param)
			}
		}
		// A quoted-printable field is read raw, as a Python upstream reads it: "=32" is no n.
		var qp bytes.Buffer
		w := multipart.NewWriter(&qp)
		must(t, w.WriteField("model", "dall-e-test"))
		pw, err := w.CreatePart(textproto.MIMEHeader{"Content-Disposition": {`form-data; name="n"`}, "Content-Transfer-Encoding": {"quoted-printable"}})
		must(t, err)
		_, _ = pw.Write([]byte("=32"))
		must(t, w.Close())
		st, _, b = e.postH(path, e.key, qp.String(), map[string]string{"Content-Type": w.FormDataContentType()})
		if o = e.outcome(); st != http.StatusBadRequest || o.HoldAmount != 0 || gjson.Get(b, "error.param").String() != "n" {
			t.Fatalf("quoted-printable n: status %d outcome %+v: %s", st, o, b)
		}
		if n := len(e.upstreamRequests()); n != ups {
			t.Fatalf("refused edits reached the upstream: %d", n-ups)
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-160_000 {
			t.Fatalf("ledger %+v", a)
		}
	})
}

// wav is a PCM WAV file of the given duration: 16 kHz, mono, 16 bits (32,000 bytes a second).
func wav(ms int) []byte {
	const rate, align = 16_000, 2
	data := make([]byte, rate*align*ms/1000)
	b := []byte("RIFF\x00\x00\x00\x00WAVEfmt ")
	b = binary.LittleEndian.AppendUint32(b, 16)
	b = binary.LittleEndian.AppendUint16(b, 1) // PCM
	b = binary.LittleEndian.AppendUint16(b, 1) // mono
	b = binary.LittleEndian.AppendUint32(b, rate)
	b = binary.LittleEndian.AppendUint32(b, rate*align)
	b = binary.LittleEndian.AppendUint16(b, align)
	b = binary.LittleEndian.AppendUint16(b, 16)
	b = append(b, "data"...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(data)))
	b = append(b, data...)
	binary.LittleEndian.PutUint32(b[4:], uint32(len(b)-8))
	return b
}

// audioForm is a transcription upload of file with the model.
func audioForm(t *testing.T, model string, file []byte) (string, string) {
	t.Helper()
	var b bytes.Buffer
	w := multipart.NewWriter(&b)
	must(t, w.WriteField("model", model))
	fw, err := w.CreateFormFile("file", "speech.wav")
	must(t, err)
	_, _ = fw.Write(file)
	must(t, w.Close())
	return b.String(), w.FormDataContentType()
}

// TestTranscriptionsPerSecond: a transcription or translation of a PCM WAV upload is held and
// charged its duration rounded up to the second × the audio_second price — the duration the
// upstream reports; an upload of no format escrow can bound (or a WAV cut before its samples)
// and a model without an audio_second price are refused with nothing held.
func TestTranscriptionsPerSecond(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "whisper-test", Prices: pricing.Prices{pricing.AudioSecond: 100}}))
		spent := int64(0)
		for _, c := range []struct {
			path string
			ms   int
		}{{endpoint.Transcriptions.Path, 2500}, {endpoint.Translations.Path, 1000}, {endpoint.Transcriptions.Path, 61_001}} {
			body, ct := audioForm(t, "whisper-test", wav(c.ms))
			st, _, b := e.postH(c.path, e.key, body, map[string]string{"Content-Type": ct})
			o := e.outcome()
			want := int64((c.ms+999)/1000) * 100
			if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != want || o.Cost != want ||
				gjson.Get(b, "usage.seconds").Int()*100 != want {
				t.Fatalf("%s %d ms: status %d outcome %+v: %s; want hold = cost = %d", c.path, c.ms, st, o, b, want)
			}
			spent += want
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-spent {
			t.Fatalf("ledger %+v, want %d", a, testCredit-spent)
		}
		ups := len(e.upstreamRequests())
		for _, c := range []struct {
			model string
			file  []byte
		}{{"whisper-test", []byte("no audio format at all")}, {"whisper-test", wav(1000)[:40]}, {testModel, wav(1000)}} {
			body, ct := audioForm(t, c.model, c.file)
			st, _, b := e.postH(endpoint.Transcriptions.Path, e.key, body, map[string]string{"Content-Type": ct})
			if o := e.outcome(); st != http.StatusBadRequest || o.HoldAmount != 0 {
				t.Fatalf("%s (%d bytes): status %d outcome %+v: %s", c.model, len(c.file), st, o, b)
			}
		}
		if n := len(e.upstreamRequests()); n != ups {
			t.Fatalf("refused uploads reached the upstream: %d", n-ups)
		}
	})
}
