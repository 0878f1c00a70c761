package server

import "github.com/llmescrow/escrow/endpoint"

// The Messages API's routes (/v1/messages, /v1/messages/count_tokens) are routed by model like
// the OpenAI ones, to the anthropic-style routes (upstreams.go): a routes file's, or the
// catch-all of ESCROW_ANTHROPIC_URL (or of the in-process upstream), the key sent as x-api-key.

func isAnthropicPath(path string) bool {
	s := endpoint.Lookup(path)
	return s != nil && s.Provider == endpoint.Anthropic
}
