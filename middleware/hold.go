package middleware

import (
	"context"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// HoldInput is what the hold amount is chosen from.
type HoldInput struct {
	Request Request
	Model   ledger.Model // prices and limits in force now (the request is priced with them)
	// LearnedMax is the store's learned max cost of one choice of the model (a request with
	// n = 1); 0 = none yet. The hold multiplies it by the request's n (or best_of).
	LearnedMax int64
	Fallback   int64 // Config.DefaultHold
}

// HoldAmount is the default hold rule (DESIGN "The flow", step 1, and "Holds that fit"):
//
//   - a request that has a bound holds its bound (Bound): body bytes × the highest input price
//     the request could be billed at (cache-write prices only on Anthropic's Messages) + output
//     cap × output price, × n (or best_of) × the prompts of a prompt array. It has one when it
//     is plain text (Request.PlainText) and its output cap is known: the one it sent, else the
//     model's max output tokens (embeddings have no output: their bound is the input alone);
//   - any other request holds the model's learned max cost of one choice (the store's, else
//     Model.MaxCost), capped at the model's bound (max input × highest input price + max output
//     × output price), × n × prompts;
//   - with neither: the model's bound × n × prompts, else Model.DefaultHold × n × prompts, else
//     the fallback × n × prompts.
//
// A learned max never sizes a request that has a bound, in either direction: it is a guess
// from past requests, and a request that states its own bound may cost up to it. Every choice
// (and every prompt) is generated and billed in full, so every amount stands for one and is
// multiplied; the learned max is learned per choice (the accounting worker learns ⌈cost / n⌉
// from the usage event's Choices). Tokens never outnumber bytes, so the bytes of the body bound
// its input tokens. The result is never ≤ 0 when Fallback > 0, and never above
// balance.MaxAmount.
func HoldAmount(_ context.Context, in HoldInput) (int64, error) {
	m, r := in.Model, in.Request
	if b, _, ok := Bound(m, r); ok || b == balance.MaxAmount {
		return b, nil // a bound past the money range holds all of it
	}
	n := times(max(r.N, 1), max(r.Prompts, 1))
	learned := in.LearnedMax
	if learned <= 0 {
		learned = m.MaxCost
	}
	ceiling, haveCeiling, err := m.CostBoundFor(billable(r))
	haveCeiling = err == nil && haveCeiling && ceiling > 0
	if haveCeiling && learned > 0 {
		learned = min(learned, ceiling)
	}
	switch {
	case learned > 0:
		return times(learned, n), nil
	case haveCeiling:
		return times(ceiling, n), nil
	case m.DefaultHold > 0:
		return times(m.DefaultHold, n), nil
	}
	return times(in.Fallback, n), nil
}

// Bound is the request's bound — the most it can cost whatever the upstream does, known from the
// request itself — and the output cap it assumes (0 for embeddings); ok is false when the
// request has none (not plain text, no output cap known, a free model, or a bound beyond
// balance.MaxAmount). HoldAmount holds it; fit lowers the cap until it fits (BoundAt).
func Bound(m ledger.Model, r Request) (b, outputCap int64, ok bool) {
	if !r.PlainText {
		return 0, 0, false
	}
	outputCap = outputCapOf(m, r)
	if outputCap <= 0 && r.Endpoint != EndpointEmbeddings {
		return 0, 0, false
	}
	b, ok = requestBound(m, r, outputCap)
	return b, outputCap, ok // b is balance.MaxAmount when the bound is beyond it
}

// outputCapOf is the output cap a request's bounds assume: the request's own, else the model's
// max output tokens (0: none known; embeddings have no output).
func outputCapOf(m ledger.Model, r Request) int64 {
	if r.Endpoint == EndpointEmbeddings {
		return 0
	}
	if r.OutputCap > 0 {
		return r.OutputCap
	}
	return m.MaxOutputTokens
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

// requestBound is (size × input price + out × prompts × output price) × n: the input is the
// whole body's (its bytes bound every prompt's tokens together), the output cap applies to
// every prompt of a prompt array. ok is false when the bound is zero (a free model: no bound
// worth holding) or does not fit; b is balance.MaxAmount when it does not fit.
func requestBound(m ledger.Model, r Request, out int64) (b int64, ok bool) {
	if p := max(r.Prompts, 1); p > 1 {
		if out > balance.MaxAmount/p {
			return balance.MaxAmount, false
		}
		out *= p
	}
	b, err := m.BoundFor(int64(r.Size), out, billable(r)) // the classes it can bill: every caller prices alike
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
