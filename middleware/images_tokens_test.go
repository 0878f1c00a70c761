package middleware

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// gptImageModel is token-billed (an image_output price): 5 per text input token, 10 per image
// input token, 40 per image output token (micro-units).
var gptImageModel = ledger.Model{Name: "gpt-image-test", Prices: pricing.Prices{
	pricing.Input: 5_000_000, pricing.ImageInput: 10_000_000, pricing.ImageOutput: 40_000_000,
}}

// TestImagesTokens (issue 32): generations and edits of a gpt-image model are held at their
// bound — the body's text bytes and each uploaded image (at endpoint.MaxInputImageTokens) at the
// highest input price, n × the published output tokens of the size and quality (auto: the
// largest) at the highest output price — and charged exactly the usage the answer reports
// (input text and image tokens, output image tokens), which the fake bills at its most.
func TestImagesTokens(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), gptImageModel))
		spent := int64(0)
		check := func(name, path, body, ct, prompt string, textBytes, files, n int64, size, quality string, perImage int64) {
			t.Helper()
			hdr := map[string]string{}
			if ct != "" {
				hdr["Content-Type"] = ct
			}
			st, _, b := e.postH(path, e.key, body, hdr)
			o := e.outcome()
			want, ok := fakeupstream.GPTImageUsage(prompt, int(files), n, size, quality)
			if !ok {
				t.Fatalf("%s: the fake has no usage for %s %s", name, size, quality)
			}
			cost := want.InputDetails.TextTokens*5 + want.InputDetails.ImageTokens*10 + want.OutputTokens*40
			hold := (textBytes+files*endpoint.MaxInputImageTokens)*10 + n*perImage*40
			if st != http.StatusOK || o.Kind != OutcomeRecorded || o.HoldAmount != hold || o.Cost != cost || cost > hold ||
				gjson.Get(b, "usage.output_tokens").Int() != want.OutputTokens || int64(len(gjson.Get(b, "data").Array())) != n {
				t.Fatalf("%s: status %d outcome %+v: %.300s; want hold %d, cost %d", name, st, o, b, hold, cost)
			}
			ev := e.rec.events()[len(e.rec.events())-1]
			if ev.Cost != cost || ev.Estimated || ev.Usage.Of(pricing.ImageOutput) != want.OutputTokens ||
				ev.Usage.Of(pricing.ImageInput) != want.InputDetails.ImageTokens || ev.Usage.Prompt != want.InputTokens {
				t.Fatalf("%s: event %+v, want the answer's usage %+v", name, ev, want)
			}
			spent += cost
			if a := e.accountOf(e.org); a.Balance != testCredit-spent {
				t.Fatalf("%s: ledger %+v, want %d", name, a, testCredit-spent)
			}
		}
		gen := endpoint.ImagesGenerations.Path
		b := `{"model":"gpt-image-test","prompt":"a cat in a hat","n":2,"size":"1024x1024","quality":"low"}`
		check("low, n=2", gen, b, "", "a cat in a hat", int64(len(b)), 0, 2, "1024x1024", "low", 272)
		b = `{"model":"gpt-image-test","prompt":"a cat"}` // auto size and quality: the largest the upstream may pick
		check("auto", gen, b, "", "a cat", int64(len(b)), 0, 1, "", "", 6240)
		b = `{"model":"gpt-image-test","prompt":"a cat","size":"1536x1024","quality":"high","n":2,"background":"transparent"}`
		check("high, n=2", gen, b, "", "a cat", int64(len(b)), 0, 2, "1536x1024", "high", 6208)

		fields := [][2]string{{"model", "gpt-image-test"}, {"prompt", "add a hat"}, {"quality", "medium"}, {"size", "1024x1024"}}
		body, ct := form(t, fields...)
		var text int64
		for _, f := range fields {
			text += int64(len(f[1]))
		}
		check("edit", endpoint.ImagesEdits.Path, body, ct, "add a hat", text, 1, 1, "1024x1024", "medium", 1056)
	})
}

