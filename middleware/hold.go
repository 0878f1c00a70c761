package middleware

import (
	"context"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
)

// HoldInput is what the hold amount is chosen from.
type HoldInput struct {
	Request Request
	Model   accounting.Model // prices and limits in force now (the request is priced with them)
	// LearnedMax is the store's learned max cost of one choice of the model (a request with
	// n = 1); 0 = none yet. The hold multiplies it by the request's n (or best_of).
	LearnedMax int64
	Fallback   int64 // Config.DefaultHold
}

// HoldAmount is the default hold rule (DESIGN "The flow", step 1):
//
//   - the model's learned max cost (the store's, else Model.MaxCost), capped at the model's
//     bound (max input × input price + max output × output price), × n (or best_of);
//   - lowered to the request's hard upper bound — body bytes × the highest input price the
//     request could be billed at (cache-write prices only on Anthropic's Messages) + output
//     cap × output price, × n — only when the request is plain text (Request.PlainText) and has an output cap
//     (embeddings have no output: their bound is the input alone);
//   - with no learned max: that bound if there is one, else the same bound with the model's max
//     output tokens, else Model.DefaultHold × n, else the fallback × n.
//
// Every choice of n is generated and billed in full, so every amount stands for one choice and
// is multiplied by n; the learned max is learned per choice (the accounting worker learns
// ⌈cost / n⌉ from the usage event's Choices). Tokens never outnumber bytes, so the bytes of the
// body bound its input tokens. The result is never ≤ 0
// when Fallback > 0, and never above balance.MaxAmount.
func HoldAmount(_ context.Context, in HoldInput) (int64, error) {
	m, r := in.Model, in.Request
	if r.Endpoint != EndpointMessages {
		// Only Anthropic's usage carries cache writes: no other request is billed at their
		// prices (the 1-hour one defaults to 2× the input price), so none bounds its input.
		m.Prices = m.WithoutCacheWrites()
	}
	n := max(r.N, 1)
	learned := in.LearnedMax
	if learned <= 0 {
		learned = m.MaxCost
	}
	if ceiling, ok, err := m.CostBound(); err == nil && ok && ceiling > 0 {
		learned = min(learned, ceiling)
	}
	bound, haveBound := int64(0), false
	if r.PlainText {
		switch {
		case r.Endpoint == EndpointEmbeddings:
			bound, haveBound = requestBound(m, r, 0)
		case r.OutputCap > 0:
			bound, haveBound = requestBound(m, r, r.OutputCap)
		}
	}
	if learned > 0 {
		learned = times(learned, n)
		if haveBound && bound < learned {
			return bound, nil
		}
		return learned, nil
	}
	if haveBound {
		return bound, nil
	}
	if m.MaxOutputTokens > 0 {
		if b, ok := requestBound(m, r, m.MaxOutputTokens); ok {
			return b, nil
		} else if b == balance.MaxAmount {
			return b, nil
		}
	}
	if m.DefaultHold > 0 {
		return times(m.DefaultHold, n), nil
	}
	return times(in.Fallback, n), nil
}

// times is a × n clamped to balance.MaxAmount (a, n > 0).
func times(a, n int64) int64 {
	if a <= 0 {
		return a
	}
	if a > balance.MaxAmount/n {
		return balance.MaxAmount
	}
	return min(a*n, balance.MaxAmount)
}

// requestBound is (size × input price + out × output price) × n. ok is false when the bound is
// zero (a free model: no bound worth holding) or does not fit; b is balance.MaxAmount when it
// does not fit.
func requestBound(m accounting.Model, r Request, out int64) (b int64, ok bool) {
	if r.Endpoint != EndpointMessages {
		// As in HoldAmount: only Anthropic's usage carries cache writes, so no other request's
		// input is bounded at their prices (every caller of the bound prices it alike).
		m.Prices = m.WithoutCacheWrites()
	}
	b, err := m.Bound(int64(r.Size), out)
	if err != nil {
		return balance.MaxAmount, false
	}
	n := max(r.N, 1)
	if b > balance.MaxAmount/n {
		return balance.MaxAmount, false
	}
	b *= n
	return b, b > 0
}
