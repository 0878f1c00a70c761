package middleware

import (
	"context"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
)

// HoldInput is what the hold amount is chosen from.
type HoldInput struct {
	Request    Request
	Model      accounting.Model // prices and limits in force now (the request is priced with them)
	LearnedMax int64            // the store's learned max cost of one request of the model (0 = none yet)
	Fallback   int64            // Config.DefaultHold
}

// HoldAmount is the default hold rule (DESIGN "The flow", step 1):
//
//   - the model's learned max cost (the store's, else Model.MaxCost);
//   - lowered to the request's hard upper bound — body bytes × input price + output cap × output
//     price, × n (or best_of) — only when the request is plain text (Request.PlainText) and has
//     an output cap (embeddings have no output: their bound is the input alone);
//   - with no learned max: that bound if there is one, else the same bound with the model's max
//     output tokens, else Model.DefaultHold, else the fallback.
//
// Tokens never outnumber bytes, so the bytes of the body bound its input tokens. The result is
// never ≤ 0 when Fallback > 0, and never above balance.MaxAmount.
func HoldAmount(_ context.Context, in HoldInput) (int64, error) {
	m, r := in.Model, in.Request
	learned := in.LearnedMax
	if learned <= 0 {
		learned = m.MaxCost
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
		if haveBound && bound < learned {
			return bound, nil
		}
		return min(learned, balance.MaxAmount), nil
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
		return min(m.DefaultHold, balance.MaxAmount), nil
	}
	return in.Fallback, nil
}

// requestBound is (size × input price + out × output price) × n. ok is false when the bound is
// zero (a free model: no bound worth holding) or does not fit; b is balance.MaxAmount when it
// does not fit.
func requestBound(m accounting.Model, r Request, out int64) (b int64, ok bool) {
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
