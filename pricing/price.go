package pricing

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/bits"
	"slices"
	"strings"

	"github.com/llmescrow/escrow/balance"
)

// TokensPerPriceUnit is the token count prices are quoted for: a price is micro-units per
// 1,000,000 tokens.
const TokensPerPriceUnit = 1_000_000

// ErrCostOverflow is returned when a cost does not fit the money bounds (±balance.MaxAmount).
var ErrCostOverflow = errors.New("pricing: cost out of range")

// ErrInvalidUsage is returned for negative token counts or prices.
var ErrInvalidUsage = errors.New("pricing: invalid usage")

// ErrUnknownClass is wrapped by the errors for a price or unit of a class the registry does
// not know (Lookup).
var ErrUnknownClass = errors.New("pricing: unknown price class")

// ErrUnpriced is returned by Cost for units of a class that is not counted in tokens (images,
// seconds, calls) and that the model has no price for: a request that can bill it is refused
// before it is served (DefaultRule.Refuse), so this is a request that should not have passed.
var ErrUnpriced = errors.New("pricing: class has no price")

// CacheWrite1hMultiplier is the 1-hour cache-write price of a model that has none, as a multiple
// of its input price (Anthropic: 2× for 1-hour writes).
const CacheWrite1hMultiplier = 2

// Prices are a model's prices: class → price in micro-units per the class's unit (ClassInfo.Unit:
// per 1,000,000 tokens for token classes). A class not in the map takes its default rule
// (Price): cached input and the 5-minute cache write the input price, the 1-hour cache write
// CacheWrite1hMultiplier × the input price (Anthropic's rate), input and output 0, and every
// other class none — a request that can bill it is refused. A price of 0 for a class whose
// default comes from another class is that default too (a seller who writes 0 for cached
// tokens over-charges them a little instead of giving them away); the stored 0 then follows
// the input price when it changes.
type Prices map[Class]int64

// Price is the price class c is billed at, its default rule applied; ok is false when c has no
// price (its rule refuses it, or c is not a class).
func (p Prices) Price(c Class) (price int64, ok bool) {
	info, known := Lookup(c)
	if !known {
		return 0, false
	}
	v, set := p[c]
	if set && (v != 0 || info.Default.From == "") {
		return v, true
	}
	switch {
	case info.Default.From != "":
		base, ok := p.Price(info.Default.From)
		if !ok {
			return 0, false
		}
		if base > math.MaxInt64/info.Default.Mul {
			return math.MaxInt64, true
		}
		return base * info.Default.Mul, true
	case info.Default.Value != 0:
		return info.Default.Value, true
	case info.Default.Refuse:
		return 0, false
	}
	return 0, true
}

// Batch is the prices a batch's lines are billed at: every price of p (defaults applied)
// lowered by the batch discount (BatchDiscount, default DefaultBatchDiscount percent), each
// rounded up to a whole micro-unit per its unit so that a line is never under-charged; the
// result states a discount of 0, so that pricing it again changes nothing.
func (p Prices) Batch() Prices {
	d, _ := p.Price(BatchDiscount)
	d = min(max(d, 0), 100)
	out := p.WithDefaults()
	for c, v := range out {
		out[c] = (v*(100-d) + 99) / 100 // v ≤ balance.MaxAmount: no overflow
	}
	out[BatchDiscount] = 0
	return out
}

// Has reports whether class c has a price (its own or its default's).
func (p Prices) Has(c Class) bool {
	_, ok := p.Price(c)
	return ok
}

// WithDefaults returns the prices every cost is computed with: every fixed class that has a
// price (Price), and every family class the model prices. What the admin API shows.
func (p Prices) WithDefaults() Prices {
	out := make(Prices, len(registry))
	for _, c := range registry {
		if _, set := p[c.Name]; c.Unit == Percent && !set {
			continue // no discount
		}
		if v, ok := p.Price(c.Name); ok {
			out[c.Name] = v
		}
	}
	for c, v := range p {
		if _, fixed := byName[c]; !fixed {
			out[c] = v
		}
	}
	return out
}

