package middleware

import (
	"context"
	"testing"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestAudioClassesHold: a chat request with audio is held at the bound over the classes it can
// bill — its input at the audio input price, its output at the audio output price — and only
// passes when the model prices both audio classes (or Config.Allow names "audio"); a text
// request to the same model is bounded at the text prices.
func TestAudioClassesHold(t *testing.T) {
	t.Parallel()
	m := ledger.Model{Name: "a", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000,
		pricing.AudioInput: 10_000_000, pricing.AudioOutput: 20_000_000}, MaxInputTokens: 1000, MaxOutputTokens: 100}
	audio := Request{Spec: endpoint.Chat, Size: 100, N: 1, Features: []string{"audio"}}
	if got, err := HoldAmount(context.Background(), HoldInput{Request: audio, Model: m, Fallback: 1}); err != nil || got != 1000*10+100*20 {
		t.Fatalf("audio hold = %d %v, want %d", got, err, 1000*10+100*20)
	}
	text := Request{Spec: endpoint.Chat, Size: 100, N: 1}
	if got, err := HoldAmount(context.Background(), HoldInput{Request: text, Model: m, Fallback: 1}); err != nil || got != 1000*1+100*2 {
		t.Fatalf("text hold = %d %v", got, err)
	}
	mw := &middleware{allow: map[string]bool{}}
	if e := mw.pricedFeatures(m, audio); e != nil {
		t.Fatalf("priced audio refused: %v", e)
	}
	half := m
	half.Prices = pricing.Prices{pricing.Input: 1, pricing.Output: 2, pricing.AudioInput: 10}
	if e := mw.pricedFeatures(half, audio); e == nil || e.Param != "audio" {
		t.Fatalf("audio without an output price: %+v", e)
	}
	mw.allow["audio"] = true
	if e := mw.pricedFeatures(half, audio); e != nil {
		t.Fatalf("audio allowed by Config.Allow refused: %v", e)
	}
}
