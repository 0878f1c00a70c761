package pricing_test

import (
	"encoding/json"
	"errors"
	"maps"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
)

// TestClassRegistry: every class the registry lists is found by Lookup with its unit, side and
// rule; a family's members are found by name; a name that is no class is not.
func TestClassRegistry(t *testing.T) {
	t.Parallel()
	for _, c := range pricing.Classes() {
		if _, ok := pricing.Lookup(c.Name); !ok && c.Unit != pricing.PerItem {
			t.Errorf("Lookup(%s) failed", c.Name)
		}
	}
	for c, want := range map[pricing.Class]pricing.Unit{
		pricing.Input: pricing.PerMTokens, pricing.AudioOutput: pricing.PerMTokens, pricing.AudioSecond: pricing.PerSecond,
		pricing.Characters: pricing.PerMCharacters, pricing.PerImage("1024x1024", "hd"): pricing.PerItem, pricing.ToolCall("web_search"): pricing.PerItem,
	} {
		if info, ok := pricing.Lookup(c); !ok || info.Unit != want || info.Name != c {
			t.Errorf("Lookup(%s) = %+v %v, want unit %s", c, info, ok, want)
		}
	}
	for _, bad := range []pricing.Class{"", "nope", "per_image_", "tool_call_UPPER", "input_price"} {
		if _, ok := pricing.Lookup(bad); ok {
			t.Errorf("Lookup(%q) found a class", bad)
		}
	}
	if in, _ := pricing.Lookup(pricing.AudioInput); !in.BoundsInput || in.Side != pricing.SideInput || !in.Default.Refuse {
		t.Errorf("audio_input: %+v", in)
	}
}

// TestAudioTokensCost: OpenAI's audio tokens, part of prompt_tokens and completion_tokens, are
// taken out of the text tokens and billed at the audio prices; a model without them bills them
// at the text prices of their side (what they cost before the class, for a deployment that
// lets audio pass with middleware.Config.Allow) and refuses no cost.
func TestAudioTokensCost(t *testing.T) {
	t.Parallel()
	p := pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 1_250_000, pricing.Output: 10_000_000,
		pricing.AudioInput: 40_000_000, pricing.AudioOutput: 80_000_000}
	u := pricing.OpenAICounts{Prompt: 1000, Cached: 100, AudioIn: 400, Completion: 100, Reasoning: 20, AudioOut: 60}.Usage()
	if u.Prompt != 1000 || u.Completion != 100 || u.Reasoning != 20 ||
		!maps.Equal(u.Units, pricing.Units{pricing.CachedInput: 100, pricing.AudioInput: 400, pricing.AudioOutput: 60}) {
		t.Fatalf("usage %+v", u)
	}
	if s := u.Split(); !maps.Equal(s, pricing.Units{pricing.Input: 500, pricing.CachedInput: 100, pricing.AudioInput: 400, pricing.Output: 40, pricing.AudioOutput: 60}) {
		t.Fatalf("Split = %v", s)
	}
	// 500·2.5 + 100·1.25 + 400·40 + 40·10 + 60·80 = 1,250 + 125 + 16,000 + 400 + 4,800
	if c, err := p.Cost(u); err != nil || c != 22_575 {
		t.Fatalf("Cost = %d %v, want 22,575", c, err)
	}
	text := pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 1_250_000, pricing.Output: 10_000_000}
	// 900·2.5 + 100·1.25 + 100·10
	if c, err := text.Cost(u); err != nil || c != 3_375 {
		t.Fatalf("Cost without audio prices = %d %v, want 3,375", c, err)
	}
	if text.Has(pricing.AudioInput) || !p.Has(pricing.AudioOutput) {
		t.Fatal("Has")
	}
	// Audio above the prompt is what is left of it (never more tokens than reported).
	over := pricing.OpenAICounts{Prompt: 10, AudioIn: 50}.Usage()
	if c, err := p.Cost(over); err != nil || c != 400 {
		t.Fatalf("audio above the prompt: %d %v, want 400", c, err)
	}
	// The bound: every input token at the highest input class the request can bill.
	if got := p.MaxInputFor(pricing.TextClasses); got != 2_500_000 {
		t.Errorf("MaxInputFor(text) = %d", got)
	}
	audio := append(append([]pricing.Class{}, pricing.TextClasses...), pricing.AudioClasses...)
	if got := p.MaxInputFor(audio); got != 40_000_000 {
		t.Errorf("MaxInputFor(text+audio) = %d", got)
	}
	if got := p.MaxOutputFor(audio); got != 80_000_000 {
		t.Errorf("MaxOutputFor(text+audio) = %d", got)
	}
	b, err := p.BoundFor(u.Prompt, u.Completion, audio)
	if c, _ := p.Cost(u); err != nil || b != 1000*40+100*80 || c > b {
		t.Errorf("BoundFor = %d %v, cost %d", b, err, c)
	}
	if r := p.Restrict(pricing.TextClasses); r.MaxInput() != 2_500_000 || r.MaxOutputFor(nil) != 10_000_000 {
		t.Errorf("Restrict(text) = %v", r)
	}
}

