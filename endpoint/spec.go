// Package endpoint declares the endpoints escrow meters (DESIGN.md "Endpoints"): one Spec per
// endpoint, one file each, and the only place that knows an endpoint. A Spec is data — the path
// and provider, the cap fields the upstream reads and its default when none is sent, the choice
// multipliers, how each input part is bounded, where usage is, the price classes it can bill —
// plus a few small functions over it. The middleware dispatches through it and compares no
// path; this package knows no Redis, Postgres or HTTP handler.
package endpoint

import (
	"slices"

	"github.com/llmescrow/escrow/pricing"
)

// Provider is the API an endpoint belongs to: the shape of its bodies, errors and usage.
type Provider uint8

const (
	OpenAI    Provider = iota + 1 // OpenAI's shapes: {"error":{"message","type","param","code"}}
	Anthropic                     // Anthropic's: {"type":"error","error":{"type","message"}}
)

// Stream is how usage arrives in an event stream of the endpoint.
type Stream uint8

const (
	// StreamChunks: data-only chunks ending with "data: [DONE]"; usage in a last chunk with
	// "choices": [] when stream_options.include_usage is true (escrow asks for it: InjectUsage).
	StreamChunks Stream = iota + 1
	// StreamResponses: typed events; usage in response.completed / .incomplete / .failed's
	// response.usage; no [DONE].
	StreamResponses
	// StreamMessages: Anthropic's events; input counts in message_start's message.usage, the
	// cumulative output in message_delta's usage.
	StreamMessages
)

// ImageRule bounds the input tokens of one image part: the provider's published rule at its
// largest, per detail. OpenAI's tile rule (GPT-4o, o-series): an image is scaled to fit
// 2048×2048, then its short side to 768, and costs 85 tokens plus 170 per 512-pixel tile — at
// most 8 tiles (768×2048), 1,445 tokens; "low" is 85 whatever the size. Anthropic: about
// width × height / 750 tokens, images past 1.15 megapixels scaled down, so at most ≈ 1,600.
// A model whose rule gives more (gpt-4o-mini's 2,833 + 5,667 per tile; the patch rule of
// gpt-4.1-mini and o4-mini) needs its own max (middleware Config.ImageTokens).
type ImageRule struct {
	Low  int64 // detail "low"
	High int64 // detail "high", "auto" or none
}

// Spec declares one endpoint.
type Spec struct {
	Path     string
	Provider Provider
	// Billed is false for an endpoint passed on unbilled (authenticated, without a hold).
	Billed bool
	// Batch: a batch's lines may call the endpoint (its provider's batch API), each checked
	// and bounded like a live request (batches.go).
	Batch bool

	// CapFields are the output-cap fields the endpoint's upstream reads (chat reads
	// max_completion_tokens, else max_tokens). Every other cap field (CapNames) is refused.
	CapFields []string
	// FitField is the cap field written into a body that has none.
	FitField string
	// DefaultCap is the cap the upstream applies when none is sent (legacy completions: 16);
	// 0: the model's max output tokens.
	DefaultCap int64
	// CapRequired: the upstream refuses a body without a cap (Anthropic's max_tokens).
	CapRequired bool
	// NoOutput: the endpoint bills input only (embeddings); it has no cap.
	NoOutput bool
	// ThinkingMin, when > 0, is the smallest thinking.budget_tokens the upstream takes; the
	// budget must also stay below the cap (Anthropic extended thinking).
	ThinkingMin int64

	// Choices are the fields whose largest value multiplies every bound: each choice is
	// generated and billed in full (n, best_of).
	Choices []string
	// PromptArray is the field whose array elements are each completed on their own (legacy
	// completions' prompt), "" for none.
	PromptArray string

	// TextParts are the content-part types whose tokens the body's bytes bound.
	TextParts []string
	// ImageParts are the content-part types that carry an image, bounded by Images.
	ImageParts []string
	Images     ImageRule
	// ToolOverhead is the most tokens the upstream adds to the input for tool definitions
	// (besides their bytes): Anthropic's tool-use system prompt is 346 tokens (Claude 4);
	// OpenAI renders function definitions into a system message with a short preamble.
	ToolOverhead int64

	// UsageJSON is the member of a JSON response that carries usage.
	UsageJSON string
	// Stream is how usage arrives in an event stream (0: the endpoint does not stream).
	Stream Stream
	// InjectUsage: a stream of this endpoint carries usage only when asked
	// (stream_options.include_usage): escrow asks, and hides the extra chunk from the client.
	InjectUsage bool
	// Classes are the price classes a response can bill; the bound prices every input token at
	// the highest input class among them.
	Classes []pricing.Class
	// EndUserField is where a body names its end user.
	EndUserField string

	// Free: the endpoint costs nothing (moderations). Its requests are authenticated,
	// attributed (a usage event of cost 0) and counted by request limits, with a zero hold: no
	// money is held and no price is needed.
	Free bool
	// DefaultModel is the model a body without one is attributed to ("": a model is required).
	DefaultModel string
	// Prove, when set, prices a request from what its body states, before the call (images by
	// size, quality and n; speech by the characters of its input): the units it bills. The hold
	// is their cost and so is the charge: no usage is read from the response (proven.go).
	Prove func(Stated) (pricing.Usage, *Refusal)
	// Multipart: the body is a multipart/form-data upload (image edits), its fields read as
	// Stated.
	Multipart bool
	// StatedFields are the top-level fields the middleware reads into Stated for Prove or Free
	// (the model, stream and the end-user field are always read).
	StatedFields []string
	// Usage, when set on a proven spec, reads the usage of its answer (the JSON member usage):
	// what Prove gave is then the hold, a bound, and the answer's usage is the bill (gpt-image
	// tokens, a transcription's tokens or seconds); an answer without one is billed the hold.
	Usage func(UsageObject) (pricing.Usage, bool)
}

