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
//
// CacheWriteInput is the price of an input token written to the provider's prompt cache
// (Anthropic's cache_creation_input_tokens, at the 5-minute cache's rate: requests asking for
// another cache lifetime are refused by the middleware as a feature this price does not cover).
// CachedInput is the price of an input token read from the cache (OpenAI's cached_tokens,
// Anthropic's cache_read_input_tokens). A model whose provider never writes cache tokens
// leaves CacheWriteInput at 0; it is then never used.
type Prices struct {
	Input           int64 `json:"input_price"`
	CachedInput     int64 `json:"cached_input_price"`
	Output          int64 `json:"output_price"`
	CacheWriteInput int64 `json:"cache_write_input_price"`
}

// Usage is a request's token usage in OpenAI's terms. Prompt is every input token and already
// includes Cached (read from the cache) and CacheWrite (written to it); Completion already
// includes Reasoning: none of them is ever added on top.
//
// Anthropic's usage maps onto it as: Prompt = input_tokens + cache_creation_input_tokens +
// cache_read_input_tokens (Anthropic's input_tokens are the uncached ones only), Cached =
// cache_read_input_tokens, CacheWrite = cache_creation_input_tokens, Completion =
// output_tokens. So Prompt means "all input" for both providers, and reports add up alike.
type Usage struct {
	Prompt     int64 `json:"prompt_tokens"`
	Cached     int64 `json:"cached_tokens"`
	Completion int64 `json:"completion_tokens"`
	Reasoning  int64 `json:"reasoning_tokens"`
	CacheWrite int64 `json:"cache_write_tokens,omitempty"`
}

// Cost prices usage:
//
//	cost = ceil(((Prompt − Cached − CacheWrite)·Input + Cached·CachedInput +
//	             CacheWrite·CacheWriteInput + Completion·Output) / 1e6)
//
// computed exactly in 128 bits and rounded up, so a request is never under-charged: any
// fraction of a micro-unit costs a whole one. The upstream cannot cache more than it read:
// CacheWrite above Prompt is counted as Prompt, then Cached above what remains as what
// remains (with no cache writes — every OpenAI request — this is just Cached ≤ Prompt).
// Reasoning is informational. A result above balance.MaxAmount is ErrCostOverflow, never a
// wrong number.
func (p Prices) Cost(u Usage) (int64, error) {
	if u.Prompt < 0 || u.Cached < 0 || u.Completion < 0 || u.Reasoning < 0 || u.CacheWrite < 0 {
		return 0, fmt.Errorf("%w: negative token count", ErrInvalidUsage)
	}
	if p.Input < 0 || p.CachedInput < 0 || p.Output < 0 || p.CacheWriteInput < 0 {
		return 0, fmt.Errorf("%w: negative price", ErrInvalidUsage)
	}
	written := min(u.CacheWrite, u.Prompt)
	cached := min(u.Cached, u.Prompt-written)
	var acc u128
	acc.addMul(uint64(u.Prompt-written-cached), uint64(p.Input))
	acc.addMul(uint64(cached), uint64(p.CachedInput))
	acc.addMul(uint64(written), uint64(p.CacheWriteInput))
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

// MaxInput is the highest price an input token can cost: the largest of the input, cached
// input and cache-write prices.
func (p Prices) MaxInput() int64 { return max(p.Input, p.CachedInput, p.CacheWriteInput) }

// Bound is the most a request can cost given at most inputTokens in and outputTokens out
// (every input token at the highest input price, MaxInput), rounded up like Cost.
func (p Prices) Bound(inputTokens, outputTokens int64) (int64, error) {
	return Prices{Input: p.MaxInput(), Output: p.Output}.Cost(Usage{Prompt: inputTokens, Completion: outputTokens})
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