// Check refuses a price below 0 or above balance.MaxAmount, a class the registry does not know
// and a batch discount above 100 percent.
func (p Prices) Check() error {
	for c, v := range p {
		info, ok := Lookup(c)
		switch {
		case !ok:
			return fmt.Errorf("%w: %q", ErrUnknownClass, c)
		case v < 0 || v > balance.MaxAmount:
			return fmt.Errorf("%w: price %s %d outside [0, %d]", ErrInvalidUsage, c, v, int64(balance.MaxAmount))
		case info.Unit == Percent && v > 100:
			return fmt.Errorf("%w: %s %d is above 100 percent", ErrInvalidUsage, c, v)
		}
	}
	return nil
}

// Equal reports whether p and q bill alike: the same price for every class.
func (p Prices) Equal(q Prices) bool { return maps.Equal(p.WithDefaults(), q.WithDefaults()) }

// Sorted returns the classes p has a price for, in the registry's order (families last, by name).
func (p Prices) Sorted() []Class { return sortClasses(slices.Collect(maps.Keys(p))) }

func sortClasses(cs []Class) []Class {
	rank := func(c Class) int {
		if i, ok := byName[c]; ok {
			return i
		}
		return len(registry)
	}
	slices.SortFunc(cs, func(a, b Class) int {
		if d := rank(a) - rank(b); d != 0 {
			return d
		}
		return strings.Compare(string(a), string(b))
	})
	return cs
}

// Units is how many units of each class a request used (tokens, images, seconds …) beyond its
// text tokens. The classes are disjoint: a token is counted in one class only.
type Units map[Class]int64

// Usage is a request's usage. Prompt is every input token and Completion every output token, as
// OpenAI reports them (Prompt includes the cached, cache-written and audio input tokens,
// Completion the reasoning and audio output tokens); Units counts the tokens of each class other
// than text (CachedInput, CacheWrite, CacheWrite1h, AudioInput … on the input side; AudioOutput
// … on the output side), disjoint, and the units of the classes that are not tokens (images,
// seconds, characters, calls). The text tokens are what the token classes leave of Prompt and
// Completion (Split). Reasoning is informational (part of Completion, priced as output).
//
// Anthropic's usage maps onto it as: Prompt = input_tokens + cache_creation_input_tokens +
// cache_read_input_tokens (Anthropic's input_tokens are the uncached ones only), CachedInput =
// cache_read_input_tokens, CacheWrite1h = cache_creation.ephemeral_1h_input_tokens, CacheWrite
// = the rest of cache_creation_input_tokens, Completion = output_tokens. So Prompt means "all
// input" for both providers, and reports add up alike.
type Usage struct {
	Prompt     int64 `json:"prompt_tokens"`
	Completion int64 `json:"completion_tokens"`
	Reasoning  int64 `json:"reasoning_tokens"`
	Units      Units `json:"units,omitempty"`
}

// Of is the units of class c the usage counts (Units[c]; not the text remainder: see Split).
func (u Usage) Of(c Class) int64 { return u.Units[c] }

// With returns u with n units of class c (none when n is 0). It copies Units, never changing
// a map another Usage shares.
func (u Usage) With(c Class, n int64) Usage {
	m := make(Units, len(u.Units)+1)
	maps.Copy(m, u.Units)
	if n == 0 {
		delete(m, c)
	} else {
		m[c] = n
	}
	if len(m) == 0 {
		m = nil
	}
	u.Units = m
	return u
}

// Tokens is what a tokens limit counts of the usage: input + output tokens (Prompt counts the
// cached, cache-written and audio ones, Completion the reasoning and audio ones).
func (u Usage) Tokens() int64 { return u.Prompt + u.Completion }