// TestCostAcrossUnits: per-item, per-second and per-character classes add to the token
// classes exactly, rounded up once; units of such a class the model has no price for are
// ErrUnpriced, never free.
func TestCostAcrossUnits(t *testing.T) {
	t.Parallel()
	hd := pricing.PerImage("1024x1024", "hd")
	p := pricing.Prices{pricing.Input: 1, hd: 80_000, pricing.AudioSecond: 100, pricing.Characters: 15_000_000}
	u := pricing.Usage{Prompt: 1, Units: pricing.Units{hd: 2, pricing.AudioSecond: 3, pricing.Characters: 7}}
	// ⌈(1·1 + 7·15,000,000) / 1e6⌉ + 2·80,000 + 3·100 = ⌈105.000001⌉ + 160,300
	if c, err := p.Cost(u); err != nil || c != 106+160_300 {
		t.Fatalf("Cost = %d %v", c, err)
	}
	if _, err := (pricing.Prices{pricing.Input: 1}).Cost(u); !errors.Is(err, pricing.ErrUnpriced) {
		t.Fatalf("unpriced images: %v", err)
	}
	if _, err := p.Cost(pricing.Usage{Units: pricing.Units{"nope": 1}}); !errors.Is(err, pricing.ErrUnknownClass) {
		t.Fatalf("unknown class: %v", err)
	}
	if _, err := (pricing.Prices{hd: balance.MaxAmount}).Cost(pricing.Usage{Units: pricing.Units{hd: 2}}); !errors.Is(err, pricing.ErrCostOverflow) {
		t.Fatalf("overflow: %v", err)
	}
	if err := (pricing.Prices{pricing.BatchDiscount: 101}).Check(); err == nil {
		t.Fatal("a discount above 100 percent passed")
	}
}

// TestCostAllClassesMatchesBigInt: random prices and units of every token class against
// math/big, and the bound over every class is never below the cost.
func TestCostAllClassesMatchesBigInt(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(7, 8))
	inClasses := []pricing.Class{pricing.CachedInput, pricing.CacheWrite, pricing.CacheWrite1h, pricing.AudioInput, pricing.ImageInput}
	outClasses := []pricing.Class{pricing.AudioOutput, pricing.ImageOutput}
	for i := 0; i < 5000; i++ {
		p := pricing.Prices{pricing.Input: 1 + r.Int64N(1<<30), pricing.Output: r.Int64N(1 << 30)}
		u := pricing.Usage{Units: pricing.Units{}}
		num := new(big.Int)
		add := func(n, price int64) { num.Add(num, new(big.Int).Mul(big.NewInt(n), big.NewInt(price))) }
		for _, c := range inClasses {
			p[c] = 1 + r.Int64N(1<<30)
			n := r.Int64N(1 << 26)
			u.Units[c], u.Prompt = n, u.Prompt+n
			add(n, p[c])
		}
		text := r.Int64N(1 << 26)
		u.Prompt += text
		add(text, p[pricing.Input])
		for _, c := range outClasses {
			p[c] = r.Int64N(1 << 30)
			n := r.Int64N(1 << 26)
			u.Units[c], u.Completion = n, u.Completion+n
			add(n, p[c])
		}
		out := r.Int64N(1 << 26)
		u.Completion += out
		add(out, p[pricing.Output])
		q, m := new(big.Int).QuoRem(num, big.NewInt(pricing.TokensPerPriceUnit), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		got, err := p.Cost(u)
		if err != nil || got != q.Int64() {
			t.Fatalf("%v %+v: got %d %v, want %s", p, u, got, err, q)
		}
		if b, err := p.Bound(u.Prompt, u.Completion); err != nil || b < got {
			t.Fatalf("bound %d %v below the cost %d", b, err, got)
		}
	}
}

