package middleware

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// The proven endpoints (images per image, speech per character) are outside FuzzSpecBound's
// cap property: they have no output cap. Their property is stronger: for any body escrow
// accepts, the hold is the charge, and what the upstream bills for the same bytes — the images
// it returns at the size and quality it read, the characters of the input it read (encoding/json,
// as the fake and most Python and Go servers decode) — is at most that (FuzzProvenBound).

var provenModel = ledger.Model{Name: "m", Prices: pricing.Prices{
	pricing.PerImage("1024x1024", "standard"): 40_000,
	pricing.PerImage("1024x1024", "hd"):       80_000,
	pricing.PerImage("1792x1024", "hd"):       120_000,
	pricing.Characters:                        15_000_000,
}}

var provenFake = fakeupstream.New(fakeupstream.Options{KeepRequests: -1})

// checkProvenBound checks the property for one generated body; it reports whether escrow
// accepted it.
func checkProvenBound(t *testing.T, choices []byte, images bool) bool {
	t.Helper()
	g := &specGen{b: choices}
	spec := endpoint.Speech
	if images {
		spec = endpoint.ImagesGenerations
	}
	body := provenBody(g, images)
	r, e := parseRequest(spec.Path, []byte(body))
	if e != nil || provenPriced(provenModel, *r.Proof) != nil {
		return false
	}
	hold, err := provenModel.Cost(*r.Proof)
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	provenFake.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, spec.Path, bytes.NewReader([]byte(body))))
	if rec.Code != http.StatusOK {
		return true // refused upstream: released, nothing billed
	}
	var read struct {
		N             *int64
		Size, Quality string
		Input         json.RawMessage
	}
	if err := json.Unmarshal([]byte(body), &read); err != nil {
		t.Fatalf("the fake served a body it cannot decode: %s", body)
	}
	var bill pricing.Usage
	if images {
		size, quality := cmpOr(read.Size, endpoint.DefaultImageSize), cmpOr(read.Quality, endpoint.DefaultImageQuality)
		bill = pricing.Usage{}.With(pricing.PerImage(size, quality), int64(len(gjson.GetBytes(rec.Body.Bytes(), "data").Array())))
	} else {
		var s string
		_ = json.Unmarshal(read.Input, &s)
		bill = pricing.Usage{}.With(pricing.Characters, int64(utf8.RuneCountInString(s)))
	}
	if !bill.Equal(*r.Proof) {
		t.Fatalf("%s: escrow proves %+v, the upstream read %+v", body, *r.Proof, bill)
	}
	if cost, err := provenModel.Cost(bill); err != nil || cost > hold {
		t.Fatalf("%s: the upstream bills %d (%v), above the hold %d", body, cost, err, hold)
	}
	return true
}

func cmpOr(a, b string) string {
	if a == "" {
		return b
	}
	return a
}

// provenBody builds an images or speech body from fuzz bytes: n, size and quality (valid,
// unpriced, null, of the wrong kind), variant spellings and duplicates of them, escaped
// strings, stream and unknown fields.
func provenBody(g *specGen, images bool) string {
	var members []string
	add := func(k, v string) { members = append(members, `"`+k+`":`+v) }
	add("model", `"m"`)
	if images {
		add("prompt", `"a cat"`)
		if v := []string{"", "null", "1", "3", "10", "11", "0", "-2", `"3"`, "2.0", "2.5"}[g.pick(11)]; v != "" {
			add([]string{"n", "n", "N", `n `}[g.pick(4)], v)
		}
		if v := []string{"", "null", `"1024x1024"`, `"1792x1024"`, `"512x512"`, `"1024X1024"`, `"1024\u00781024"`, "5"}[g.pick(8)]; v != "" {
			add([]string{"size", "size", "Size"}[g.pick(3)], v)
		}
		if v := []string{"", "null", `"hd"`, `"standard"`, `"HD"`, `"h\u0064"`, `"auto"`, "true"}[g.pick(8)]; v != "" {
			add([]string{"quality", "quality", "QUALITY"}[g.pick(3)], v)
		}
		if g.pick(6) == 0 {
			add("n", "7") // a duplicate (or the first n)
		}
	} else {
		add("voice", `"alloy"`)
		if v := []string{"", "null", `"hi"`, `"Héllo \u2014 wörld"`, `"\ud83d\ude00 x"`, `"\ud800 lone"`, `"a\nb\\\"c"`, `""`, "12", `["x"]`,
			`"` + strings.Repeat("é", 300) + `"`}[g.pick(11)]; v != "" {
			add([]string{"input", "input", "Input"}[g.pick(3)], v)
		}
		if g.pick(6) == 0 {
			add("input", `"dup"`)
		}
	}
	if g.pick(4) == 0 {
		add("stream", []string{"true", "false", "null"}[g.pick(3)])
	}
	if g.pick(3) == 0 {
		add(provenUnknown[g.pick(len(provenUnknown))], `"x"`)
	}
	return "{" + strings.Join(members, ",") + "}"
}

var provenUnknown = []string{"style", "response_format", "user", "background", "partial_images", "speed", "instructions"}

