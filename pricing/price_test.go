package pricing_test

import (
	"errors"
	"maps"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

func TestCostRounding(t *testing.T) {
	t.Parallel()
	p := pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 1_250_000, pricing.Output: 10_000_000} // $2.50 / $1.25 / $10 per 1M
	cases := []struct {
		name string
		u    pricing.Usage
		want int64
	}{
		{"zero", pricing.Usage{}, 0},
		{"one input token rounds up", pricing.Usage{Prompt: 1}, 3},                                                          // 2.5 → 3
		{"exact micro-unit", pricing.Usage{Prompt: 2}, 5},                                                                   // 5.0
		{"one output token", pricing.Usage{Completion: 1}, 10},                                                              // 10.0
		{"cached is part of prompt", pricing.Usage{Prompt: 4, Units: pricing.Units{pricing.CachedInput: 4}}, 5},             // 4×1.25
		{"cached mix", pricing.Usage{Prompt: 3, Completion: 1, Units: pricing.Units{pricing.CachedInput: 1}}, 17},           // 2×2.5+1.25+10 = 16.25 → 17
		{"reasoning never added", pricing.Usage{Completion: 1, Reasoning: 1}, 10},                                           // reasoning ⊂ completion
		{"cached above prompt counts as prompt", pricing.Usage{Prompt: 2, Units: pricing.Units{pricing.CachedInput: 9}}, 3}, // 2×1.25 = 2.5 → 3
		{"million tokens", pricing.Usage{Prompt: 1_000_000, Completion: 1_000_000}, 12_500_000},
	}
	for _, c := range cases {
		got, err := p.Cost(c.u)
		if err != nil || got != c.want {
			t.Errorf("%s: Cost(%+v) = %d, %v; want %d", c.name, c.u, got, err, c.want)
		}
	}
}

func TestCostBoundaries(t *testing.T) {
	t.Parallel()
	// A numerator one below a multiple of 1e6 rounds up; exactly the multiple does not.
	p := pricing.Prices{pricing.Input: 1}
	for _, c := range []struct{ tokens, want int64 }{{999_999, 1}, {1_000_000, 1}, {1_000_001, 2}, {2_000_000, 2}} {
		if got, _ := p.Cost(pricing.Usage{Prompt: c.tokens}); got != c.want {
			t.Errorf("Cost(%d tokens at 1/M) = %d, want %d", c.tokens, got, c.want)
		}
	}
	// The largest cost allowed, and one micro-unit past it.
	big1 := pricing.Prices{pricing.Output: pricing.TokensPerPriceUnit}
	if got, err := big1.Cost(pricing.Usage{Completion: balance.MaxAmount}); err != nil || got != balance.MaxAmount {
		t.Errorf("max cost: %d, %v", got, err)
	}
	if _, err := big1.Cost(pricing.Usage{Completion: balance.MaxAmount + 1}); !errors.Is(err, pricing.ErrCostOverflow) {
		t.Errorf("past max: want pricing.ErrCostOverflow, got %v", err)
	}
	// Products that overflow 64 and 128 bits are errors, never wrapped numbers.
	huge := pricing.Prices{pricing.Input: math.MaxInt64, pricing.Output: math.MaxInt64}
	if _, err := huge.Cost(pricing.Usage{Prompt: math.MaxInt64, Completion: math.MaxInt64}); !errors.Is(err, pricing.ErrCostOverflow) {
		t.Errorf("128-bit overflow: want pricing.ErrCostOverflow, got %v", err)
	}
	if _, err := p.Cost(pricing.Usage{Prompt: -1}); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Errorf("negative tokens: want pricing.ErrInvalidUsage, got %v", err)
	}
}