// TestUsageJSON: Units round-trip, and a usage of an earlier release (cached_tokens,
// cache_write_tokens counting the 1-hour ones) reads as the same units — a journal written
// before the classes replays alike.
func TestUsageJSON(t *testing.T) {
	t.Parallel()
	u := pricing.Usage{Prompt: 10, Completion: 5, Reasoning: 1, Units: pricing.Units{pricing.AudioInput: 3}}
	b, _ := json.Marshal(u)
	var back pricing.Usage
	if err := json.Unmarshal(b, &back); err != nil || !back.Equal(u) {
		t.Fatalf("%s → %+v %v", b, back, err)
	}
	var old pricing.Usage
	if err := json.Unmarshal([]byte(`{"prompt_tokens":100,"cached_tokens":10,"completion_tokens":5,"reasoning_tokens":0,"cache_write_tokens":30,"cache_write_1h_tokens":20}`), &old); err != nil ||
		!old.Equal(pricing.Usage{Prompt: 100, Completion: 5, Units: pricing.Units{pricing.CachedInput: 10, pricing.CacheWrite: 10, pricing.CacheWrite1h: 20}}) {
		t.Fatalf("old usage: %+v %v", old, err)
	}
	a := pricing.AnthropicCounts{Input: 4, CacheRead: 50, CacheWrite: 100, CacheWrite1h: 30, Output: 10}.Usage()
	if !a.Equal(pricing.Usage{Prompt: 154, Completion: 10, Units: pricing.Units{pricing.CachedInput: 50, pricing.CacheWrite: 70, pricing.CacheWrite1h: 30}}) {
		t.Fatalf("Anthropic: %+v", a)
	}
}

// TestIsDefault: a price equal to its rule's default is a default; input and output never are.
func TestIsDefault(t *testing.T) {
	t.Parallel()
	p := pricing.Prices{pricing.Input: 3, pricing.CachedInput: 3, pricing.CacheWrite1h: 6, pricing.CacheWrite: 4, pricing.Output: 0}
	for c, want := range map[pricing.Class]bool{pricing.Input: false, pricing.Output: false, pricing.CachedInput: true, pricing.CacheWrite1h: true,
		pricing.CacheWrite: false, pricing.AudioInput: true} {
		if got := p.IsDefault(c); got != want {
			t.Errorf("IsDefault(%s) = %v", c, got)
		}
	}
}

// TestBatchPrices: a batch line is billed at half the live price by default, at the model's
// own discount when it states one (0: none), every price rounded up; pricing twice is a no-op.
func TestBatchPrices(t *testing.T) {
	t.Parallel()
	live := pricing.Prices{pricing.Input: 3, pricing.Output: 10, pricing.CacheWrite1h: 0}
	b := live.Batch()
	// input ⌈3/2⌉ = 2, output 5; the cached and cache-write prices follow from the input's live
	// defaults (3, 3, 6) and are halved too.
	want := pricing.Prices{pricing.Input: 2, pricing.Output: 5, pricing.CachedInput: 2, pricing.CacheWrite: 2, pricing.CacheWrite1h: 3, pricing.BatchDiscount: 0}
	if !maps.Equal(b, want) {
		t.Fatalf("Batch = %v, want %v", b, want)
	}
	if !maps.Equal(b.Batch(), b) {
		t.Fatalf("pricing twice: %v", b.Batch())
	}
	if d, _ := live.Price(pricing.BatchDiscount); d != pricing.DefaultBatchDiscount {
		t.Fatalf("default discount %d", d)
	}
	none := pricing.Prices{pricing.Input: 3, pricing.Output: 10, pricing.BatchDiscount: 0}.Batch()
	if none[pricing.Input] != 3 || none[pricing.Output] != 10 {
		t.Fatalf("no discount: %v", none)
	}
	quarter := pricing.Prices{pricing.Input: 3, pricing.Output: 10, pricing.BatchDiscount: 75}.Batch()
	if quarter[pricing.Input] != 1 || quarter[pricing.Output] != 3 {
		t.Fatalf("75 percent: %v", quarter)
	}
}
