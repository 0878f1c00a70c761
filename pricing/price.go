package pricing

import (
	"errors"
	"fmt"
	"math"
	"math/bits"

	"github.com/llmescrow/escrow/balance"
)

// TokensPerPriceUnit is the token count prices are quoted for: a price is micro-units per
// 1,000,000 tokens.
const TokensPerPriceUnit = 1_000_000

// ErrCostOverflow is returned when a cost does not fit the money bounds (±balance.MaxAmount).
var ErrCostOverflow = errors.New("pricing: cost out of range")

// ErrInvalidUsage is returned for negative token counts or prices.
var ErrInvalidUsage = errors.New("pricing: invalid usage")

// Prices are a model's prices in micro-units per 1,000,000 tokens.
//
// CachedInput is the price of an input token read from the provider's prompt cache (OpenAI's
// cached_tokens, Anthropic's cache_read_input_tokens). CacheWriteInput is the price of an input
// token written to it for the 5-minute cache (Anthropic's cache_creation_input_tokens, or its
// cache_creation.ephemeral_5m_input_tokens), CacheWrite1hInput for the 1-hour cache
// (cache_creation.ephemeral_1h_input_tokens).
//
// A price left at 0 is never 0 for a token class the upstream can bill (WithDefaults): a cached
// or cache-write price of 0 is the input price, and a 1-hour cache-write price of 0 is
// CacheWrite1hMultiplier × the input price (Anthropic's published rate: 2× the base input price
// for 1-hour writes, 1.25× for 5-minute ones), so a seller who prices a model with only its
// input and output prices over-charges cached tokens a little instead of giving them away. The
// stored prices keep their 0s, so they follow the input price when it changes.
type Prices struct {
	Input             int64 `json:"input_price"`
	CachedInput       int64 `json:"cached_input_price"`
	Output            int64 `json:"output_price"`
	CacheWriteInput   int64 `json:"cache_write_input_price"`
	CacheWrite1hInput int64 `json:"cache_write_1h_input_price"`
}

// CacheWrite1hMultiplier is the 1-hour cache-write price of a model that has none, as a multiple
// of its input price (Anthropic: 2× for 1-hour writes).
const CacheWrite1hMultiplier = 2

// WithDefaults returns the prices every cost is computed with: each cached and cache-write price
// left at 0 takes its default (the input price; CacheWrite1hMultiplier × the input price for
// 1-hour writes, capped at math.MaxInt64). The one rule for missing prices: Cost, MaxInput and
// the admin API's answers all use it.
func (p Prices) WithDefaults() Prices {
	if p.CachedInput == 0 {
		p.CachedInput = p.Input
	}
	if p.CacheWriteInput == 0 {
		p.CacheWriteInput = p.Input
	}
	if p.CacheWrite1hInput == 0 {
		p.CacheWrite1hInput = math.MaxInt64
		if p.Input <= math.MaxInt64/CacheWrite1hMultiplier {
			p.CacheWrite1hInput = p.Input * CacheWrite1hMultiplier
		}
	}
	return p
}

// Usage is a request's token usage in OpenAI's terms. Prompt is every input token and already
// includes Cached (read from the cache) and CacheWrite (written to it), which already includes
// CacheWrite1h (written to the 1-hour cache); Completion already includes Reasoning: none of
// them is ever added on top.
//
// Anthropic's usage maps onto it as: Prompt = input_tokens + cache_creation_input_tokens +
// cache_read_input_tokens (Anthropic's input_tokens are the uncached ones only), Cached =
// cache_read_input_tokens, CacheWrite = cache_creation_input_tokens (the 5-minute and the
// 1-hour writes), CacheWrite1h = cache_creation.ephemeral_1h_input_tokens, Completion =
// output_tokens. So Prompt means "all input" for both providers, and reports add up alike.
type Usage struct {
	Prompt       int64 `json:"prompt_tokens"`
	Cached       int64 `json:"cached_tokens"`
	Completion   int64 `json:"completion_tokens"`
	Reasoning    int64 `json:"reasoning_tokens"`
	CacheWrite   int64 `json:"cache_write_tokens,omitempty"`
	CacheWrite1h int64 `json:"cache_write_1h_tokens,omitempty"`
}

