package accounting

import (
	"errors"
	"fmt"
	"math/bits"

	"github.com/llmescrow/escrow/balance"
)

// TokensPerPriceUnit is the token count prices are quoted for: a price is micro-units per
// 1,000,000 tokens.
const TokensPerPriceUnit = 1_000_000

// ErrCostOverflow is returned when a cost does not fit the money bounds (±balance.MaxAmount).
var ErrCostOverflow = errors.New("accounting: cost out of range")

// ErrInvalidUsage is returned for negative token counts or prices.
var ErrInvalidUsage = errors.New("accounting: invalid usage")

// Prices are a model's prices in micro-units per 1,000,000 tokens.
type Prices struct {
	Input       int64 `json:"input_price"`
	CachedInput int64 `json:"cached_input_price"`
	Output      int64 `json:"output_price"`
}

// Usage is a request's token usage as OpenAI reports it. Prompt already includes Cached, and
// Completion already includes Reasoning: neither is ever added on top.
type Usage struct {
	Prompt     int64 `json:"prompt_tokens"`
	Cached     int64 `json:"cached_tokens"`
	Completion int64 `json:"completion_tokens"`
	Reasoning  int64 `json:"reasoning_tokens"`
}

// Cost prices usage:
//
//	cost = ceil(((Prompt − Cached)·Input + Cached·CachedInput + Completion·Output) / 1e6)
//
// computed exactly in 128 bits and rounded up, so a request is never under-charged: any
// fraction of a micro-unit costs a whole one. Cached above Prompt is counted as Prompt (the
// upstream cannot cache more than it read). Reasoning is informational. A result above
// balance.MaxAmount is ErrCostOverflow, never a wrong number.
func (p Prices) Cost(u Usage) (int64, error) {
	if u.Prompt < 0 || u.Cached < 0 || u.Completion < 0 || u.Reasoning < 0 {
		return 0, fmt.Errorf("%w: negative token count", ErrInvalidUsage)
	}
	if p.Input < 0 || p.CachedInput < 0 || p.Output < 0 {
		return 0, fmt.Errorf("%w: negative price", ErrInvalidUsage)
	}
	cached := min(u.Cached, u.Prompt)
	var acc u128
	acc.addMul(uint64(u.Prompt-cached), uint64(p.Input))
	acc.addMul(uint64(cached), uint64(p.CachedInput))
	acc.addMul(uint64(u.Completion), uint64(p.Output))
	if acc.overflow || acc.hi >= TokensPerPriceUnit {
		return 0, ErrCostOverflow
	}
	q, r := bits.Div64(acc.hi, acc.lo, TokensPerPriceUnit)
	if r != 0 {
		q++
	}
	if q > uint64(balance.MaxAmount) {
		return 0, ErrCostOverflow
	}
	return int64(q), nil
}

// Bound is the most a request can cost given at most inputTokens in and outputTokens out
// (every input token at the full input price), rounded up like Cost.
func (p Prices) Bound(inputTokens, outputTokens int64) (int64, error) {
	return Prices{Input: max(p.Input, p.CachedInput), Output: p.Output}.Cost(Usage{Prompt: inputTokens, Completion: outputTokens})
}

type u128 struct {
	hi, lo   uint64
	overflow bool
}

func (a *u128) addMul(x, y uint64) {
	hi, lo := bits.Mul64(x, y)
	var c uint64
	a.lo, c = bits.Add64(a.lo, lo, 0)
	a.hi, c = bits.Add64(a.hi, hi, c)
	if c != 0 {
		a.overflow = true
	}
}
