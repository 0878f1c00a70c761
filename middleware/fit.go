package middleware

import (
	"errors"
	"net/http"
	"strconv"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/tidwall/gjson"
)

// Fit (DESIGN "Holds that fit"): a request whose bound does not fit the org's balance or the
// room of a limit in scope is not refused while a shorter answer fits. Its output cap is lowered
// to the largest C whose bound fits, C is written into the body, the hold is that bound, and the
// client is told in the HeaderOutputCap header. The upstream enforces C, so the cost still
// cannot pass the hold: fit trades output length, never exactness.
const (
	// HeaderOutputCap is the response header that carries a fitted output cap.
	HeaderOutputCap = "X-Escrow-Output-Cap"
	// HeaderFit on a request: "off" asks for the refusal instead of a shorter answer.
	HeaderFit = "X-Escrow-Fit"

	// CodeBalanceHeld: 429 rate_limit_exceeded, retryable — the balance does not cover the
	// request now, but would with the holds of the org's requests in flight given back.
	CodeBalanceHeld = "balance_held"
	// CodeBudgetHeld: the same for a spending limit whose room is held by requests in flight.
	CodeBudgetHeld = "budget_held"
)

// maxFitTries bounds the reserves of one request: the first (its bound), then fitted ones, each
// sized from the room the previous refusal reported (requests of the same org may take it
// meanwhile).
const maxFitTries = 3

// fitPlan is what fitting a request needs: its bound and the cap the bound assumes, and the
// smallest cap worth serving.
type fitPlan struct {
	on      bool // the request may be fitted
	bounded bool // its hold is its bound, with an output cap: fit could lower it (on or off)
	bound   int64
	cap     int64 // the output cap of bound
	minCap  int64 // caps below this are refused
}

// planFit reports whether the request may be fitted: fit is on (Config.NoFit, the request's
// HeaderFit), the request has a bound with an output (embeddings have none to shorten) and its
// hold is that bound (a HoldFunc may hold something else).
func (m *middleware) planFit(off bool, model ledger.Model, r Request, hold int64) fitPlan {
	var p fitPlan
	p.bound, p.cap, p.on = Bound(model, r)
	// A thinking budget needs a cap above it (Spec.MinCap): fit never goes below that.
	p.minCap = max(min(m.cfg.FitMinOutputTokens, p.cap), r.Spec.MinCap(r.ThinkingBudget))
	p.bounded = p.on && p.cap > 0 && p.bound == hold && !r.Spec.NoOutput
	p.on = p.bounded && !m.cfg.NoFit && !off
	return p
}

// room is what a refused reserve says would have been taken now: money (the balance and every
// money limit in scope) and, when a tokens limit is in scope, tokens.
type room struct {
	money      int64
	tokens     int64
	haveTokens bool
}