// TestImagesTokensStream (issue 32): a gpt-image generation or edit streamed with partial
// images is held at its bound with partial_images × 100 output tokens added, passes its events
// to the client, and is charged the usage of its image_generation.completed
// (image_edit.completed) event; a stream of more than one image, or of a per-image model, and
// partial_images above 3 are refused with nothing held.
func TestImagesTokensStream(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newEnv(t, envOpt{mini: mini, finish: true})
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), gptImageModel))
		must(t, e.ledger.PutModel(context.Background(), imageModel))
		spent := int64(0)
		for _, c := range []struct {
			name, path, body, ct, prompt string
			textBytes, files             int64
			quality, event               string
		}{
			{name: "generation", path: endpoint.ImagesGenerations.Path, prompt: "a cat", quality: "low", event: "image_generation",
				body: `{"model":"gpt-image-test","prompt":"a cat","size":"1024x1024","quality":"low","stream":true,"partial_images":2}`},
			{name: "edit", path: endpoint.ImagesEdits.Path, prompt: "add a hat", quality: "medium", event: "image_edit", files: 1},
		} {
			if c.body == "" {
				fields := [][2]string{{"model", "gpt-image-test"}, {"prompt", c.prompt}, {"quality", c.quality}, {"size", "1024x1024"},
					{"stream", "true"}, {"partial_images", "2"}}
				c.body, c.ct = form(t, fields...)
				for _, f := range fields {
					c.textBytes += int64(len(f[1]))
				}
			} else {
				c.textBytes = int64(len(c.body))
			}
			hdr := map[string]string{}
			if c.ct != "" {
				hdr["Content-Type"] = c.ct
			}
			st, h, b := e.postH(c.path, e.key, c.body, hdr)
			o := e.outcome()
			want, _ := fakeupstream.GPTImageUsage(c.prompt, int(c.files), 1, "1024x1024", c.quality)
			want.OutputTokens += 2 * fakeupstream.PartialImageTokens
			perImage, _ := endpoint.ImageOutputTokens("1024x1024", c.quality)
			hold := (c.textBytes+c.files*endpoint.MaxInputImageTokens)*10 + (perImage+2*endpoint.PartialImageTokens)*40
			cost := want.InputDetails.TextTokens*5 + want.InputDetails.ImageTokens*10 + want.OutputTokens*40
			if st != http.StatusOK || !strings.HasPrefix(h.Get("Content-Type"), "text/event-stream") || o.Kind != OutcomeRecorded ||
				o.HoldAmount != hold || o.Cost != cost || strings.Count(b, c.event+".partial_image") != 4 || !strings.Contains(b, c.event+".completed") {
				t.Fatalf("%s: status %d outcome %+v: %.400s; want hold %d, cost %d", c.name, st, o, b, hold, cost)
			}
			ev := e.rec.events()[len(e.rec.events())-1]
			if ev.Cost != cost || ev.Estimated || ev.Usage.Of(pricing.ImageOutput) != want.OutputTokens {
				t.Fatalf("%s: event %+v, want the completed event's usage %+v", c.name, ev, want)
			}
			spent += cost
		}
		if a := e.accountOf(e.org); a.Balance != testCredit-spent {
			t.Fatalf("ledger %+v, want %d", a, testCredit-spent)
		}
		ups := len(e.upstreamRequests())
		for _, c := range []struct{ body, param string }{
			{`{"model":"gpt-image-test","prompt":"a cat","stream":true,"n":2}`, "n"},
			{`{"model":"gpt-image-test","prompt":"a cat","stream":true,"partial_images":4}`, "partial_images"},
			{`{"model":"dall-e-test","prompt":"a cat","stream":true}`, "stream"},
		} {
			st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, c.body, nil)
			if o := e.outcome(); st != http.StatusBadRequest || o.HoldAmount != 0 || gjson.Get(b, "error.param").String() != c.param {
				t.Fatalf("%s: status %d outcome %+v: %s; want a 400 on %s", c.body, st, o, b, c.param)
			}
		}
		if n := len(e.upstreamRequests()); n != ups {
			t.Fatalf("refused streams reached the upstream: %d", n-ups)
		}
	})
}