// Tokens is what a tokens limit counts of the usage: input + output tokens (Prompt counts the
// cached and cache-written ones, Completion the reasoning ones).
func (u Usage) Tokens() int64 { return u.Prompt + u.Completion }

// Cost prices usage with the prices' defaults applied (WithDefaults):
//
//	cost = ceil(((Prompt − Cached − CacheWrite)·Input + Cached·CachedInput +
//	             (CacheWrite − CacheWrite1h)·CacheWriteInput + CacheWrite1h·CacheWrite1hInput +
//	             Completion·Output) / 1e6)
//
// computed exactly in 128 bits and rounded up, so a request is never under-charged: any
// fraction of a micro-unit costs a whole one. The upstream cannot cache more than it read:
// CacheWrite (at least CacheWrite1h) above Prompt is counted as Prompt, then Cached above what
// remains as what remains (with no cache writes — every OpenAI request — this is just Cached ≤
// Prompt). Reasoning is informational. A result above balance.MaxAmount is ErrCostOverflow,
// never a wrong number.
func (p Prices) Cost(u Usage) (int64, error) {
	if u.Prompt < 0 || u.Cached < 0 || u.Completion < 0 || u.Reasoning < 0 || u.CacheWrite < 0 || u.CacheWrite1h < 0 {
		return 0, fmt.Errorf("%w: negative token count", ErrInvalidUsage)
	}
	if p.Input < 0 || p.CachedInput < 0 || p.Output < 0 || p.CacheWriteInput < 0 || p.CacheWrite1hInput < 0 {
		return 0, fmt.Errorf("%w: negative price", ErrInvalidUsage)
	}
	p = p.WithDefaults()
	written := min(max(u.CacheWrite, u.CacheWrite1h), u.Prompt)
	written1h := min(u.CacheWrite1h, written)
	cached := min(u.Cached, u.Prompt-written)
	var acc u128
	acc.addMul(uint64(u.Prompt-written-cached), uint64(p.Input))
	acc.addMul(uint64(cached), uint64(p.CachedInput))
	acc.addMul(uint64(written-written1h), uint64(p.CacheWriteInput))
	acc.addMul(uint64(written1h), uint64(p.CacheWrite1hInput))
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

// MaxInput is the highest price any input token can be billed at: the largest of the input,
// cached-input, cache-write and 1-hour cache-write prices, defaults applied (MaxInputFor(true)).
func (p Prices) MaxInput() int64 { return p.MaxInputFor(true) }

// MaxInputFor is the highest price an input token of a request can be billed at: with
// cacheWrites false (a request whose upstream never reports cache writes — escrow reads them
// from Anthropic's usage only), the largest of the input and cached-input prices; with true,
// the cache-write prices (5-minute and 1-hour) too. Defaults applied.
func (p Prices) MaxInputFor(cacheWrites bool) int64 {
	d := p.WithDefaults()
	if !cacheWrites {
		return max(d.Input, d.CachedInput)
	}
	return max(d.Input, d.CachedInput, d.CacheWriteInput, d.CacheWrite1hInput)
}

// WithoutCacheWrites is the prices of a request whose usage can carry no cache writes (every
// endpoint but Anthropic's Messages): the cache-write prices are set to the input price, so
// that MaxInput, Bound and a Model's CostBound are MaxInputFor(false)'s. The request's cost is
// the same: it has no cache writes to price.
func (p Prices) WithoutCacheWrites() Prices {
	p = p.WithDefaults()
	p.CacheWriteInput, p.CacheWrite1hInput = p.Input, p.Input
	return p
}

// Bound is the most a request can cost given at most inputTokens in and outputTokens out
// (every input token at the highest input price, MaxInput), rounded up like Cost.
func (p Prices) Bound(inputTokens, outputTokens int64) (int64, error) {
	in := p.MaxInput()
	return Prices{Input: in, CachedInput: in, CacheWriteInput: in, CacheWrite1hInput: in, Output: p.Output}.
		Cost(Usage{Prompt: inputTokens, Completion: outputTokens})
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
