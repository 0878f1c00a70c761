package pricing_test

import (
	"testing"

	"github.com/llmescrow/escrow/pricing"
)

// BenchmarkCost: the cost of one request's usage (what a settle computes per request).
func BenchmarkCost(b *testing.B) {
	p := pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 1_250_000, pricing.Output: 10_000_000}
	for _, c := range []struct {
		name string
		u    pricing.Usage
	}{
		{"text", pricing.Usage{Prompt: 1000, Completion: 100}},
		{"cached", pricing.OpenAICounts{Prompt: 1000, Cached: 500, Completion: 100}.Usage()},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := p.Cost(c.u); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