// TestCostMatchesBigInt checks the 128-bit arithmetic against math/big on random inputs.
func TestCostMatchesBigInt(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 20000; i++ {
		p := pricing.Prices{pricing.Input: r.Int64N(1 << 40), pricing.CachedInput: r.Int64N(1 << 40), pricing.Output: r.Int64N(1 << 40)}
		u := pricing.Usage{Prompt: r.Int64N(1 << 32), Completion: r.Int64N(1 << 32)}
		cached := r.Int64N(u.Prompt + 1)
		u = u.With(pricing.CachedInput, cached)
		num := new(big.Int).Mul(big.NewInt(u.Prompt-cached), big.NewInt(p[pricing.Input]))
		num.Add(num, new(big.Int).Mul(big.NewInt(cached), big.NewInt(p[pricing.CachedInput])))
		num.Add(num, new(big.Int).Mul(big.NewInt(u.Completion), big.NewInt(p[pricing.Output])))
		q, m := new(big.Int).QuoRem(num, big.NewInt(pricing.TokensPerPriceUnit), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		got, err := p.Cost(u)
		if q.Cmp(big.NewInt(balance.MaxAmount)) > 0 {
			if !errors.Is(err, pricing.ErrCostOverflow) {
				t.Fatalf("%+v %+v: want overflow, got %d %v", p, u, got, err)
			}
			continue
		}
		if err != nil || got != q.Int64() {
			t.Fatalf("%+v %+v: got %d %v, want %s", p, u, got, err, q)
		}
	}
}

// TestCostCacheWrite checks the cache-write price against math/big on random inputs, with
// Anthropic's mapping (Prompt = uncached + written + read), and that usage with no cache writes
// costs what it cost before cache writes had a price.
func TestCostCacheWrite(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 20000; i++ {
		p := pricing.Prices{pricing.Input: r.Int64N(1 << 40), pricing.CachedInput: r.Int64N(1 << 40), pricing.Output: r.Int64N(1 << 40), pricing.CacheWrite: r.Int64N(1 << 40)}
		in, written, read, out := r.Int64N(1<<30), r.Int64N(1<<30), r.Int64N(1<<30), r.Int64N(1<<30)
		u := pricing.Usage{Prompt: in + written + read, Completion: out, Units: pricing.Units{pricing.CachedInput: read, pricing.CacheWrite: written}}
		num := new(big.Int).Mul(big.NewInt(in), big.NewInt(p[pricing.Input]))
		num.Add(num, new(big.Int).Mul(big.NewInt(read), big.NewInt(p[pricing.CachedInput])))
		num.Add(num, new(big.Int).Mul(big.NewInt(written), big.NewInt(p[pricing.CacheWrite])))
		num.Add(num, new(big.Int).Mul(big.NewInt(out), big.NewInt(p[pricing.Output])))
		q, m := new(big.Int).QuoRem(num, big.NewInt(pricing.TokensPerPriceUnit), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		got, err := p.Cost(u)
		if q.Cmp(big.NewInt(balance.MaxAmount)) > 0 {
			if !errors.Is(err, pricing.ErrCostOverflow) {
				t.Fatalf("%+v %+v: want overflow, got %d %v", p, u, got, err)
			}
			continue
		}
		if err != nil || got != q.Int64() {
			t.Fatalf("%+v %+v: got %d %v, want %s", p, u, got, err, q)
		}
		// OpenAI usage (no cache writes) ignores the cache-write price.
		u = u.With(pricing.CacheWrite, 0)
		a, errA := p.Cost(u)
		delete(p, pricing.CacheWrite)
		b, errB := p.Cost(u)
		if a != b || (errA == nil) != (errB == nil) {
			t.Fatalf("%+v %+v: cache-write price changed an OpenAI cost: %d %v vs %d %v", p, u, a, errA, b, errB)
		}
	}
}

// TestCostCacheWriteBoundaries: exact values, the round-up, inconsistent counts clamped so
// that written tokens are never charged less than the prompt allows, and negatives refused.
func TestCostCacheWriteBoundaries(t *testing.T) {
	t.Parallel()
	// Claude-like prices: input 3 units/M, cache write 3.75, cache read 0.30, output 15.
	p := pricing.Prices{pricing.Input: 3_000_000, pricing.CacheWrite: 3_750_000, pricing.CachedInput: 300_000, pricing.Output: 15_000_000}
	cases := []struct {
		name string
		u    pricing.Usage
		want int64
	}{
		// 100·3 + 2000·3.75 + 5000·0.3 + 50·15 = 300 + 7500 + 1500 + 750 = 10050 micro-units
		{"exact", pricing.Usage{Prompt: 7100, Completion: 50, Units: pricing.Units{pricing.CachedInput: 5000, pricing.CacheWrite: 2000}}, 10050},
		{"one written token rounds up", pricing.Usage{Prompt: 1, Units: pricing.Units{pricing.CacheWrite: 1}}, 4},
		{"write above prompt counted as prompt", pricing.Usage{Prompt: 10, Units: pricing.Units{pricing.CacheWrite: 20}}, 38},
		{"read clamped to what writes left", pricing.Usage{Prompt: 10, Units: pricing.Units{pricing.CachedInput: 10, pricing.CacheWrite: 10}}, 38},
	}
	for _, c := range cases {
		if got, err := p.Cost(c.u); err != nil || got != c.want {
			t.Errorf("%s: Cost(%+v) = %d, %v; want %d", c.name, c.u, got, err, c.want)
		}
	}
	if _, err := p.Cost(pricing.Usage{Prompt: 1, Units: pricing.Units{pricing.CacheWrite: -1}}); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Errorf("negative cache writes: want pricing.ErrInvalidUsage, got %v", err)
	}
	if _, err := (pricing.Prices{pricing.CacheWrite: -1}).Cost(pricing.Usage{}); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Errorf("negative cache-write price: want pricing.ErrInvalidUsage, got %v", err)
	}
}