// UnmarshalJSON reads a usage, and the token counts of an older release (cached_tokens,
// cache_write_tokens including cache_write_1h_tokens) into Units, so that a journal written
// before the classes replays with them.
func (u *Usage) UnmarshalJSON(b []byte) error {
	type plain Usage
	var v struct {
		plain
		Cached       int64 `json:"cached_tokens"`
		CacheWrite   int64 `json:"cache_write_tokens"`
		CacheWrite1h int64 `json:"cache_write_1h_tokens"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*u = Usage(v.plain)
	for c, n := range map[Class]int64{CachedInput: v.Cached, CacheWrite: max(v.CacheWrite-v.CacheWrite1h, 0), CacheWrite1h: v.CacheWrite1h} {
		if n != 0 && u.Units[c] == 0 {
			*u = u.With(c, n)
		}
	}
	return nil
}

// Check refuses negative counts and classes the registry does not know.
func (u Usage) Check() error {
	if u.Prompt < 0 || u.Completion < 0 || u.Reasoning < 0 {
		return fmt.Errorf("%w: negative token count", ErrInvalidUsage)
	}
	for c, n := range u.Units {
		if _, ok := Lookup(c); !ok {
			return fmt.Errorf("%w: %q", ErrUnknownClass, c)
		}
		if n < 0 {
			return fmt.Errorf("%w: negative %s count", ErrInvalidUsage, c)
		}
	}
	return nil
}

// Split is the usage as disjoint units of every class it bills, text included: OpenAI's
// inclusion rules in one place. The input-side token classes are taken out of Prompt in the
// reverse of the registry's order (image and audio tokens, the 1-hour and 5-minute cache
// writes, then cached reads), each at most what is left (the upstream cannot cache more than
// it read), and Input is the rest; likewise the output-side token classes out of Completion,
// and Output is the rest.
// Units that are not tokens are kept as they are.
func (u Usage) Split() Units {
	out := make(Units, len(u.Units)+2)
	u.each(func(c ClassInfo, n int64) { out[c.Name] = n })
	return out
}

// each calls f with every class of Split and its units (> 0), allocating nothing.
func (u Usage) each(f func(ClassInfo, int64)) {
	in, outTok := u.Prompt, u.Completion
	for i := len(registry) - 1; i >= 0 && len(u.Units) > 0; i-- { // len 0: text only, most requests
		c := registry[i]
		n := u.Units[c.Name]
		if n <= 0 || !c.Tokens() || c.Name == Input || c.Name == Output {
			continue
		}
		switch c.Side {
		case SideInput:
			n = min(n, in)
			in -= n
		case SideOutput:
			n = min(n, outTok)
			outTok -= n
		}
		if n > 0 {
			f(c, n)
		}
	}
	for c, n := range u.Units {
		if info, ok := Lookup(c); ok && !info.Tokens() && info.Unit != Percent && n > 0 {
			f(info, n)
		}
	}
	if in > 0 {
		f(registry[byName[Input]], in)
	}
	if outTok > 0 {
		f(registry[byName[Output]], outTok)
	}
}

// Cost prices usage with the prices' defaults applied (Price):
//
//	cost = ceil(Σ units(c) × price(c) / per(c))   over the classes of Split
//
// where per(c) is 1,000,000 for token and character classes and 1 for the others, computed
// exactly in 128 bits and rounded up once, so a request is never under-charged: any fraction
// of a micro-unit costs a whole one. A token class the model has no price for is billed at the
// text price of its side (Input, Output: what such tokens cost before the class existed, for a
// deployment that lets them pass with middleware.Config.Allow); other units with no price are
// ErrUnpriced. Reasoning is informational. A result above balance.MaxAmount is
// ErrCostOverflow, never a wrong number.
func (p Prices) Cost(u Usage) (int64, error) {
	if err := u.Check(); err != nil {
		return 0, err
	}
	for c, v := range p {
		if v < 0 {
			return 0, fmt.Errorf("%w: negative price %s", ErrInvalidUsage, c)
		}
	}
	var perM u128 // Σ units × price over the classes quoted per 1,000,000
	var whole u128
	var unpriced error
	u.each(func(info ClassInfo, n int64) {
		price, ok := p.Price(info.Name)
		if !ok {
			switch {
			case info.Tokens() && info.Side == SideInput:
				price, _ = p.Price(Input)
			case info.Tokens() && info.Side == SideOutput:
				price, _ = p.Price(Output)
			default:
				unpriced = fmt.Errorf("%w: %s (%d units)", ErrUnpriced, info.Name, n)
			}
		}
		if info.Unit.per() == 1 {
			whole.addMul(uint64(n), uint64(price))
		} else {
			perM.addMul(uint64(n), uint64(price))
		}
	})
	if unpriced != nil {
		return 0, unpriced
	}
	if perM.overflow || perM.hi >= TokensPerPriceUnit || whole.overflow || whole.hi != 0 {
		return 0, ErrCostOverflow
	}
	q, r := bits.Div64(perM.hi, perM.lo, TokensPerPriceUnit)
	if r != 0 {
		q++
	}
	if q > uint64(balance.MaxAmount) || whole.lo > uint64(balance.MaxAmount)-q {
		return 0, ErrCostOverflow
	}
	return int64(q + whole.lo), nil
}

// MaxInputFor is the highest price an input token of a request that can bill the given classes
// is billed at: the largest price of the classes among them that bound input
// (ClassInfo.BoundsInput) and have a price, defaults applied; a class with no price is billed
// at the input price (Cost), which is always among them. nil classes: every class (MaxInput).
func (p Prices) MaxInputFor(classes []Class) int64 {
	return p.maxFor(classes, func(c ClassInfo) bool { return c.BoundsInput }, Input)
}

// MaxInput is the highest price any input token can be billed at: MaxInputFor(nil).
func (p Prices) MaxInput() int64 { return p.MaxInputFor(nil) }

// MaxOutputFor is the highest price an output token of a request that can bill the given
// classes is billed at (Output, AudioOutput, ImageOutput where given and priced); nil: every
// class.
func (p Prices) MaxOutputFor(classes []Class) int64 {
	return p.maxFor(classes, func(c ClassInfo) bool { return c.Tokens() && c.Side == SideOutput }, Output)
}

func (p Prices) maxFor(classes []Class, keep func(ClassInfo) bool, base Class) int64 {
	best, _ := p.Price(base)
	consider := func(c ClassInfo) {
		if keep(c) {
			if v, ok := p.Price(c.Name); ok {
				best = max(best, v)
			}
		}
	}
	if classes == nil {
		for _, c := range registry {
			consider(c)
		}
		return best
	}
	for _, name := range classes {
		if c, ok := Lookup(name); ok {
			consider(c)
		}
	}
	return best
}

// BoundFor is the most a request that can bill the given classes can cost with at most
// inputTokens in and outputTokens out: every input token at MaxInputFor(classes), every output
// token at MaxOutputFor(classes), rounded up like Cost. nil classes: every class (Bound).
func (p Prices) BoundFor(inputTokens, outputTokens int64, classes []Class) (int64, error) {
	if inputTokens < 0 || outputTokens < 0 {
		return 0, fmt.Errorf("%w: negative token count", ErrInvalidUsage)
	}
	var acc u128
	acc.addMul(uint64(inputTokens), uint64(p.MaxInputFor(classes)))
	acc.addMul(uint64(outputTokens), uint64(p.MaxOutputFor(classes)))
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

// Bound is BoundFor every class: the most a request can cost given at most inputTokens in and
// outputTokens out, whatever it bills.
func (p Prices) Bound(inputTokens, outputTokens int64) (int64, error) {
	return p.BoundFor(inputTokens, outputTokens, nil)
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

// Equal reports whether two usages count the same (nil and empty Units alike).
func (u Usage) Equal(o Usage) bool {
	return u.Prompt == o.Prompt && u.Completion == o.Completion && u.Reasoning == o.Reasoning && maps.Equal(u.Units, o.Units)
}

// OpenAICounts are the counts of an OpenAI usage object as OpenAI reports them: Prompt
// (prompt_tokens, input_tokens) includes Cached (prompt_tokens_details.cached_tokens) and
// AudioIn (prompt_tokens_details.audio_tokens); Completion includes Reasoning and AudioOut
// (completion_tokens_details.reasoning_tokens, .audio_tokens).
type OpenAICounts struct {
	Prompt, Cached, AudioIn, Completion, Reasoning, AudioOut int64
}

// Usage is the counts as disjoint units: OpenAI's inclusion rules in one place (Usage, Split).
// It allocates Units only when a class beyond text has units.
func (c OpenAICounts) Usage() Usage {
	u := Usage{Prompt: c.Prompt, Completion: c.Completion, Reasoning: c.Reasoning}
	if c.Cached != 0 || c.AudioIn != 0 || c.AudioOut != 0 {
		u.Units = nonZero(Units{CachedInput: c.Cached, AudioInput: c.AudioIn, AudioOutput: c.AudioOut})
	}
	return u
}

// AnthropicCounts are the counts of an Anthropic usage object: Input (input_tokens, the
// uncached ones only), CacheRead (cache_read_input_tokens), CacheWrite
// (cache_creation_input_tokens: every write), CacheWrite5m and CacheWrite1h (cache_creation's
// ephemeral_5m_input_tokens and ephemeral_1h_input_tokens), Output (output_tokens).
type AnthropicCounts struct {
	Input, CacheRead, CacheWrite, CacheWrite5m, CacheWrite1h, Output int64
}

// Usage maps the counts onto Usage: Prompt = input + every write + read; the writes are
// cache_creation_input_tokens or the sum of cache_creation's counts when that is more (no
// written token is billed as less), of which the 1-hour ones are CacheWrite1h and the rest
// CacheWrite.
func (c AnthropicCounts) Usage() Usage {
	write := max(c.CacheWrite, c.CacheWrite5m+c.CacheWrite1h)
	u := Usage{Prompt: c.Input + write + c.CacheRead, Completion: c.Output}
	if c.CacheRead != 0 || write != 0 {
		u.Units = nonZero(Units{CachedInput: c.CacheRead, CacheWrite: write - min(c.CacheWrite1h, write), CacheWrite1h: min(c.CacheWrite1h, write)})
	}
	return u
}

func nonZero(u Units) Units {
	maps.DeleteFunc(u, func(_ Class, n int64) bool { return n == 0 })
	if len(u) == 0 {
		return nil
	}
	return u
}

// IsDefault reports whether class c's price in p is what its default rule gives (a class
// whose default comes from another class, priced at that default, or not in p at all):
// listings leave such prices out.
func (p Prices) IsDefault(c Class) bool {
	v, set := p[c]
	if !set {
		return true
	}
	info, ok := Lookup(c)
	if !ok || info.Default.From == "" {
		return false
	}
	q := maps.Clone(p)
	delete(q, c)
	d, ok := q.Price(c)
	return ok && d == v
}

// Restrict is the prices of a request that can bill only the given classes: each token class
// outside them is priced at its side's text price (Input, Output), so that MaxInput, Bound and
// a Model's CostBound are MaxInputFor(classes)'s, BoundFor's and CostBoundFor's; the cost of
// usage of those classes is the same. Defaults applied. (Restrict(TextClasses) is what
// WithoutCacheWrites was.)
func (p Prices) Restrict(classes []Class) Prices {
	out := p.WithDefaults()
	in, _ := p.Price(Input)
	o, _ := p.Price(Output)
	for _, c := range registry {
		if !c.Tokens() || slices.Contains(classes, c.Name) {
			continue
		}
		if _, ok := out[c.Name]; !ok {
			continue
		}
		switch c.Side {
		case SideInput:
			out[c.Name] = in
		case SideOutput:
			out[c.Name] = o
		}
	}
	return out
}
