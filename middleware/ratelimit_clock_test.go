package middleware

import (
	"net/http"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// The waits of a rate limit (Retry-After, retry-after-ms, x-ratelimit-reset-*) are counted on the
// clock of the limit windows — the refusal's own time (LimitError.At), the reservation's reserve
// time — never on this process's clock, which a limit clock offset (or a skewed Redis host) may
// put years away: a window ending 1.5 s after the refusal is a wait of 1.5 s.
func TestRateLimitWaitsOnTheLimitClock(t *testing.T) {
	at := time.Date(2031, 5, 6, 7, 8, 58, 500_000_000, time.UTC) // not this process's clock
	reset := at.Add(1500 * time.Millisecond)
	e := rateRefusal(&balance.LimitError{
		Limit: balance.Limit{ID: "1", Scope: balance.Scope{Kind: balance.ScopeKey, ID: "k"}, Window: balance.Minute, Unit: balance.Requests, Cap: 3},
		Used:  3, Amount: 1, ResetsAt: reset, At: at,
	}, time.Now())
	if e == nil {
		t.Fatal("no refusal")
	}
	h := http.Header{}
	e.setHeaders(h)
	if h.Get("Retry-After") != "2" || h.Get("retry-after-ms") != "1500" || h.Get("x-ratelimit-reset-requests") != "1.5s" {
		t.Fatalf("refusal headers %v, want Retry-After 2, retry-after-ms 1500, reset 1.5s", h)
	}

	h = http.Header{}
	setRateHeaders(h, balance.Reservation{ReservedAt: at, TokenRate: balance.RateInfo{Cap: 100, Remaining: 40, ResetsAt: reset}}, time.Now())
	if h.Get("x-ratelimit-reset-tokens") != "1.5s" || h.Get("x-ratelimit-remaining-tokens") != "40" {
		t.Fatalf("success headers %v, want reset 1.5s, remaining 40", h)
	}
}
