package middleware

import (
	"net/http"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// TestOneRateLimitSet (issue 34 item 3): a key with a requests limit gets escrow's
// x-ratelimit-* headers, and the upstream's (the operator's quota: limit 10,000, remaining
// 9,876) never come beside them as a second value — dropped, or renamed x-upstream-ratelimit-*.
func TestOneRateLimitSet(t *testing.T) {
	t.Parallel()
	res := balance.Reservation{ReservedAt: time.Now(), RequestRate: balance.RateInfo{Cap: 40, Remaining: 39, ResetsAt: time.Now().Add(time.Minute)}}
	for _, rename := range []bool{false, true} {
		cl := &call{m: &middleware{cfg: Config{RenameUpstreamRateLimit: rename}}, reserved: res}
		h := http.Header{}
		cl.setOwnRateHeaders(h) // before the handler (proxy)
		h.Add("X-Ratelimit-Limit-Requests", "10000")
		h.Add("X-Ratelimit-Remaining-Requests", "9876")
		h.Add("X-Ratelimit-Limit-Tokens", "2000000") // escrow has no tokens limit here
		cl.oneRateLimitSet(h)
		if v := h.Values("X-Ratelimit-Limit-Requests"); len(v) != 1 || v[0] != "40" {
			t.Errorf("rename %v: limit %v, want escrow's 40 alone", rename, v)
		}
		if v := h.Values("X-Ratelimit-Remaining-Requests"); len(v) != 1 || v[0] != "39" {
			t.Errorf("rename %v: remaining %v, want escrow's 39 alone", rename, v)
		}
		if v := h.Values("X-Ratelimit-Limit-Tokens"); len(v) != 0 {
			t.Errorf("rename %v: the upstream's tokens limit %v passed", rename, v)
		}
		up := h.Get("X-Upstream-Ratelimit-Remaining-Requests")
		if (rename && up != "9876") || (!rename && up != "") || (rename && h.Get("X-Upstream-Ratelimit-Limit-Tokens") != "2000000") {
			t.Errorf("rename %v: upstream's as x-upstream-ratelimit-*: %v", rename, h)
		}
	}
}

// TestRefusalRemainingTokens (issue 34 item 5): a tokens refusal says what the window has left,
// cap − used (51 here), which is more than 0 when the request needed more than that; a requests
// refusal says 0. README states the same rule.
func TestRefusalRemainingTokens(t *testing.T) {
	t.Parallel()
	now := time.Now()
	for _, tc := range []struct {
		unit      balance.Unit
		cap, used int64
		amount    int64
		header    string
		remaining string
	}{
		{balance.Tokens, 100, 49, 80, "x-ratelimit-remaining-tokens", "51"},
		{balance.Requests, 5, 5, 1, "x-ratelimit-remaining-requests", "0"},
	} {
		le := &balance.LimitError{Limit: balance.Limit{ID: "l", Unit: tc.unit, Cap: tc.cap, Window: balance.Minute, Scope: balance.Scope{Kind: balance.ScopeKey, ID: "k"}},
			Used: tc.used, Amount: tc.amount, ResetsAt: now.Add(30 * time.Second), At: now}
		e := rateRefusal(le, now)
		if e == nil || e.Header.Get(tc.header) != tc.remaining {
			t.Errorf("%s refusal: %v, want %s %s", tc.unit, e, tc.header, tc.remaining)
		}
	}
}
