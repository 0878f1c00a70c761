package server

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestOpenAINodeSDKRequestsPerMinute (issue 26, DESIGN "Limits", third wave): the official
// openai npm client, with its default retries, against a key limited to N requests per minute
// over real Redis and Postgres (sdktest/ratelimit.mjs). The client is let go a few seconds before
// a minute ends (by the limit clock, Config.limitClock) and makes N + 1 chat completions: the
// first N are served with x-ratelimit-* headers counting down to 0; the (N+1)th is refused 429
// rate_limit_exceeded with Retry-After, retry-after-ms and the x-ratelimit-* headers, and the SDK,
// on its own, retries it after retry-after-ms — in the next minute, where it is served. The
// refused attempt never reaches the upstream (N + 1 upstream calls) and costs nothing: the
// ledger holds exactly N + 1 charges, of the usage the SDK reported, and the limit's current
// window (the next minute) counts the retried request alone.
func TestOpenAINodeSDKRequestsPerMinute(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	const n, funds = 3, 1_000_000
	// lead is how long before a minute's end the client is let go: room for N + 1 requests on a
	// busy machine, and the pause the SDK makes before its retry.
	const lead = 4 * time.Second
	up := fakeupstream.New(fakeupstream.Options{KeepRequests: -1})
	p, k := rateProxyAt(t, true, funds, up, aMinute.Add(-lead-5*time.Second))
	var lim struct{ ID string }
	p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": k.ID, "window": "minute", "unit": "requests", "cap": n},
		http.StatusCreated, &lim)
	upBefore := up.Requests()

	// limitNow is the clock of the limit windows (Redis TIME shifted by the limit clock).
	limitNow := func() time.Time {
		now, err := p.app.store.Now(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return now
	}
	// When the script is ready, wait for lead before the end of a minute: the first minute
	// ending at least lead from now (the next one when the setup took long).
	var minuteEnd time.Time
	ready := func() {
		now := limitNow()
		minuteEnd = now.Add(lead).Truncate(time.Minute).Add(time.Minute)
		if d := minuteEnd.Add(-lead).Sub(now); d > 0 {
			time.Sleep(d)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := runSDK(ctx, t, node, "ratelimit.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + k.Key,
		"ESCROW_MODEL=m", "ESCROW_REQUESTS=" + strconv.Itoa(n)}, ready)

	type attempt struct {
		Status                   int
		RetryAfter, RetryAfterMs *string
		ShouldRetry              *string
		Limit, Remaining, Reset  *string
		Code, Type               *string
	}
	var res struct {
		Calls []struct {
			Status           int
			CompletionTokens int64
			Error            string
			Attempts         []attempt
		}
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
		t.Fatalf("node output %s: %v", out, err)
	}
	str := func(s *string) string {
		if s == nil {
			return "<none>"
		}
		return *s
	}
	if len(res.Calls) != n+1 {
		t.Fatalf("the script made %d calls, want %d: %s", len(res.Calls), n+1, out)
	}
	var tokens int64
	for i, c := range res.Calls {
		if c.Status != http.StatusOK || c.CompletionTokens <= 0 || len(c.Attempts) == 0 {
			t.Fatalf("call %d: %+v, want 200 with usage", i+1, c)
		}
		tokens += c.CompletionTokens
		last := c.Attempts[len(c.Attempts)-1]
		if last.Status != http.StatusOK || str(last.Limit) != strconv.Itoa(n) || str(last.Reset) == "<none>" {
			t.Fatalf("call %d's answer: %+v, want 200 with x-ratelimit-limit-requests %d", i+1, last, n)
		}
		if i < n {
			// Served in the first minute, once each, the remaining requests counting down.
			if len(c.Attempts) != 1 || str(last.Remaining) != strconv.Itoa(n-1-i) {
				t.Fatalf("call %d: %d attempts, remaining %s; want 1 attempt, %d remaining", i+1, len(c.Attempts), str(last.Remaining), n-1-i)
			}
			continue
		}
		// The (N+1)th: refused once in the first minute, then retried by the SDK and served in
		// the next one, where it is the minute's first request.
		if len(c.Attempts) != 2 || str(last.Remaining) != strconv.Itoa(n-1) {
			t.Fatalf("call %d: attempts %+v, want a refusal and one retry served with %d remaining", i+1, c.Attempts, n-1)
		}
		f := c.Attempts[0]
		ra, errRA := strconv.Atoi(str(f.RetryAfter))
		ms, errMs := strconv.ParseInt(str(f.RetryAfterMs), 10, 64)
		if f.Status != http.StatusTooManyRequests || str(f.Code) != "rate_limit_exceeded" || str(f.Type) != "rate_limit_exceeded" ||
			errRA != nil || ra < 1 || errMs != nil || ms < 1 || ms > lead.Milliseconds() || str(f.ShouldRetry) == "false" ||
			str(f.Limit) != strconv.Itoa(n) || str(f.Remaining) != "0" || str(f.Reset) == "<none>" {
			t.Fatalf("the refusal: %+v (retry-after %s, retry-after-ms %s), want 429 rate_limit_exceeded with Retry-After, "+
				"retry-after-ms within %v and x-ratelimit-* (limit %d, remaining 0)", f, str(f.RetryAfter), str(f.RetryAfterMs), lead, n)
		}
		t.Logf("refused with Retry-After %s, retry-after-ms %s, x-ratelimit-reset-requests %s", str(f.RetryAfter), str(f.RetryAfterMs), str(f.Reset))
	}

	if got := up.Requests() - upBefore; got != n+1 {
		t.Fatalf("the upstream got %d requests, want %d (the refused attempt never reaches it)", got, n+1)
	}
	// The model costs 1 µ per output token: exactly the N + 1 served requests are charged.
	b := p.settled("acme")
	if ch := p.charges("acme"); len(ch) != n+1 || b.LedgerBalance != funds-tokens || b.Available != funds-tokens || b.Held != 0 {
		t.Fatalf("after the settle: %d charges, %+v; want %d charges, balance %d", len(ch), b, n+1, funds-tokens)
	}
	var limits struct {
		Data []struct {
			ID         string
			Used, Held int64
			ResetsAt   *time.Time `json:"resets_at"`
		}
	}
	p.admin("GET", "/orgs/acme/limits", nil, http.StatusOK, &limits)
	if len(limits.Data) != 1 || limits.Data[0].ResetsAt == nil || !limits.Data[0].ResetsAt.Equal(minuteEnd.Add(time.Minute)) ||
		limits.Data[0].Used != 1 || limits.Data[0].Held != 0 {
		t.Fatalf("the limit after the settle: %+v, want 1 used in the minute ending %v", limits.Data, minuteEnd.Add(time.Minute))
	}
}