// fitCap is the largest output cap C ≤ max whose bound is at most the money room (and whose
// token bound at most the tokens room), and that bound; ok is false when no cap of at least min
// fits. Both bounds grow with C, so C is found by bisection.
func fitCap(model ledger.Model, r Request, minCap, maxCap int64, rm room) (c, bound int64, ok bool) {
	if rm.money <= 0 || minCap > maxCap || (rm.haveTokens && rm.tokens <= 0) {
		return 0, 0, false
	}
	fits := func(c int64) (int64, bool) {
		b, ok := requestBound(model, r, c)
		return b, ok && b <= rm.money && (!rm.haveTokens || tokenBound(r, c) <= rm.tokens)
	}
	if _, ok := fits(max(minCap, 1)); !ok {
		return 0, 0, false
	}
	lo, hi := max(minCap, 1), maxCap // fits(lo); find the largest
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		if _, ok := fits(mid); ok {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	b, _ := fits(lo)
	return lo, b, true
}

// roomOf is the largest hold a refused reserve says would have been taken now, and whether the
// refusal is one that fit may answer (the balance or a spending limit).
func roomOf(err error) (room, bool) {
	var ins *balance.InsufficientError
	var lim *balance.LimitError
	switch {
	case errors.As(err, &lim):
		// A requests limit counts 1 whatever the request's size: no shorter answer fits it.
		return room{money: lim.Room, tokens: lim.TokenRoom, haveTokens: lim.HaveTokenRoom}, lim.Limit.Unit != balance.Requests
	case errors.As(err, &ins):
		return room{money: ins.Balance}, true
	}
	return room{}, false
}

// capBody returns body carrying the output cap c that the request's hold priced (DESIGN
// "Endpoints"), in the endpoint's own field: each cap field of the endpoint that the body has
// gets min(its value, c) — fit never raises what the request would otherwise get — and a body
// with none gets c added in the endpoint's fit field (Config.FitFields changes it per route).
// A thinking budget that c would leave invalid is lowered (Spec.Thinking; fit's minCap made
// sure one fits). parseRequest checked that every such field is unique and spelled exactly.
func (m *middleware) capBody(body []byte, r Request, c int64) []byte {
	spec := r.Spec
	v := []byte(strconv.FormatInt(c, 10))
	found := false
	for _, f := range spec.CapFields {
		got := gjson.GetBytes(body, f)
		if !got.Exists() || got.Type == gjson.Null {
			continue
		}
		found = true
		if got.Int() > c {
			body, _ = setTopRaw(body, f, v)
		}
	}
	if !found {
		f := spec.FitField
		if x, ok := m.cfg.FitFields[spec.Path]; ok && x != "" {
			f = x
		}
		if out, ok := setTopRaw(body, f, v); ok { // a null member of that name
			body = out
		} else {
			body = addTopRaw(body, f, v)
		}
	}
	if b, _ := spec.Thinking(r.ThinkingBudget, c); b != r.ThinkingBudget {
		if t := gjson.GetBytes(body, "thinking"); t.IsObject() {
			if nt, ok := setTopRaw([]byte(t.Raw), "budget_tokens", []byte(strconv.FormatInt(b, 10))); ok {
				body, _ = setTopRaw(body, "thinking", nt)
			}
		}
	}
	return body
}

// heldRefusal turns a refusal that in-flight holds explain into the retryable 429 of "Held is
// not gone": the balance (or a limit's room) plus what the org's unfinished holds keep would
// cover needed. nil when the money (or the room) is really gone.
func (m *middleware) heldRefusal(err error, needed int64) *Error {
	var ins *balance.InsufficientError
	var lim *balance.LimitError
	switch {
	case errors.As(err, &lim):
		if lim.Held > 0 && lim.Used-lim.Held+needed <= lim.Limit.Cap {
			e := limitRefusal(lim)
			e.Type, e.Code, e.NoRetry, e.RetryAfter = TypeRateLimit, CodeBudgetHeld, false, m.cfg.RetryAfter
			e.Message += " Requests of yours in flight hold part of it: retry when they finish."
			return e
		}
	case errors.As(err, &ins):
		if ins.Held > 0 && ins.Balance+ins.Held >= needed {
			return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: CodeBalanceHeld, RetryAfter: m.cfg.RetryAfter,
				Message: "Your balance is held by your requests in flight: " + strconv.FormatInt(ins.Balance, 10) +
					" available now, " + strconv.FormatInt(needed, 10) + " needed. Retry when they finish."}
		}
	}
	return nil
}

// quotaPrefix starts the insufficient_quota message with numbers (forAnthropic rewords it).
const quotaPrefix = "You exceeded your current quota: your balance does not cover this request"

// quotaRefusal is the refusal of a request whose hold neither fits nor can be fitted, with the
// numbers: what it needs at least (its smallest fitted bound, or its hold when it cannot be
// fitted), what is available, which limit binds, and the largest output cap that would fit.
// Money held by the org's requests in flight makes it the retryable heldRefusal. nil for errors
// that are not about the balance or a limit (reserveError maps those).
func (m *middleware) quotaRefusal(err error, model ledger.Model, r Request, plan fitPlan, hold int64) *Error {
	rm, ok := roomOf(err)
	if !ok {
		return nil
	}
	needed := hold
	if plan.on {
		if b, ok := requestBound(model, r, plan.minCap); ok {
			needed = b
		}
	}
	if e := m.heldRefusal(err, needed); e != nil {
		return e
	}
	hint := ""
	if plan.bounded {
		least := max(1, r.Spec.MinCap(r.ThinkingBudget)) // a thinking budget needs a cap above it
		if c, _, ok := fitCap(model, r, least, plan.cap, rm); ok {
			hint = " An output cap (max_tokens) of at most " + strconv.FormatInt(c, 10) + " would fit."
		} else {
			hint = " No output cap fits."
		}
		if least > 1 {
			hint += " With extended thinking, max_tokens must stay above thinking.budget_tokens, itself at least " +
				strconv.FormatInt(r.Spec.ThinkingMin, 10) + ": at least " + strconv.FormatInt(least, 10) + "."
		}
	}
	var lim *balance.LimitError
	if errors.As(err, &lim) {
		l := *lim
		l.Amount = needed
		e := limitRefusal(&l)
		e.Message += hint
		return e
	}
	return &Error{Status: http.StatusTooManyRequests, Type: TypeInsufficientQuota, Code: CodeInsufficientQuota, NoRetry: true,
		Message: quotaPrefix + " (it needs at least " +
			strconv.FormatInt(needed, 10) + ", " + strconv.FormatInt(max(rm.money, 0), 10) + " is available)." + hint + " Add credit and retry."}
}
