package server

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// countingTransport counts the requests the SDK really sends (retries included).
type countingTransport struct{ n atomic.Int64 }

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return http.DefaultTransport.RoundTrip(r)
}

func sdk(p *testProxy, key string, tr http.RoundTripper) openai.Client {
	return openai.NewClient(option.WithBaseURL(p.base+"/v1/"), option.WithAPIKey(key),
		option.WithHTTPClient(&http.Client{Transport: tr}))
}

// TestOpenAIClient drives the proxy with the official openai-go client: chat (plain and
// streamed, the stream without a usage request), Responses (plain and streamed) and embeddings
// all succeed and are billed; a 429 insufficient_quota is not retried by the SDK.
func TestOpenAIClient(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		ctx := context.Background()
		key := p.setup("acme", 100_000, 65)
		p.admin("PUT", "/models/emb", map[string]any{"input_price": 1_000_000, "max_input_tokens": 8192, "max_output_tokens": 1, "default_hold": 100}, http.StatusOK, nil)
		c := sdk(p, key, http.DefaultTransport)
		var billed int64

		chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: "m", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there world")},
		})
		if err != nil || chat.Usage.PromptTokens != 3 || chat.Usage.CompletionTokens != 20 || len(chat.Choices) != 1 {
			t.Fatalf("chat: %+v %v", chat, err)
		}
		billed += 20

		stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model: "m", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream to me")},
		})
		var text strings.Builder
		chunks := 0
		for stream.Next() {
			ch := stream.Current()
			chunks++
			if ch.JSON.Usage.Valid() {
				t.Fatalf("client did not ask for usage but got a usage field: %s", ch.RawJSON())
			}
			for _, choice := range ch.Choices {
				text.WriteString(choice.Delta.Content)
			}
		}
		if err := stream.Err(); err != nil || chunks == 0 || text.Len() == 0 {
			t.Fatalf("chat stream: %d chunks, %q, %v", chunks, text.String(), err)
		}
		billed += 20

		resp, err := c.Responses.New(ctx, responses.ResponseNewParams{
			Model: "m", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("one two three four")},
		})
		if err != nil || resp.Usage.InputTokens != 4 || resp.Usage.OutputTokens != 20 {
			t.Fatalf("responses: %+v %v", resp.Usage, err)
		}
		billed += 20

		rs := c.Responses.NewStreaming(ctx, responses.ResponseNewParams{
			Model: "m", Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("stream a response")},
		})
		completed := false
		for rs.Next() {
			if ev := rs.Current(); ev.Type == "response.completed" {
				completed = ev.Response.Usage.OutputTokens == 20
			}
		}
		if err := rs.Err(); err != nil || !completed {
			t.Fatalf("responses stream: completed=%v %v", completed, err)
		}
		billed += 20

		emb, err := c.Embeddings.New(ctx, openai.EmbeddingNewParams{
			Model: "emb", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("embed these five words please")},
		})
		if err != nil || emb.Usage.PromptTokens != 5 || len(emb.Data) != 1 {
			t.Fatalf("embeddings: %+v %v", emb, err)
		}
		billed += 5

		if b := p.settled("acme"); b.LedgerBalance != 100_000-billed || b.Available != 100_000-billed {
			t.Fatalf("after the SDK calls: %+v, want %d", b, 100_000-billed)
		}

		// A broke org: the SDK sees insufficient_quota and does not retry it.
		broke := p.setup("broke", 0, 65)
		ct := &countingTransport{}
		bc := sdk(p, broke, ct)
		_, err = bc.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model: "m", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
		})
		var apiErr *openai.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusTooManyRequests || apiErr.Code != "insufficient_quota" {
			t.Fatalf("broke org: %v", err)
		}
		if n := ct.n.Load(); n != 1 {
			t.Fatalf("the SDK sent %d requests for an insufficient_quota 429, want 1 (x-should-retry: false)", n)
		}
	})
}