// TestImagesTokensLimit: a token-billed image request holds its token bound on a tokens limit,
// so a bound above the limit's room is refused (429) before the upstream is called; one within
// it is served and counted.
func TestImagesTokensLimit(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, false, 20, balance.Limits{Version: 1}, nil)
		e.useFake()
		must(t, e.ledger.PutModel(context.Background(), gptImageModel))
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "lim_tok", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Lifetime, Cap: 1000, Unit: balance.Tokens}}
		})
		small := `{"model":"gpt-image-test","prompt":"a cat","size":"1024x1024","quality":"low"}` // bound: its bytes + 272
		st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, small, nil)
		if o := e.outcome(); st != http.StatusOK || o.Kind != OutcomeRecorded {
			t.Fatalf("within the limit: status %d outcome %+v: %s", st, o, b)
		}
		big := `{"model":"gpt-image-test","prompt":"a cat","size":"1024x1024","quality":"medium"}` // 1,056 output tokens
		st, _, b = e.postH(endpoint.ImagesGenerations.Path, e.key, big, nil)
		if o := e.outcome(); st != http.StatusTooManyRequests || o.Kind != OutcomeRefused || !strings.Contains(b, "lim_tok") {
			t.Fatalf("above the tokens limit: status %d outcome %+v: %s", st, o, b)
		}
		if n := len(e.upstreamRequests()); n != 1 {
			t.Fatalf("upstream called %d times, want 1", n)
		}
	})
}

// TestImagesTokensNoUsage: a gpt-image answer without a usage escrow can read (none, or one
// with a class the model has no price for) is charged the hold, the bound, marked estimated; a
// dall-e answer that carries a usage is still charged its images (the usage is not read).
func TestImagesTokensNoUsage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{mini: true, finish: true})
	must(t, e.ledger.PutModel(context.Background(), gptImageModel))
	must(t, e.ledger.PutModel(context.Background(), imageModel))
	answer := `{"created":1,"data":[{"b64_json":"eA=="}]}`
	e.setUpstream(func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(answer))
	})
	body := `{"model":"gpt-image-test","prompt":"a cat","size":"1024x1024","quality":"low"}`
	hold := int64(len(body))*10 + 272*40
	for _, a := range []string{
		`{"created":1,"data":[{"b64_json":"eA=="}]}`,
		`{"created":1,"data":[{"b64_json":"eA=="}],"usage":{"input_tokens":"many","output_tokens":1}}`,
	} {
		answer = a
		st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, body, nil)
		o := e.outcome()
		if ev := e.rec.events()[len(e.rec.events())-1]; st != http.StatusOK || o.HoldAmount != hold || o.Cost != hold || !ev.Estimated {
			t.Fatalf("%s: status %d outcome %+v event %+v: %s; want the hold %d charged, estimated", a, st, o, ev, b, hold)
		}
	}
	answer = `{"created":1,"data":[{"b64_json":"eA=="}],"usage":{"input_tokens":1,"output_tokens":1}}`
	st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, `{"model":"dall-e-test","prompt":"a cat"}`, nil)
	if o := e.outcome(); st != http.StatusOK || o.HoldAmount != 40_000 || o.Cost != 40_000 {
		t.Fatalf("dall-e with a usage: status %d outcome %+v: %s", st, o, b)
	}
}

// TestImagesTokensModelMax: Config.ImageOutputTokens replaces the published table for a model
// whose images bill more: the hold is n × that max, whatever the size and quality (one the
// table does not know included), and the charge the answer's usage.
func TestImagesTokensModelMax(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{mini: true, finish: true, cfg: func(c *Config) { c.ImageOutputTokens = map[string]int64{"gpt-image-test": 9000} }})
	e.useFake()
	must(t, e.ledger.PutModel(context.Background(), gptImageModel))
	body := `{"model":"gpt-image-test","prompt":"a cat","size":"1024x1024","quality":"low"}`
	st, _, b := e.postH(endpoint.ImagesGenerations.Path, e.key, body, nil)
	o := e.outcome()
	want, _ := fakeupstream.GPTImageUsage("a cat", 0, 1, "1024x1024", "low")
	if hold, cost := int64(len(body))*10+9000*40, want.InputTokens*5+want.OutputTokens*40; st != http.StatusOK || o.HoldAmount != hold || o.Cost != cost {
		t.Fatalf("status %d outcome %+v: %s; want hold %d, cost %d", st, o, b, hold, cost)
	}
	// A size the table does not know is bounded by the model's max (the fake refuses it: released).
	st, _, b = e.postH(endpoint.ImagesGenerations.Path, e.key, `{"model":"gpt-image-test","prompt":"a cat","size":"2048x2048"}`, nil)
	if o := e.outcome(); st != http.StatusBadRequest || o.Kind == OutcomeRefused || o.HoldAmount == 0 {
		t.Fatalf("unknown size with a model max: status %d outcome %+v: %s; want held, then the upstream's 400", st, o, b)
	}
}
