package middleware

import (
	"context"
	"github.com/llmescrow/escrow/endpoint"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

func TestHoldAmount(t *testing.T) {
	t.Parallel()
	// 1 micro-unit per token in, 2 out: the bound is size + 2×cap.
	m := ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000}, MaxOutputTokens: 1000}
	plain := Request{Spec: endpoint.Chat, Size: 100, N: 1, Bounded: true, OutputCap: 50}
	tests := []struct {
		name    string
		r       Request
		m       ledger.Model
		learned int64
		want    int64
	}{
		{"plain, no cap: the bound with the model's max output, not the learned max", Request{Spec: endpoint.Chat, Size: 100, N: 1, Bounded: true}, m, 5000, 2100},
		{"learned lowered to the bound", plain, m, 5000, 200},
		{"a learned max below the bound does not lower it", plain, m, 150, 200},
		{"bound × n", func() Request { r := plain; r.N = 3; return r }(), m, 5000, 600},
		{"not plain: learned", func() Request { r := plain; r.Bounded = false; return r }(), m, 5000, 5000},
		{"model max cost when store has none", func() Request { r := plain; r.Bounded = false; return r }(), func() ledger.Model { x := m; x.MaxCost = 280; return x }(), 0, 280},
		{"no learned: the request bound", plain, m, 0, 200},
		{"no learned, no cap: bound with max output", Request{Spec: endpoint.Chat, Size: 100, N: 1, Bounded: true}, m, 0, 2100},
		{"not plain, no learned: the model's bound", Request{Spec: endpoint.Chat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxInputTokens = 300; return x }(), 0, 2300},
		{"not plain, no learned, model bound unknown: fallback", Request{Spec: endpoint.Chat, Size: 100, N: 1, OutputCap: 1}, m, 0, 999},
		// Issue 32: a request that is not bounded holds at least what it states.
		{"not plain: at least what it states", Request{Spec: endpoint.Chat, Size: 100, N: 1}, m, 5000, 5000},
		{"not plain: what it states above the learned max", Request{Spec: endpoint.Chat, Size: 100, N: 1}, m, 1000, 2100},
		{"not plain, no learned: at least what it states", Request{Spec: endpoint.Chat, Size: 100, N: 1}, m, 0, 2100},
		{"images and tools add to the bound", Request{Spec: endpoint.Chat, Size: 100, N: 1, Bounded: true, OutputCap: 50, PartTokens: 1445}, m, 5000, 100 + 1445 + 100},
		{"completions without a cap: the upstream's default of 16", Request{Spec: endpoint.Completions, Size: 100, N: 1, Bounded: true}, m, 5000, 100 + 2*16},
		// Every prompt of a prompt array is completed: the output bound (and any learned max) × prompts.
		{"prompt array: output × prompts", Request{Spec: endpoint.Completions, Size: 100, N: 1, Prompts: 3, Bounded: true, OutputCap: 50}, m, 5000, 100 + 3*2*50},
		{"prompt array × n", Request{Spec: endpoint.Completions, Size: 100, N: 2, Prompts: 3, Bounded: true, OutputCap: 50}, m, 5000, 2 * (100 + 3*2*50)},
		{"prompt array, not plain: learned × prompts × n", Request{Spec: endpoint.Completions, Size: 100, N: 2, Prompts: 3, OutputCap: 50}, m, 5000, 6 * 5000},
		{"no learned, no limits: model default", Request{Spec: endpoint.Chat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; x.DefaultHold = 177; return x }(), 0, 177},
		{"nothing known: fallback", Request{Spec: endpoint.Chat, Size: 100, N: 1},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; return x }(), 0, 999},
		{"embeddings: input alone", Request{Spec: endpoint.Embeddings, Size: 100, N: 1, Bounded: true}, m, 5000, 100},
		{"free model never zero", plain, ledger.Model{Name: "free", MaxOutputTokens: 10}, 0, 999},
		// n (or best_of) multiplies every amount: each choice is generated and billed in full.
		{"learned × n", func() Request { r := plain; r.N = 16; r.Bounded = false; return r }(), m, 5000, 80_000},
		{"learned × n, lowered to the bound × n", func() Request { r := plain; r.N = 16; return r }(), m, 5000, 3200},
		{"learned × n clamps", func() Request { r := plain; r.N = 1 << 40; r.Bounded = false; return r }(), m, 5000, balance.MaxAmount},
		{"learned capped at the model's bound, then × n", func() Request { r := plain; r.N = 4; r.Bounded = false; return r }(),
			func() ledger.Model { x := m; x.MaxInputTokens = 100; return x }(), 1_000_000, 4 * 2100},
		{"no learned, no cap: bound with max output × n", Request{Spec: endpoint.Chat, Size: 100, N: 3, Bounded: true}, m, 0, 3 * 2100},
		{"no learned, no limits: model default × n", Request{Spec: endpoint.Chat, Size: 100, N: 5},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; x.DefaultHold = 177; return x }(), 0, 885},
		{"nothing known: fallback × n", Request{Spec: endpoint.Chat, Size: 100, N: 2},
			func() ledger.Model { x := m; x.MaxOutputTokens = 0; return x }(), 0, 1998},
		{"overflow clamps", Request{Spec: endpoint.Chat, Size: 100, N: 1, Bounded: true},
			ledger.Model{Prices: pricing.Prices{pricing.Input: balance.MaxAmount, pricing.Output: balance.MaxAmount}, MaxOutputTokens: 1 << 40}, 0, balance.MaxAmount},
	}
	for _, tt := range tests {
		got, err := HoldAmount(context.Background(), HoldInput{Request: tt.r, Model: tt.m, LearnedMax: tt.learned, Fallback: 999})
		if err != nil || got != tt.want {
			t.Errorf("%s: got %d %v, want %d", tt.name, got, err, tt.want)
		}
	}
}
