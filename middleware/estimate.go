package middleware

import (
	"io"
	"sync/atomic"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// The one rule for every response that ends without readable usage (DESIGN "The flow", step
// 3): the client hung up and the read-on bound (Config.HangupTimeout, HangupBytes) ended first,
// the transport was cut after the first byte, the hold could not be kept, or the upstream ended
// the stream with an error (chat/completions `data: {"error":…}`, Responses `event: error` or
// `response.failed` without usage, Anthropic's `error` event). The upstream was called, so the
// provider bills it: the request is charged an estimate, marked estimated —
//
//   - a bounded request (holdIsBound) its bound, which is its hold: it cannot have cost more,
//     and a silent phase (hidden reasoning) bills tokens nobody saw;
//   - any other request the input bound (the body's bytes at the highest input price: tokens
//     never outnumber bytes; or the input the upstream itself reported, Anthropic's
//     message_start) plus the output that was streamed, counted generously;
//
// never more than the hold. A 2xx that ended normally but whose usage cannot be read is not
// this rule: it is charged the hold (call.charge).

// holdIsBound reports whether a request's hold is its bound: the most the request can cost,
// whatever the upstream does, known from the request itself. It is when the body is plain text
// (Request.Bounded) with an output cap — the request's, else the model's max output tokens,
// which the upstream enforces — or an embedding (no output), and that bound is not above the
// hold (a hold below it, such as a learned max, is not a bound). bound is then what the request
// is charged when its usage cannot be read after a cut (it is the hold unless a HoldFunc held
// more), and usage is what that charge stands for.
//
// Keep it the same rule as HoldAmount's bound: a request that HoldAmount holds at its bound is
// bounded here.
func holdIsBound(m ledger.Model, r Request, hold int64) (bound int64, usage pricing.Usage, ok bool) {
	b, out, ok := Bound(m, r)
	if !ok || b > hold {
		return 0, usage, false
	}
	n := max(r.N, 1) // requestBound fitted b × n × prompts, so these fit too
	return b, pricing.Usage{Prompt: inputTokens(r) * n, Completion: out * max(r.Prompts, 1) * n}, true
}

// estimate is what a request whose response ended without readable usage is charged (see the
// rule above), and the usage that charge stands for. cw is what passed of the response (its
// mode is modeNone or modePass when no 2xx came before the read-on bound ended).
func (cl *call) estimate(cw *captureWriter) (pricing.Usage, int64) {
	hold := max(cl.agreed, 1) // a fail-open request: the amount it would have held
	if b, u, ok := holdIsBound(cl.model, cl.req, hold); ok {
		return u, b
	}
	out := cw.outputEstimate()
	usage := pricing.Usage{Prompt: int64(cl.req.Size), Completion: out}
	cost, err := cl.model.BoundFor(usage.Prompt, usage.Completion, billable(cl.req)) // as the hold
	if a, ok := cw.sse.partialUsage(); ok && cw.mode == modeSSE {
		// A Messages stream's message_start gave the exact input counts.
		usage = a.usage()
		usage.Completion = max(usage.Completion, out)
		cost, err = cl.model.Cost(usage)
	}
	if err != nil {
		// Absurd counts: the hold (and a log line) rather than nothing.
		cl.m.cfg.Logger.Error("escrow: estimate could not be priced", "hold_id", cl.holdID, "usage", usage, "err", err)
		return usage, hold
	}
	return usage, min(cost, hold)
}

// unanswered reports whether the read-on bound after a hang-up ended before the upstream
// answered a request it was sent: no response, or only the error the handler wrote once escrow
// cut the call. Such a request is estimated, not released: the upstream got it, and the
// provider bills it. An upstream that answered (even with an error) before the bound is not
// this: an error is released.
func (cl *call) unanswered(cw *captureWriter) bool {
	return cl.sent.Load() && cw.boundHit.Load() && (!cw.wroteHeader || cw.headerAfterBound)
}

// sentBody is the request body the handler reads; the first read marks the request as sent
// upstream (a reverse proxy reads it only once it has a connection to the upstream).
type sentBody struct {
	io.ReadCloser
	sent *atomic.Bool
}

func (b *sentBody) Read(p []byte) (int, error) {
	b.sent.Store(true)
	return b.ReadCloser.Read(p)
}