// TestBoundUsesHighestInputPrice: a hold bound prices every input token at the highest input
// price, the cache-write one included, so no mix of cached, written and plain tokens costs
// more than the bound.
func TestBoundUsesHighestInputPrice(t *testing.T) {
	t.Parallel()
	p := pricing.Prices{pricing.Input: 3_000_000, pricing.CacheWrite: 6_000_000, pricing.CachedInput: 300_000, pricing.Output: 15_000_000}
	b, err := p.Bound(1000, 100)
	if err != nil || b != 1000*6+100*15 {
		t.Fatalf("Bound = %d, %v; want %d", b, err, 1000*6+100*15)
	}
	for w := int64(0); w <= 1000; w += 50 {
		c, err := p.Cost(pricing.Usage{Prompt: 1000, Completion: 100, Units: pricing.Units{pricing.CachedInput: (1000 - w) / 2, pricing.CacheWrite: w}})
		if err != nil || c > b {
			t.Fatalf("cost %d (%v) with %d written above the bound %d", c, err, w, b)
		}
	}
	m := ledger.Model{Prices: p, MaxInputTokens: 200_000, MaxOutputTokens: 64_000}
	if cb, ok, err := m.CostBound(); !ok || err != nil || cb != 200_000*6+64_000*15 {
		t.Fatalf("CostBound = %d %v %v", cb, ok, err)
	}
}

