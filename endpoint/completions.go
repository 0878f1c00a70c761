package endpoint

import "github.com/llmescrow/escrow/pricing"

// Completions is OpenAI's legacy completions. The upstream reads max_tokens and, when none is
// sent, generates at most 16 tokens (OpenAI's and vLLM's default): a body without one is held
// at 16 and sent with max_tokens: 16. Each prompt of a prompt array is completed on its own,
// best_of times (n ≤ best_of).
var Completions = register(&Spec{
	Batch:        true, // a batch's lines may go here (batches.go)
	Path:         "/v1/completions",
	Provider:     OpenAI,
	Billed:       true,
	CapFields:    []string{"max_tokens"},
	FitField:     "max_tokens",
	DefaultCap:   16,
	Choices:      []string{"n", "best_of"},
	PromptArray:  "prompt",
	UsageJSON:    "usage",
	Stream:       StreamChunks,
	InjectUsage:  true,
	Classes:      pricing.TextClasses,
	EndUserField: "user",
})
