package middleware

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Requests and tokens limits (DESIGN "Limits", third wave): a request holds 1 on every requests
// limit in scope and its token bound on every tokens limit, in the same reserve as its money.
// Their refusals are OpenAI's rate limits — 429 rate_limit_exceeded with Retry-After to the
// window's end — so the official SDKs wait and retry instead of failing; a money limit stays
// budget_exceeded. Successes of a key with such a limit carry OpenAI's x-ratelimit-* headers.

// tokenBound is the request's token bound at output cap out: (body bytes + out × prompts) × n —
// tokens never outnumber bytes, so the body's bytes bound its input tokens, and every choice and
// prompt is generated in full. out ≤ 0: no output cap known (the input alone; the settle charges
// the real count, the overshoot rule allows the rest). Clamped to balance.MaxAmount.
func tokenBound(r Request, out int64) int64 {
	in := max(int64(r.Size), 0)
	out = times(max(out, 0), max(r.Prompts, 1))
	if out > balance.MaxAmount-in {
		return balance.MaxAmount
	}
	return times(in+out, max(r.N, 1))
}

// rateRefusal is the 429 of a hold refused by a requests or a tokens limit (nil for any other
// error): type and code rate_limit_exceeded, Retry-After (and retry-after-ms) to the window's
// end, OpenAI's x-ratelimit-* headers of that unit, and the limit in the body. A lifetime limit
// never resets: its refusal says not to retry. The wait is counted from the refusal's own time
// on the limit clock (LimitError.At), now when it has none.
func rateRefusal(err error, now time.Time) *Error {
	var le *balance.LimitError
	if !errors.As(err, &le) || (le.Limit.Unit != balance.Requests && le.Limit.Unit != balance.Tokens) {
		return nil
	}
	e := limitRefusal(le)
	e.Type, e.Code, e.NoRetry = TypeRateLimit, CodeRateLimit, false
	unit := string(le.Limit.Unit)
	e.Header = http.Header{}
	e.Header.Set("x-ratelimit-limit-"+unit, strconv.FormatInt(le.Limit.Cap, 10))
	e.Header.Set("x-ratelimit-remaining-"+unit, strconv.FormatInt(max(le.Limit.Cap-le.Used, 0), 10))
	if le.ResetsAt.IsZero() {
		e.NoRetry = true
		e.Message = fmt.Sprintf("%s lifetime rate limit of %d %s used up: %d used, %d requested; it does not reset.",
			scopeName(le.Limit.Scope), le.Limit.Cap, unit, le.Used, le.Amount)
		return e
	}
	if !le.At.IsZero() {
		now = le.At
	}
	wait := max(le.ResetsAt.Sub(now), time.Millisecond)
	e.RetryAfter = wait
	e.Header.Set("retry-after-ms", strconv.FormatInt(int64((wait+time.Millisecond-1)/time.Millisecond), 10))
	e.Header.Set("x-ratelimit-reset-"+unit, resetString(wait))
	e.Message = fmt.Sprintf("%s rate limit of %d %s per %s reached: %d used, %d requested. Please try again in %s.",
		scopeName(le.Limit.Scope), le.Limit.Cap, unit, le.Limit.Window, le.Used, le.Amount, resetString(wait))
	return e
}

// setRateHeaders sets OpenAI's x-ratelimit-* headers of a granted hold: for each of requests and
// tokens, the limit in scope with the least left after it (none: no headers). The resets are
// counted from the reserve time (the limit clock the windows are on), else from now.
func setRateHeaders(h http.Header, res balance.Reservation, now time.Time) {
	if !res.ReservedAt.IsZero() {
		now = res.ReservedAt
	}
	for _, x := range []struct {
		unit string
		r    balance.RateInfo
	}{{"requests", res.RequestRate}, {"tokens", res.TokenRate}} {
		if x.r.Cap == 0 {
			continue
		}
		h.Set("x-ratelimit-limit-"+x.unit, strconv.FormatInt(x.r.Cap, 10))
		h.Set("x-ratelimit-remaining-"+x.unit, strconv.FormatInt(max(x.r.Remaining, 0), 10))
		if !x.r.ResetsAt.IsZero() {
			h.Set("x-ratelimit-reset-"+x.unit, resetString(max(x.r.ResetsAt.Sub(now), 0)))
		}
	}
}

// resetString writes a wait as OpenAI's x-ratelimit-reset-* do ("1s", "6m0s", "20ms"): a Go
// duration rounded up to the millisecond.
func resetString(d time.Duration) string {
	return ((d + time.Millisecond - 1) / time.Millisecond * time.Millisecond).String()
}