// TestCostMissingPricesDefault: a model priced with only its input and output prices bills
// cached tokens and cache writes at the input price and 1-hour cache writes at
// pricing.CacheWrite1hMultiplier × the input price — never at 0 — and the bound covers them.
func TestCostMissingPricesDefault(t *testing.T) {
	t.Parallel()
	p := pricing.Prices{pricing.Input: 3_000_000, pricing.Output: 15_000_000}
	cases := []struct {
		name string
		u    pricing.Usage
		want int64
	}{
		{"cached at the input price", pricing.Usage{Prompt: 1000, Units: pricing.Units{pricing.CachedInput: 900}}, 3000},
		{"5-minute writes at the input price", pricing.Usage{Prompt: 1000, Units: pricing.Units{pricing.CacheWrite: 1000}}, 3000},
		{"1-hour writes at 2× the input price", pricing.Usage{Prompt: 1000, Units: pricing.Units{pricing.CacheWrite1h: 1000}}, 6000},
		// 100·3 + 400·3 (5m) + 300·6 (1h) + 200·3 (read) + 10·15 = 300+1200+1800+600+150
		{"a mix", pricing.Usage{Prompt: 1000, Completion: 10, Units: pricing.Units{pricing.CachedInput: 200, pricing.CacheWrite1h: 300, pricing.CacheWrite: 400}}, 4050},
		{"1-hour writes above the prompt", pricing.Usage{Prompt: 10, Units: pricing.Units{pricing.CacheWrite1h: 40}}, 60},
	}
	for _, c := range cases {
		if got, err := p.Cost(c.u); err != nil || got != c.want {
			t.Errorf("%s: Cost(%+v) = %d, %v; want %d", c.name, c.u, got, err, c.want)
		}
	}
	if d := p.WithDefaults(); !maps.Equal(d, pricing.Prices{pricing.Input: 3_000_000, pricing.CachedInput: 3_000_000, pricing.Output: 15_000_000, pricing.CacheWrite: 3_000_000, pricing.CacheWrite1h: 6_000_000}) {
		t.Errorf("WithDefaults = %+v", d)
	}
	// Given prices are kept; a free model stays free.
	given := pricing.Prices{pricing.Input: 3, pricing.CachedInput: 1, pricing.Output: 4, pricing.CacheWrite: 5, pricing.CacheWrite1h: 7}
	if !maps.Equal(given.WithDefaults(), given) || !maps.Equal((pricing.Prices{pricing.Output: 4}).WithDefaults(), pricing.Prices{pricing.Input: 0, pricing.CachedInput: 0, pricing.CacheWrite: 0, pricing.CacheWrite1h: 0, pricing.Output: 4}) {
		t.Errorf("WithDefaults changed given prices: %+v", given.WithDefaults())
	}
	if m := p.MaxInput(); m != 6_000_000 {
		t.Errorf("MaxInput = %d, want the 1-hour default 6,000,000", m)
	}
	if m := p.MaxInputFor(pricing.TextClasses); m != 3_000_000 {
		t.Errorf("MaxInputFor(pricing.TextClasses) = %d, want 3,000,000", m)
	}
	if m := (pricing.Prices{pricing.Input: 1, pricing.CachedInput: 9, pricing.CacheWrite: 20, pricing.CacheWrite1h: 30}).MaxInputFor(pricing.TextClasses); m != 9 {
		t.Errorf("MaxInputFor(pricing.TextClasses) = %d, want the cached price 9", m)
	}
	if _, err := p.Cost(pricing.Usage{Prompt: 1, Units: pricing.Units{pricing.CacheWrite1h: -1}}); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Errorf("negative 1-hour writes: want pricing.ErrInvalidUsage, got %v", err)
	}
	if _, err := (pricing.Prices{pricing.CacheWrite1h: -1}).Cost(pricing.Usage{}); !errors.Is(err, pricing.ErrInvalidUsage) {
		t.Errorf("negative 1-hour price: want pricing.ErrInvalidUsage, got %v", err)
	}
	if d := (pricing.Prices{pricing.Input: math.MaxInt64}).WithDefaults(); d[pricing.CacheWrite1h] != math.MaxInt64 {
		t.Errorf("1-hour default of a huge input price: %d", d[pricing.CacheWrite1h])
	}
}

// TestCost1hMatchesBigInt checks 5-minute and 1-hour cache writes against math/big, and that no
// mix of token classes costs more than the bound.
func TestCost1hMatchesBigInt(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(5, 6))
	for i := 0; i < 20000; i++ {
		p := pricing.Prices{pricing.Input: 1 + r.Int64N(1<<30), pricing.CachedInput: 1 + r.Int64N(1<<30), pricing.Output: r.Int64N(1 << 30), pricing.CacheWrite: 1 + r.Int64N(1<<30), pricing.CacheWrite1h: 1 + r.Int64N(1<<30)}
		in, w5, w1, read, out := r.Int64N(1<<28), r.Int64N(1<<28), r.Int64N(1<<28), r.Int64N(1<<28), r.Int64N(1<<28)
		u := pricing.Usage{Prompt: in + w5 + w1 + read, Completion: out, Units: pricing.Units{pricing.CachedInput: read, pricing.CacheWrite1h: w1, pricing.CacheWrite: w5}}
		num := new(big.Int)
		for _, x := range [][2]int64{{in, p[pricing.Input]}, {read, p[pricing.CachedInput]}, {w5, p[pricing.CacheWrite]}, {w1, p[pricing.CacheWrite1h]}, {out, p[pricing.Output]}} {
			num.Add(num, new(big.Int).Mul(big.NewInt(x[0]), big.NewInt(x[1])))
		}
		q, m := new(big.Int).QuoRem(num, big.NewInt(pricing.TokensPerPriceUnit), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		got, err := p.Cost(u)
		if err != nil || got != q.Int64() {
			t.Fatalf("%+v %+v: got %d %v, want %s", p, u, got, err, q)
		}
		if b, err := p.Bound(u.Prompt, u.Completion); err != nil || b < got {
			t.Fatalf("%+v %+v: bound %d %v below the cost %d", p, u, b, err, got)
		}
	}
}