// TestProvenBoundRandom runs FuzzProvenBound's property over 4,000 random bodies and checks it
// is not vacuous.
func TestProvenBoundRandom(t *testing.T) {
	t.Parallel()
	rnd := rand.New(rand.NewPCG(32, 33))
	accepted := [2]int{}
	b := make([]byte, 64)
	for i := range 4_000 {
		for j := range b {
			b[j] = byte(rnd.IntN(256))
		}
		if checkProvenBound(t, b, i%2 == 0) {
			accepted[i%2]++
		}
	}
	if accepted[0] < 100 || accepted[1] < 100 {
		t.Fatalf("accepted %v of 2,000 each: the property is barely exercised", accepted)
	}
	t.Logf("accepted images %d, speech %d", accepted[0], accepted[1])
}

// FuzzProvenBound: for any images or speech body escrow accepts, the upstream bills at most
// the hold, and exactly what escrow proved.
func FuzzProvenBound(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, true)
	f.Add([]byte{3, 1, 4, 1, 5, 9, 2, 6}, false)
	f.Fuzz(func(t *testing.T, b []byte, images bool) { checkProvenBound(t, b, images) })
}

// checkImageTokenBound is the property for a token-billed (gpt-image) generation: for any body
// escrow accepts, the hold (its proof made with the model's prices) is at least the cost of the
// usage the upstream reports for the same bytes (the fake bills the most it may: a token per
// prompt byte, the published output tokens of the size and quality it read), and the charge is
// that usage. It reports whether escrow accepted the body.
func checkImageTokenBound(t *testing.T, choices []byte) bool {
	t.Helper()
	g := &specGen{b: choices}
	var members []string
	add := func(k, v string) { members = append(members, `"`+k+`":`+v) }
	add("model", `"gpt-image-test"`)
	add("prompt", []string{`"a cat"`, `"` + strings.Repeat("x", 200) + `"`, `"a \u00e9 \"cat\""`}[g.pick(3)])
	if v := []string{"", "null", "1", "2", "10", "11", "0", `"2"`}[g.pick(8)]; v != "" {
		add([]string{"n", "n", "N"}[g.pick(3)], v)
	}
	if v := []string{"", "null", `"1024x1024"`, `"1024x1536"`, `"1536x1024"`, `"auto"`, `"1792x1024"`, `"1024X1024"`, `"1024\u00781536"`}[g.pick(9)]; v != "" {
		add([]string{"size", "size", "Size"}[g.pick(3)], v)
	}
	if v := []string{"", "null", `"low"`, `"medium"`, `"high"`, `"auto"`, `"hd"`, `"HIGH"`, `"l\u006fw"`}[g.pick(9)]; v != "" {
		add([]string{"quality", "quality", "Quality"}[g.pick(3)], v)
	}
	if g.pick(4) == 0 {
		add("quality", `"low"`) // a duplicate (or the first)
	}
	if g.pick(3) == 0 {
		add(provenUnknown[g.pick(len(provenUnknown))], `"x"`)
	}
	body := "{" + strings.Join(members, ",") + "}"
	r, e := parseRequest(endpoint.ImagesGenerations.Path, []byte(body))
	if e != nil {
		return false
	}
	m := &middleware{cfg: Config{}}
	if e := m.reprove(&r, gptImageModel); e != nil || provenPriced(gptImageModel, *r.Proof) != nil {
		return false
	}
	hold, err := gptImageModel.Cost(*r.Proof)
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	provenFake.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, endpoint.ImagesGenerations.Path, bytes.NewReader([]byte(body))))
	if rec.Code != http.StatusOK {
		return true // refused upstream: released, nothing billed
	}
	u, ok := endpoint.ImageUsage(usageObject{gjson.GetBytes(rec.Body.Bytes(), "usage")})
	if !ok {
		t.Fatalf("%s: the upstream's usage is unreadable: %s", body, rec.Body.Bytes())
	}
	if cost, err := gptImageModel.Cost(u); err != nil || cost > hold {
		t.Fatalf("%s: the upstream bills %d (%v) for %+v, above the hold %d (%+v)", body, cost, err, u, hold, *r.Proof)
	}
	return true
}

// TestImageTokenBoundRandom runs checkImageTokenBound over 3,000 random bodies and checks it is
// not vacuous.
func TestImageTokenBoundRandom(t *testing.T) {
	t.Parallel()
	rnd := rand.New(rand.NewPCG(32, 34))
	accepted := 0
	b := make([]byte, 32)
	for range 3_000 {
		for j := range b {
			b[j] = byte(rnd.IntN(256))
		}
		if checkImageTokenBound(t, b) {
			accepted++
		}
	}
	if accepted < 300 {
		t.Fatalf("accepted %d of 3,000: the property is barely exercised", accepted)
	}
	t.Logf("accepted %d", accepted)
}

// FuzzImageTokenBound: for any gpt-image body escrow accepts, the upstream bills at most the
// hold.
func FuzzImageTokenBound(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8})
	f.Fuzz(func(t *testing.T, b []byte) { checkImageTokenBound(t, b) })
}
