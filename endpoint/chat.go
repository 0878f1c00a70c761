package endpoint

import "github.com/llmescrow/escrow/pricing"

// Chat is OpenAI's chat completions. The upstream reads max_completion_tokens, else
// max_tokens (a reasoning model counts its reasoning within the cap); with neither it may
// generate up to the model's max output.
var Chat = register(&Spec{
	Batch:        true, // a batch's lines may go here (batches.go)
	Path:         "/v1/chat/completions",
	Provider:     OpenAI,
	Billed:       true,
	CapFields:    []string{"max_completion_tokens", "max_tokens"},
	FitField:     "max_completion_tokens",
	Choices:      []string{"n"},
	TextParts:    []string{"text", "refusal"},
	ImageParts:   []string{"image_url"},
	Images:       openAIImages,
	ToolOverhead: openAIToolOverhead,
	UsageJSON:    "usage",
	Stream:       StreamChunks,
	InjectUsage:  true,
	Classes:      pricing.TextClasses,
	EndUserField: "user",
})

// openAIImages is OpenAI's tile rule at its largest (ImageRule).
var openAIImages = ImageRule{Low: 85, High: 85 + 170*8}

// openAIToolOverhead bounds the preamble OpenAI adds around function definitions (a few
// tokens per function and a fixed header; generous).
const openAIToolOverhead = 1024
