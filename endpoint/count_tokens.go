package endpoint

// CountTokens is Anthropic's token counting: free upstream, so authenticated and passed on
// without a hold (routed by its model like the Messages it counts for).
var CountTokens = register(&Spec{
	Path:     "/v1/messages/count_tokens",
	Provider: Anthropic,
})
