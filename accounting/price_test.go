package accounting

import (
	"errors"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

func TestCostRounding(t *testing.T) {
	t.Parallel()
	p := Prices{Input: 2_500_000, CachedInput: 1_250_000, Output: 10_000_000} // $2.50 / $1.25 / $10 per 1M
	cases := []struct {
		name string
		u    Usage
		want int64
	}{
		{"zero", Usage{}, 0},
		{"one input token rounds up", Usage{Prompt: 1}, 3},                       // 2.5 → 3
		{"exact micro-unit", Usage{Prompt: 2}, 5},                                // 5.0
		{"one output token", Usage{Completion: 1}, 10},                           // 10.0
		{"cached is part of prompt", Usage{Prompt: 4, Cached: 4}, 5},             // 4×1.25
		{"cached mix", Usage{Prompt: 3, Cached: 1, Completion: 1}, 17},           // 2×2.5+1.25+10 = 16.25 → 17
		{"reasoning never added", Usage{Completion: 1, Reasoning: 1}, 10},        // reasoning ⊂ completion
		{"cached above prompt counts as prompt", Usage{Prompt: 2, Cached: 9}, 3}, // 2×1.25 = 2.5 → 3
		{"million tokens", Usage{Prompt: 1_000_000, Completion: 1_000_000}, 12_500_000},
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
	p := Prices{Input: 1}
	for _, c := range []struct{ tokens, want int64 }{{999_999, 1}, {1_000_000, 1}, {1_000_001, 2}, {2_000_000, 2}} {
		if got, _ := p.Cost(Usage{Prompt: c.tokens}); got != c.want {
			t.Errorf("Cost(%d tokens at 1/M) = %d, want %d", c.tokens, got, c.want)
		}
	}
	// The largest cost allowed, and one micro-unit past it.
	big1 := Prices{Output: TokensPerPriceUnit}
	if got, err := big1.Cost(Usage{Completion: balance.MaxAmount}); err != nil || got != balance.MaxAmount {
		t.Errorf("max cost: %d, %v", got, err)
	}
	if _, err := big1.Cost(Usage{Completion: balance.MaxAmount + 1}); !errors.Is(err, ErrCostOverflow) {
		t.Errorf("past max: want ErrCostOverflow, got %v", err)
	}
	// Products that overflow 64 and 128 bits are errors, never wrapped numbers.
	huge := Prices{Input: math.MaxInt64, Output: math.MaxInt64}
	if _, err := huge.Cost(Usage{Prompt: math.MaxInt64, Completion: math.MaxInt64}); !errors.Is(err, ErrCostOverflow) {
		t.Errorf("128-bit overflow: want ErrCostOverflow, got %v", err)
	}
	if _, err := p.Cost(Usage{Prompt: -1}); !errors.Is(err, ErrInvalidUsage) {
		t.Errorf("negative tokens: want ErrInvalidUsage, got %v", err)
	}
}

// TestCostMatchesBigInt checks the 128-bit arithmetic against math/big on random inputs.
func TestCostMatchesBigInt(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 20000; i++ {
		p := Prices{Input: r.Int64N(1 << 40), CachedInput: r.Int64N(1 << 40), Output: r.Int64N(1 << 40)}
		u := Usage{Prompt: r.Int64N(1 << 32), Completion: r.Int64N(1 << 32)}
		u.Cached = r.Int64N(u.Prompt + 1)
		num := new(big.Int).Mul(big.NewInt(u.Prompt-u.Cached), big.NewInt(p.Input))
		num.Add(num, new(big.Int).Mul(big.NewInt(u.Cached), big.NewInt(p.CachedInput)))
		num.Add(num, new(big.Int).Mul(big.NewInt(u.Completion), big.NewInt(p.Output)))
		q, m := new(big.Int).QuoRem(num, big.NewInt(TokensPerPriceUnit), new(big.Int))
		if m.Sign() > 0 {
			q.Add(q, big.NewInt(1))
		}
		got, err := p.Cost(u)
		if q.Cmp(big.NewInt(balance.MaxAmount)) > 0 {
			if !errors.Is(err, ErrCostOverflow) {
				t.Fatalf("%+v %+v: want overflow, got %d %v", p, u, got, err)
			}
			continue
		}
		if err != nil || got != q.Int64() {
			t.Fatalf("%+v %+v: got %d %v, want %s", p, u, got, err, q)
		}
	}
}
