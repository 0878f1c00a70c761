package endpoint

import "github.com/llmescrow/escrow/pricing"

// Messages is Anthropic's Messages API: max_tokens is required (the upstream refuses a body
// without it), and with extended thinking thinking.budget_tokens must be ≥ 1,024 and below
// max_tokens. Cache writes (5-minute and 1-hour) are billed apart, so every input token is
// bounded at the highest of the input and cache-write prices.
var Messages = register(&Spec{
	Batch:        true, // a batch's lines may go here (batches.go)
	Path:         "/v1/messages",
	Provider:     Anthropic,
	Billed:       true,
	CapFields:    []string{"max_tokens"},
	FitField:     "max_tokens",
	CapRequired:  true,
	ThinkingMin:  DefaultMinThinking,
	TextParts:    []string{"text", "tool_use", "tool_result", "thinking", "redacted_thinking"},
	ImageParts:   []string{"image"},
	Images:       ImageRule{Low: 1600, High: 1600},
	ToolOverhead: 1024, // the tool-use system prompt: 346 tokens on Claude 4, 530 on Claude 3 Opus
	UsageJSON:    "usage",
	Stream:       StreamMessages,
	Classes:      pricing.CacheClasses,
	EndUserField: "metadata.user_id",
})
