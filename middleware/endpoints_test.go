package middleware

import "github.com/llmescrow/escrow/endpoint"

// The endpoints' paths, for the tests (the middleware itself reads them from package endpoint).
var (
	EndpointChat        = endpoint.Chat.Path
	EndpointCompletions = endpoint.Completions.Path
	EndpointEmbeddings  = endpoint.Embeddings.Path
	EndpointResponses   = endpoint.Responses.Path
	EndpointMessages    = endpoint.Messages.Path
	EndpointCountTokens = endpoint.CountTokens.Path
)
var specMessages = endpoint.Messages

// withCap is body as escrow forwards it when it sent no cap (issue 32): the cap its hold
// priced added, as the first member, in field.
func withCap(body, field string, c int64) string {
	return string(addTopRaw([]byte(body), field, []byte(itoa(c))))
}
