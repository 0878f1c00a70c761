package middleware

import (
	"context"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

func TestHoldAmount(t *testing.T) {
	t.Parallel()
	// 1 micro-unit per token in, 2 out: the bound is size + 2×cap.
	m := ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000}, MaxOutputTokens: 1000}
	plain := Request{Endpoint: EndpointChat, Size: 100, N: 1, PlainText: true, OutputCap: 50}
	tests := []struct {
		name    string
		r       Request
		m       ledger.Model
		learned int64
		want    int64
	}{
		{"plain, no cap: the bound with the model's max output, not the learned max", Request{Endpoint: EndpointChat, Size: 100, N: 1, PlainText: true}, m, 5000, 2100},
		{"learned lowered to the bound", plain, m, 5000, 200},
		{"a learned max below the bound does not lower it", plain, m, 150, 200},
		{"bound × n", func() Request { r := plain; r.N = 3; return r }(), m, 5000, 600},
		{"not plain: learned", func() Request { r := plain; r.PlainText = false; return r }(), m, 5000, 5000},
		{"model max cost when store has none", func() Request { r := plain; r.PlainText = false; return r }(), func() ledger.Model { x := m; x.MaxCost = 180; return x }(), 0, 180},
		{"no learned: the request bound", plain, m, 0, 200},
		{"no learned, no cap: bound with max output", Request{Endpoint: EndpointChat, Size: 100, N: 1, PlainText: true}, m, 0, 2100},
		{"not plain, no learned: the model's bound", Request{Endpoint: EndpointChat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxInputTokens = 300; return x }(), 0, 2300},
		{"not plain, no learned, model bound unknown: fallback", Request{Endpoint: EndpointChat, Size: 100, N: 1}, m, 0, 999},
		// Every prompt of a prompt array is completed: the output bound (and any learned max) × prompts.
		{"prompt array: output × prompts", Request{Endpoint: EndpointCompletions, Size: 100, N: 1, Prompts: 3, PlainText: true, OutputCap: 50}, m, 5000, 100 + 3*2*50},
		{"prompt array × n", Request{Endpoint: EndpointCompletions, Size: 100, N: 2, Prompts: 3, PlainText: true, OutputCap: 50}, m, 5000, 2 * (100 + 3*2*50)},
		{"prompt array, not plain: learned × prompts × n", Request{Endpoint: EndpointCompletions, Size: 100, N: 2, Prompts: 3, OutputCap: 50}, m, 5000, 6 * 5000},
		{"no learned, no limits: model default", Request{Endpoint: EndpointChat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; x.DefaultHold = 77; return x }(), 0, 77},
		{"nothing known: fallback", Request{Endpoint: EndpointChat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; return x }(), 0, 999},
		{"embeddings: input alone", Request{Endpoint: EndpointEmbeddings, Size: 100, N: 1, PlainText: true}, m, 5000, 100},
		{"free model never zero", plain, ledger.Model{Name: "free", MaxOutputTokens: 10}, 0, 999},
		// n (or best_of) multiplies every amount: each choice is generated and billed in full.
		{"learned × n", func() Request { r := plain; r.N = 16; r.PlainText = false; return r }(), m, 5000, 80_000},
		{"learned × n, lowered to the bound × n", func() Request { r := plain; r.N = 16; return r }(), m, 5000, 3200},
		{"learned × n clamps", func() Request { r := plain; r.N = 1 << 40; r.PlainText = false; return r }(), m, 5000, balance.MaxAmount},
		{"learned capped at the model's bound, then × n", func() Request { r := plain; r.N = 4; r.PlainText = false; return r }(),
			func() ledger.Model { x := m; x.MaxInputTokens = 100; return x }(), 1_000_000, 4 * 2100},
		{"no learned, no cap: bound with max output × n", Request{Endpoint: EndpointChat, Size: 100, N: 3, PlainText: true}, m, 0, 3 * 2100},
		{"no learned, no limits: model default × n", Request{Endpoint: EndpointChat, Size: 100, N: 5},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; x.DefaultHold = 77; return x }(), 0, 385},
		{"nothing known: fallback × n", Request{Endpoint: EndpointChat, Size: 100, N: 2},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; return x }(), 0, 1998},
		{"overflow clamps", Request{Endpoint: EndpointChat, Size: 100, N: 1, PlainText: true},
			ledger.Model{Prices: pricing.Prices{pricing.Input: balance.MaxAmount, pricing.Output: balance.MaxAmount}, MaxOutputTokens: 1 << 40}, 0, balance.MaxAmount},
	}
	for _, tt := range tests {
		got, err := HoldAmount(context.Background(), HoldInput{Request: tt.r, Model: tt.m, LearnedMax: tt.learned, Fallback: 999})
		if err != nil || got != tt.want {
			t.Errorf("%s: got %d %v, want %d", tt.name, got, err, tt.want)
		}
	}
}