// CapNames are the output-cap fields of every endpoint: a body that sends one its endpoint does
// not define is refused (Foreign), never held by it.
var CapNames = []string{"max_tokens", "max_completion_tokens", "max_output_tokens"}

// DefaultMinThinking is Anthropic's smallest thinking budget.
const DefaultMinThinking = 1024

var specs = map[string]*Spec{}

func register(s *Spec) *Spec {
	specs[s.Path] = s
	return s
}

// Lookup is the spec of a path, nil when escrow meters no such endpoint.
func Lookup(path string) *Spec { return specs[path] }

// All is every spec, in no particular order.
func All() []*Spec {
	out := make([]*Spec, 0, len(specs))
	for _, s := range specs {
		out = append(out, s)
	}
	return out
}

// Reads reports whether the endpoint's upstream reads cap field f.
func (s *Spec) Reads(f string) bool { return slices.Contains(s.CapFields, f) }

// Foreign reports whether f is an output-cap field of some endpoint that s does not define: a
// body sending it is refused (OpenAI answers such a field with a 400 naming it).
func (s *Spec) Foreign(f string) bool { return slices.Contains(CapNames, f) && !s.Reads(f) }

// Bills reports whether a response of the endpoint can bill price class c.
func (s *Spec) Bills(c pricing.Class) bool { return slices.Contains(s.Classes, c) }

// TextPart reports whether a content part of type typ is text that the body's bytes bound.
func (s *Spec) TextPart(typ string) bool { return slices.Contains(s.TextParts, typ) }

// ImagePart reports whether a content part of type typ is an image (bounded by s.Images).
func (s *Spec) ImagePart(typ string) bool { return slices.Contains(s.ImageParts, typ) }

// ImageTokens is the most tokens one image part with the given detail can bill, maxHigh
// replacing the spec's rule for high or auto detail when > 0 (a model's own max).
func (s *Spec) ImageTokens(detail string, maxHigh int64) int64 {
	if detail == "low" && s.Images.Low > 0 {
		return s.Images.Low
	}
	if maxHigh > 0 {
		return maxHigh
	}
	return s.Images.High
}

// UpstreamCap is the cap the upstream applies to a body: sent (> 0) when the body has one, else
// the spec's default, else modelMax (0 when none is known, or the endpoint has no output).
func (s *Spec) UpstreamCap(sent, modelMax int64) int64 {
	switch {
	case s.NoOutput:
		return 0
	case sent > 0:
		return sent
	case s.DefaultCap > 0:
		return s.DefaultCap
	}
	return modelMax
}

// Thinking is what fit must keep valid for a thinking budget: budget (0: none) with a cap c.
// It returns the budget to write (≤ budget) and ok; ok is false when no valid budget fits
// under c (the request must be refused).
func (s *Spec) Thinking(budget, c int64) (newBudget int64, ok bool) {
	if s.ThinkingMin <= 0 || budget <= 0 || budget < c {
		return budget, true
	}
	if c-1 < s.ThinkingMin {
		return 0, false
	}
	return c - 1, true
}

// MinCap is the smallest cap a request with a thinking budget can be fitted to (0: any).
func (s *Spec) MinCap(budget int64) int64 {
	if s.ThinkingMin <= 0 || budget <= 0 {
		return 0
	}
	return s.ThinkingMin + 1
}
