package middleware

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// FuzzSpecBound is the property of DESIGN "Endpoints" over every billed spec: for any body
// escrow accepts, with or without fit,
//
//   - the cap the upstream reads in the forwarded body (the endpoint's own field, as the fake
//     reads it) is at most the cap the hold priced, and
//   - the hold is at least what the fake upstream in Worst mode bills for that forwarded body
//     (every byte of its input fields, each image's most, the tool preamble, every token of the
//     cap it reads or its full default of 40,000 — above every model max — without one, × n / best_of × prompts).
//
// It runs the middleware's own steps (parseRequest, the accept checks, partTokens, HoldAmount,
// planFit and fitCap on a random room, capBody) and the fake's handler in process.
func FuzzSpecBound(f *testing.F) {
	for _, s := range []string{"", "\x01\x02\x03\x04", "\x07\x00\x05\x09\x02\x01\x08", strings.Repeat("\x03\x01\x04", 30),
		strings.Repeat("\x09\x08\x07\x06\x05\x04", 20), strings.Repeat("\xff\x10", 40)} {
		for ep := range uint8(5) {
			f.Add([]byte(s), ep)
		}
	}
	f.Fuzz(func(t *testing.T, choices []byte, ep uint8) { checkSpecBound(t, choices, ep) })
}

var (
	fuzzSpecs = []*endpoint.Spec{endpoint.Chat, endpoint.Completions, endpoint.Embeddings, endpoint.Responses, endpoint.Messages}
	fuzzFake  = fakeupstream.New(fakeupstream.Options{Worst: true, MaxOutputTokens: 40_000, KeepRequests: -1})
	fuzzMW    = &middleware{cfg: Config{FitMinOutputTokens: 256}}
)

// checkSpecBound checks FuzzSpecBound's property for one generated body; it reports whether the
// body was accepted and whether it was fitted.
func checkSpecBound(t *testing.T, choices []byte, ep uint8) (accepted, fitted bool) {
	t.Helper()
	spec, m := fuzzSpecs[int(ep)%len(fuzzSpecs)], fuzzMW
	g := &specGen{b: choices}
	model := ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 8_000_000},
		MaxInputTokens: 200_000, MaxOutputTokens: []int64{16, 1000, 32_768}[g.pick(3)]}
	if spec.Bills(pricing.CacheWrite) {
		model.Prices[pricing.CacheWrite], model.Prices[pricing.CacheWrite1h] = 1_250_000, 2_000_000
	}
	body := g.body(spec)
	r, e := parseRequest(spec.Path, []byte(body))
	if e != nil || r.Background || len(r.Features) > 0 || (r.OutputCap > model.MaxOutputTokens) {
		return false, false // refused before anything is held
	}
	r.PartTokens = m.partTokens(model.Name, r)
	learned := []int64{0, 32, 5000, 1 << 30}[g.pick(4)]
	hold, err := HoldAmount(t.Context(), HoldInput{Request: r, Model: model, LearnedMax: learned, Fallback: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if avail := int64(g.pick(1<<8) * g.pick(1<<8)); g.pick(2) == 0 && avail < hold {
		// A poorer org: fit, as reserveHold does, or a refusal.
		plan := m.planFit(false, model, r, hold)
		if !plan.on {
			return false, false
		}
		c, b, ok := fitCap(model, r, plan.minCap, plan.cap, room{money: avail})
		if !ok {
			return false, false
		}
		r.OutputCap, hold, fitted = c, b, true
	}
	held := outputCapOf(model, r)
	sent := []byte(body)
	if held > 0 {
		sent = m.capBody(sent, r, held)
	}
	if !spec.NoOutput {
		read := int64(0)
		for _, f := range spec.CapFields { // the fake reads the first present (chat: max_completion_tokens)
			if v := gjson.GetBytes(sent, f); v.Exists() && v.Type != gjson.Null {
				read = v.Int()
				break
			}
		}
		if read <= 0 || read > held {
			t.Fatalf("the upstream reads a cap of %d, the hold priced %d: %s → %s", read, held, body, sent)
		}
		if b := gjson.GetBytes(sent, "thinking.budget_tokens"); fitted && r.ThinkingBudget > 0 && (b.Int() >= read || b.Int() < spec.ThinkingMin) {
			t.Fatalf("a fitted budget of %d with a cap of %d: %s", b.Int(), read, sent)
		}
	}
	rec := httptest.NewRecorder()
	fuzzFake.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, spec.Path, bytes.NewReader(sent)))
	if rec.Code != http.StatusOK {
		return true, fitted // refused upstream: released, nothing billed
	}
	u := rec.Body.Bytes()
	usage := pricing.Usage{
		Prompt:     gjson.GetBytes(u, "usage.prompt_tokens").Int() + gjson.GetBytes(u, "usage.input_tokens").Int(),
		Completion: gjson.GetBytes(u, "usage.completion_tokens").Int() + gjson.GetBytes(u, "usage.output_tokens").Int(),
	}
	cost, err := model.Cost(usage)
	if err != nil {
		t.Fatal(err)
	}
	if cost > hold {
		t.Fatalf("%s: the upstream bills %d (%+v) for %s, above the hold %d (bounded %v, cap %d)", spec.Path, cost, usage, sent, hold, r.Bounded, held)
	}
	return true, fitted
}

