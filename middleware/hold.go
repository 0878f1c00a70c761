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

// HoldAmount is the default hold rule (DESIGN "The flow", step 1, "Holds that fit" and
// "Endpoints"):
//
//   - a request that has a bound holds its bound (Bound): (body bytes + what its images and
//     tool definitions add, PartTokens) × the highest input price the endpoint can bill +
//     output cap × output price, × n (or best_of) × the prompts of a prompt array. It has one
//     when every part is bounded (Request.Bounded) and its output cap is known: the one it
//     sent in the endpoint's own field, else the upstream's default (legacy completions: 16),
//     else the model's max output tokens — the cap the forwarded body then carries (capBody);
//     embeddings have no output: their bound is the input alone;
//   - any other request (server-side context, unknown fields) holds the larger of the model's
//     learned max cost of one choice (the store's, else Model.MaxCost, capped at the model's
//     bound: max input × highest input price + max output × output price) × n × prompts, and
//     what the request states (the same bound over its bytes and cap): the bound never drops
//     what the request states;
//   - with neither: the model's bound × n × prompts, else Model.DefaultHold × n × prompts, else
//     the fallback × n × prompts (each at least the stated part).
//
// A learned max never sizes a request that has a bound, in either direction: it is a guess
// from past requests, and a request that states its own bound may cost up to it. Every choice
// (and every prompt) is generated and billed in full, so every amount stands for one and is
// multiplied; the learned max is learned per choice (the accounting worker learns ⌈cost / n⌉
// from the usage event's Choices). Tokens never outnumber bytes, so the bytes of the body bound
// its text's tokens. The result is never ≤ 0 when Fallback > 0, and never above
// balance.MaxAmount.
func HoldAmount(_ context.Context, in HoldInput) (int64, error) {
	m, r := in.Model, in.Request
	if b, _, ok := Bound(m, r); ok || b == balance.MaxAmount {
		return b, nil // a bound past the money range holds all of it
	}
	stated, _ := requestBound(m, r, outputCapOf(m, r)) // what the request states, 0 for a free model
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
		return max(times(learned, n), stated), nil
	case haveCeiling:
		return max(times(ceiling, n), stated), nil
	case m.DefaultHold > 0:
		return max(times(m.DefaultHold, n), stated), nil
	}
	return max(times(in.Fallback, n), stated), nil
}

// Bound is the request's bound — the most it can cost whatever the upstream does, known from the
// request itself — and the output cap it assumes (0 for embeddings); ok is false when the
// request has none (a part not bounded, no output cap known, a free model, or a bound beyond
// balance.MaxAmount). HoldAmount holds it; fit lowers the cap until it fits (BoundAt).
func Bound(m ledger.Model, r Request) (b, outputCap int64, ok bool) {
	if !r.Bounded {
		return 0, 0, false
	}
	outputCap = outputCapOf(m, r)
	if outputCap <= 0 && !r.Spec.NoOutput {
		return 0, 0, false
	}
	b, ok = requestBound(m, r, outputCap)
	return b, outputCap, ok // b is balance.MaxAmount when the bound is beyond it
}

// outputCapOf is the output cap the upstream applies to the request, which its bounds assume
// and its forwarded body carries: the request's own, else the endpoint's upstream default,
// else the model's max output tokens (0: none known; embeddings have no output).
func outputCapOf(m ledger.Model, r Request) int64 {
	return r.Spec.UpstreamCap(r.OutputCap, m.MaxOutputTokens)
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

// inputTokens bounds the request's input tokens: its bytes (tokens never outnumber bytes) plus
// what its images and tool definitions add (PartTokens).
func inputTokens(r Request) int64 {
	if r.PartTokens > balance.MaxAmount-int64(r.Size) {
		return balance.MaxAmount
	}
	return int64(r.Size) + r.PartTokens
}

// requestBound is (input tokens × input price + out × prompts × output price) × n: the input is
// the whole body's (its bytes bound every prompt's tokens together), the output cap applies to
// every prompt of a prompt array. ok is false when the bound is zero (a free model: no bound
// worth holding) or does not fit; b is balance.MaxAmount when it does not fit.
func requestBound(m ledger.Model, r Request, out int64) (b int64, ok bool) {
	if p := max(r.Prompts, 1); p > 1 {
		if out > balance.MaxAmount/p {
			return balance.MaxAmount, false
		}
		out *= p
	}
	b, err := m.BoundFor(inputTokens(r), out, billable(r)) // the classes it can bill: every caller prices alike
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
