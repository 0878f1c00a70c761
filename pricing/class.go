package pricing

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Class is a price class: one kind of thing a request can be billed for (text input tokens,
// cached input tokens, audio output tokens, one 1024x1024 hd image, one second of audio …).
// A model's Prices map classes to prices and a request's Usage counts units of classes. The
// registry (Classes, Lookup) is the one place a class is declared: its unit, its side, the
// rule that prices it when a model gives no price, and whether it bounds a request's input.
// Storage (a jsonb map), the admin API and the CLI handle classes generically from it.
type Class string

// The classes. Names are the keys of the stored price and unit maps and, with "_price" added,
// of a model's JSON in the admin API (input_price, cached_input_price …).
const (
	Input        Class = "input"                // text input tokens (the part of the prompt no other class counts)
	CachedInput  Class = "cached_input"         // input tokens read from the provider's prompt cache
	CacheWrite   Class = "cache_write_input"    // input tokens written to the 5-minute prompt cache
	CacheWrite1h Class = "cache_write_1h_input" // input tokens written to the 1-hour prompt cache
	Output       Class = "output"               // text output tokens (reasoning included)
	AudioInput   Class = "audio_input"          // audio input tokens
	AudioOutput  Class = "audio_output"         // audio output tokens
	ImageInput   Class = "image_input"          // image input tokens
	ImageOutput  Class = "image_output"         // image output tokens (gpt-image)
	AudioSecond  Class = "audio_second"         // one second of input audio (transcription by duration)
	Characters   Class = "characters"           // input characters (text-to-speech by character), per 1M
	// BatchDiscount is the batch API's discount, a percentage (0–100) off every other price
	// for the lines of a batch (Prices.Batch); default 50: half the live price, as OpenAI and
	// Anthropic bill batches. A stored 0 is no discount.
	BatchDiscount Class = "batch_discount"
)

// Family prefixes: a class named prefix + a suffix of [a-z0-9x.-] is one of the family.
const (
	perImagePrefix = "per_image_" // per_image_<size>_<quality>: one image of that size and quality
	toolCallPrefix = "tool_call_" // tool_call_<tool>: one call of a hosted tool (web_search …)
)

// PerImage is the class of one generated image of size ("1024x1024") and quality ("standard",
// "hd", "low" …; "" for a model with one quality).
func PerImage(size, quality string) Class {
	if quality == "" {
		return Class(perImagePrefix + size)
	}
	return Class(perImagePrefix + size + "_" + quality)
}

// ToolCall is the class of one call of the hosted tool named tool ("web_search").
func ToolCall(tool string) Class { return Class(toolCallPrefix + tool) }

// Unit is what a class's price is quoted for.
type Unit string

const (
	PerMTokens     Unit = "1M tokens"     // micro-units per 1,000,000 tokens
	PerItem        Unit = "item"          // micro-units per item (one image, one call)
	PerSecond      Unit = "second"        // micro-units per second
	PerMCharacters Unit = "1M characters" // micro-units per 1,000,000 characters
	Percent        Unit = "percent"       // a percentage, not a price per unit
)

// per is how many units one price is quoted for.
func (u Unit) per() int64 {
	if u == PerMTokens || u == PerMCharacters {
		return 1_000_000
	}
	return 1
}

// Side is which side of a request a class counts.
type Side uint8

const (
	SideNone   Side = iota // neither (a discount)
	SideInput              // input: token classes here are part of Usage.Prompt
	SideOutput             // output: token classes here are part of Usage.Completion
)

// DefaultRule is how a class is priced when a model gives it no price.
type DefaultRule struct {
	// From is the class whose price (its own default applied) times Mul prices this one; ""
	// for none.
	From Class
	Mul  int64
	// Value, when not 0, is the default itself (the batch discount's 50 percent).
	Value int64
	// Refuse: with no price the class cannot be billed; a request that can bill it is refused
	// (400) before it is served. When false and From is "", the default is 0.
	Refuse bool
}

// ClassInfo is one class of the registry.
type ClassInfo struct {
	Name Class
	Unit Unit
	Side Side
	// BoundsInput: an input token may be billed at this class's price, so a request's bound
	// prices its input at the highest such class it can bill (MaxInputFor).
	BoundsInput bool
	Default     DefaultRule
	Doc         string
}

// Tokens reports whether the class counts tokens (of Usage.Prompt or Usage.Completion).
func (c ClassInfo) Tokens() bool { return c.Unit == PerMTokens }

// registry is every fixed class, in the order listings show them. Split takes the input-side
// token classes out of Prompt in the reverse order (image and audio tokens, then the 1-hour and
// 5-minute cache writes, then cached reads), and the output-side ones out of Completion likewise.
var registry = []ClassInfo{
	{Input, PerMTokens, SideInput, true, DefaultRule{}, "text input tokens"},
	{CachedInput, PerMTokens, SideInput, true, DefaultRule{From: Input, Mul: 1}, "input tokens read from the prompt cache"},
	{CacheWrite, PerMTokens, SideInput, true, DefaultRule{From: Input, Mul: 1}, "input tokens written to the 5-minute prompt cache"},
	{CacheWrite1h, PerMTokens, SideInput, true, DefaultRule{From: Input, Mul: CacheWrite1hMultiplier}, "input tokens written to the 1-hour prompt cache"},
	{AudioInput, PerMTokens, SideInput, true, DefaultRule{Refuse: true}, "audio input tokens"},
	{ImageInput, PerMTokens, SideInput, true, DefaultRule{Refuse: true}, "image input tokens"},
	{Output, PerMTokens, SideOutput, false, DefaultRule{}, "text output tokens (reasoning included)"},
	{AudioOutput, PerMTokens, SideOutput, false, DefaultRule{Refuse: true}, "audio output tokens"},
	{ImageOutput, PerMTokens, SideOutput, false, DefaultRule{Refuse: true}, "image output tokens"},
	{AudioSecond, PerSecond, SideInput, false, DefaultRule{Refuse: true}, "seconds of input audio"},
	{Characters, PerMCharacters, SideInput, false, DefaultRule{Refuse: true}, "input characters"},
	{BatchDiscount, Percent, SideNone, false, DefaultRule{Value: DefaultBatchDiscount}, "batch API discount, percent off every price of a batch's lines"},
}

// DefaultBatchDiscount is the batch discount of a model that states none: batches cost half.
const DefaultBatchDiscount = 50

// families are the parameterized classes.
var families = []ClassInfo{
	{perImagePrefix + "<size>_<quality>", PerItem, SideOutput, false, DefaultRule{Refuse: true}, "one generated image of that size and quality"},
	{toolCallPrefix + "<tool>", PerItem, SideNone, false, DefaultRule{Refuse: true}, "one call of that hosted tool"},
}

var familySuffix = regexp.MustCompile(`^[a-z0-9][a-z0-9x._-]{0,63}$`)

var byName = func() map[Class]int {
	m := make(map[Class]int, len(registry))
	for i, c := range registry {
		m[c.Name] = i
	}
	return m
}()

// Classes is the registry: every fixed class, then one entry per family (its Name a pattern).
func Classes() []ClassInfo { return slices.Concat(registry, families) }

// Lookup returns the class named c; ok is false for a name that is no class.
func Lookup(c Class) (ClassInfo, bool) {
	if i, ok := byName[c]; ok {
		return registry[i], true
	}
	for _, f := range families {
		prefix := string(f.Name[:strings.IndexByte(string(f.Name), '<')])
		if s, ok := strings.CutPrefix(string(c), prefix); ok && familySuffix.MatchString(s) {
			f.Name = c
			return f, true
		}
	}
	return ClassInfo{}, false
}

// ParseClass is Lookup with an error naming a class that does not exist.
func ParseClass(s string) (Class, error) {
	if _, ok := Lookup(Class(s)); !ok {
		return "", fmt.Errorf("%w: %q is not a price class", ErrUnknownClass, s)
	}
	return Class(s), nil
}

// Text classes an endpoint can bill (the sets MaxInputFor, BoundFor and CostBoundFor take).
var (
	// TextClasses: an OpenAI text request (cached reads, no cache writes).
	TextClasses = []Class{Input, CachedInput, Output}
	// CacheClasses: an Anthropic Messages request (cache reads and writes).
	CacheClasses = []Class{Input, CachedInput, CacheWrite, CacheWrite1h, Output}
	// AudioClasses: added to TextClasses for a chat request with audio input or output.
	AudioClasses = []Class{AudioInput, AudioOutput}
)
