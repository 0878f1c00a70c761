package endpoint

import "github.com/llmescrow/escrow/pricing"

// Embeddings is OpenAI's embeddings: input tokens only, bounded by the body's bytes (an array
// of inputs is one request: its bytes bound all of them). No cap field: any is refused.
var Embeddings = register(&Spec{
	Batch:        true, // a batch's lines may go here (batches.go)
	Path:         "/v1/embeddings",
	Provider:     OpenAI,
	Billed:       true,
	NoOutput:     true,
	UsageJSON:    "usage",
	Classes:      []pricing.Class{pricing.Input},
	EndUserField: "user",
})