// TestSpecBoundRandom runs FuzzSpecBound's property over 5,000 random bodies (make test does
// not fuzz) and checks it is not vacuous: every spec accepts bodies, and fits some.
func TestSpecBoundRandom(t *testing.T) {
	t.Parallel()
	rnd := rand.New(rand.NewPCG(32, 32))
	accepted, fitted := map[int]int{}, map[int]int{}
	b := make([]byte, 256)
	for i := range 5_000 {
		for j := range b {
			b[j] = byte(rnd.IntN(256))
		}
		a, f := checkSpecBound(t, b, uint8(i%len(fuzzSpecs)))
		if a {
			accepted[i%len(fuzzSpecs)]++
		}
		if f {
			fitted[i%len(fuzzSpecs)]++
		}
	}
	for i, s := range fuzzSpecs {
		if accepted[i] < 50 || (!s.NoOutput && fitted[i] < 1) {
			t.Errorf("%s: %d accepted, %d fitted of 1,000: the property is barely exercised", s.Path, accepted[i], fitted[i])
		}
	}
	t.Logf("accepted %v, fitted %v", accepted, fitted)
}

// specGen builds a request body of a spec from fuzz bytes: its own cap fields and those of other
// endpoints (present, null or absent), choices, prompt arrays, text, images of any detail, files,
// tools, functions, thinking, server-side context and unknown fields.
type specGen struct {
	b []byte
	i int
}

func (g *specGen) pick(n int) int {
	if g.i >= len(g.b) || n <= 1 {
		return 0
	}
	v := int(g.b[g.i]) % n
	g.i++
	return v
}

func (g *specGen) num(maxV int) string { return strconv.Itoa(1 + g.pick(maxV)) }

func (g *specGen) text() string {
	return strconv.Quote(strings.Repeat([]string{"hi ", "a1", "tell me ", "x"}[g.pick(4)], 1+g.pick(40)))
}

func (g *specGen) body(spec *endpoint.Spec) string {
	var fs []string
	add := func(k, v string) { fs = append(fs, strconv.Quote(k)+":"+v) }
	add("model", `"m"`)
	for _, c := range endpoint.CapNames {
		switch g.pick(6) {
		case 0:
			add(c, "null")
		case 1:
			add(c, []string{"1", "16", "255", "256", "999", "1000", "1025", "32768", "40000"}[g.pick(9)])
		case 2:
			if spec.Reads(c) {
				add(c, g.num(2000))
			}
		}
	}
	if g.pick(3) == 0 {
		add("n", g.num(4))
	}
	if g.pick(4) == 0 {
		add("best_of", g.num(4))
	}
	if g.pick(6) == 0 {
		add("foo", `{"bar":1}`)
	}
	switch spec {
	case endpoint.Chat:
		add("messages", "["+g.openAIMessage("text", "image_url")+"]")
		g.tools(add)
	case endpoint.Responses:
		if g.pick(2) == 0 {
			add("input", g.text())
		} else {
			add("input", "["+g.openAIMessage("input_text", "input_image")+"]")
		}
		if g.pick(5) == 0 {
			add("previous_response_id", `"resp_1"`)
		}
		g.tools(add)
	case endpoint.Completions:
		if g.pick(2) == 0 {
			add("prompt", g.text())
		} else {
			ps := make([]string, 1+g.pick(4))
			for i := range ps {
				ps[i] = g.text()
			}
			add("prompt", "["+strings.Join(ps, ",")+"]")
		}
	case endpoint.Embeddings:
		add("input", g.text())
	case endpoint.Messages:
		var blocks []string
		for range 1 + g.pick(3) {
			switch g.pick(3) {
			case 0:
				blocks = append(blocks, `{"type":"image","source":{"type":"url","url":"https://x/y.png"}}`)
			default:
				blocks = append(blocks, `{"type":"text","text":`+g.text()+`}`)
			}
		}
		add("messages", `[{"role":"user","content":[`+strings.Join(blocks, ",")+`]}]`)
		if g.pick(3) == 0 {
			add("tools", `[{"name":"f","input_schema":{"type":"object","properties":{"q":{"type":"string"}}}}]`)
		}
		if g.pick(2) == 0 {
			add("thinking", `{"type":"enabled","budget_tokens":`+[]string{"1024", "2000", "30000", "50000"}[g.pick(4)]+`}`)
		}
	}
	// Shuffle a little: members in any order.
	for i := len(fs) - 1; i > 0; i-- {
		j := g.pick(i + 1)
		fs[i], fs[j] = fs[j], fs[i]
	}
	return "{" + strings.Join(fs, ",") + "}"
}

// openAIMessage is a user message whose content is a string or parts: text, images of any
// detail, a file.
func (g *specGen) openAIMessage(textType, imageType string) string {
	if g.pick(3) == 0 {
		return `{"role":"user","content":` + g.text() + `}`
	}
	var parts []string
	for range 1 + g.pick(4) {
		detail := []string{"", `,"detail":"low"`, `,"detail":"high"`, `,"detail":"auto"`}[g.pick(4)]
		switch g.pick(5) {
		case 0, 1:
			parts = append(parts, `{"type":"`+textType+`","text":`+g.text()+`}`)
		case 2, 3:
			if imageType == "image_url" {
				parts = append(parts, `{"type":"image_url","image_url":{"url":"https://x/y.png"`+detail+`}}`)
			} else {
				parts = append(parts, `{"type":"input_image","image_url":"https://x/y.png"`+detail+`}`)
			}
		case 4:
			parts = append(parts, `{"type":"file","file":{"file_id":"file-1"}}`)
		}
	}
	b, _ := json.Marshal(json.RawMessage("[" + strings.Join(parts, ",") + "]"))
	return `{"role":"user","content":` + string(b) + `}`
}

func (g *specGen) tools(add func(k, v string)) {
	switch g.pick(4) {
	case 0:
		add("tools", `[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]`)
	case 1:
		add("functions", `[{"name":"f","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}]`)
	}
}
