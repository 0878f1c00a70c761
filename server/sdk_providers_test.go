package server

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"

	"github.com/llmescrow/escrow/pricing"
)

// TestSDKsOneProxy: the official openai-go client and @anthropic-ai/sdk (sdktest/anthropic.mjs)
// drive one proxy that routes gpt-t to a fake OpenAI upstream and claude-t to a fake Anthropic
// upstream (a routes file); the org, charged by both, ends exactly at its funds less the sum of
// the usage each SDK reported, priced at each model's prices. Through the routed upstream too, a
// max_tokens the balance cannot cover is fitted and the Anthropic SDK reads the cap (issue 23).
func TestSDKsOneProxy(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "@anthropic-ai/sdk")
	p := startProvidersProxy(t, true)
	const funds = 10_000_000
	key := p.setupClaude("sdks", funds)
	poor := p.setupClaude("sdks-poor", 5)
	const smallFunds = 50_000
	small, smallStream := p.priceOrg("sdk-small", smallFunds), p.priceOrg("sdk-small-stream", smallFunds)
	p.admin("PUT", "/models/gpt-t", map[string]any{"input_price": gptPrices[pricing.Input], "cached_input_price": gptPrices[pricing.CachedInput],
		"output_price": gptPrices[pricing.Output], "max_input_tokens": 100_000, "max_output_tokens": 1000}, http.StatusOK, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var total int64

	// The OpenAI SDK: JSON and a stream with usage.
	c := sdk(p.testProxy, key, http.DefaultTransport)
	chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model: "gpt-t", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hello there world [cached:1]")},
	})
	if err != nil || chat.Usage.PromptTokens != 4 || chat.Usage.PromptTokensDetails.CachedTokens != 1 {
		t.Fatalf("chat: %+v %v", chat.Usage, err)
	}
	usages := []pricing.Usage{pricing.OpenAICounts{Prompt: chat.Usage.PromptTokens, Cached: chat.Usage.PromptTokensDetails.CachedTokens, Completion: chat.Usage.CompletionTokens}.Usage()}
	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model: "gpt-t", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("stream to me")},
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var su *pricing.Usage
	for stream.Next() {
		if ch := stream.Current(); ch.JSON.Usage.Valid() {
			su = &pricing.Usage{Prompt: ch.Usage.PromptTokens, Completion: ch.Usage.CompletionTokens, Units: pricing.Units{pricing.CachedInput: ch.Usage.PromptTokensDetails.CachedTokens}}
		}
	}
	if err := stream.Err(); err != nil || su == nil || su.Prompt != 3 {
		t.Fatalf("chat stream: %+v %v", su, err)
	}
	usages = append(usages, *su)
	for _, u := range usages {
		cost, err := gptPrices.Cost(u)
		if err != nil {
			t.Fatal(err)
		}
		total += cost
	}

	// The Anthropic SDK: JSON, a stream and the beta client with cache writes and reads,
	// refusals, and fitted requests.
	out := runSDKScript(ctx, t, node, "anthropic.mjs", p.base, key, poor, "claude-t",
		"ESCROW_SMALL_KEY="+small, "ESCROW_SMALL_STREAM_KEY="+smallStream)
	var res struct {
		JSON, Stream, Beta struct {
			Usage anthUsage `json:"usage"`
		}
		Refused *struct {
			Status   int    `json:"status"`
			Type     string `json:"type"`
			Attempts int    `json:"attempts"`
		}
		RefusedLarge *sdkRefusal `json:"refusedLarge"`
		Fit          *sdkFits    `json:"fit"`
		FitOff       *sdkRefusal `json:"fitOff"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
		t.Fatalf("node output %s: %v", out, err)
	}
	if res.JSON.Usage.CacheWrite == 0 || res.Stream.Usage != res.JSON.Usage || res.Beta.Usage != res.JSON.Usage || res.Refused == nil || res.Refused.Status != 402 ||
		res.Refused.Type != "billing_error" || res.Refused.Attempts != 1 || res.RefusedLarge == nil ||
		res.RefusedLarge.Status != 402 || res.RefusedLarge.Type != "billing_error" || res.RefusedLarge.Attempts != 1 {
		t.Fatalf("the Anthropic SDK reported %+v", res)
	}
	checkAnthropicFit(t, p.testProxy, p.anthropic, res.Fit, res.FitOff, smallFunds)
	for _, u := range []anthUsage{res.JSON.Usage, res.Stream.Usage, res.Beta.Usage} {
		cost, err := claudePrices.Cost(u.usage())
		if err != nil {
			t.Fatal(err)
		}
		total += cost
	}

	if b := p.settled("sdks"); b.LedgerBalance != funds-total || b.Available != funds-total || b.Held != 0 {
		t.Fatalf("ledger %+v, want %d (Σ what the SDKs reported: %d)", b, funds-total, total)
	}
	if b := p.settled("sdks-poor"); b.LedgerBalance != 5 || b.Held != 0 {
		t.Fatalf("poor org: %+v", b)
	}
	if n, m := len(p.openai.Seen()), len(p.anthropic.Seen()); n != 2 || m != 5 {
		t.Fatalf("upstream requests: OpenAI %d, Anthropic %d; want 2 and 5 (the beta call, 2 fitted)", n, m)
	}
}
