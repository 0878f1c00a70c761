package endpoint

import "github.com/llmescrow/escrow/pricing"

// Responses is OpenAI's Responses API. The upstream reads max_output_tokens (reasoning
// included) and otherwise generates up to the model's max output. previous_response_id,
// conversation, stored prompts, file ids and hosted tools bring server-side context the body's
// bytes do not bound.
var Responses = register(&Spec{
	Batch:        true, // a batch's lines may go here (batches.go)
	Path:         "/v1/responses",
	Provider:     OpenAI,
	Billed:       true,
	CapFields:    []string{"max_output_tokens"},
	FitField:     "max_output_tokens",
	TextParts:    []string{"input_text", "output_text"},
	ImageParts:   []string{"input_image"},
	Images:       openAIImages,
	ToolOverhead: openAIToolOverhead,
	UsageJSON:    "usage",
	Stream:       StreamResponses,
	Classes:      pricing.TextClasses,
	EndUserField: "user",
})
