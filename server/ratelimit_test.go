package server

import (
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// aMinute is the first instant of a minute the tests' limit clock is set to (Config.limitClock),
// so that a per-minute burst stays inside one window whatever the wall clock reads.
var aMinute = time.Date(2031, 5, 6, 7, 8, 0, 0, time.UTC)

// rateProxy starts a proxy whose limit clock reads aMinute (give or take the test's run time),
// with the model m (1 µ per output token, 20 tokens at most), the org acme funded with funds
// and one key, and returns the key.
func rateProxy(t *testing.T, real bool, funds int64) (*testProxy, struct{ ID, Key string }) {
	t.Helper()
	return rateProxyAt(t, real, funds, fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), aMinute)
}

// rateProxyAt is rateProxy with the upstream up and a limit clock that reads at when the
// proxy starts.
func rateProxyAt(t *testing.T, real bool, funds int64, up *fakeupstream.Server, at time.Time) (*testProxy, struct{ ID, Key string }) {
	t.Helper()
	p := startTestProxyWith(t, real, []Option{WithUpstream(up, "sk-fake-upstream")},
		func(c *Config) {
			c.limitClock = time.Until(at)
			c.MaxInFlight, c.ReserveTimeout = 5000, time.Minute
		})
	p.admin("PUT", "/models/m", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 20, "max_cost": 20, "default_hold": 20}, http.StatusOK, nil)
	p.admin("POST", "/orgs", map[string]string{"id": "acme"}, http.StatusCreated, nil)
	p.admin("POST", "/orgs/acme/credits", map[string]any{"amount": funds, "reference": "init-acme"}, http.StatusCreated, nil)
	var k struct{ ID, Key string }
	p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)
	if st, _, b := p.do("GET", "/v1/models", k.Key, nil); st != http.StatusOK { // the key known before any burst
		t.Fatalf("GET /v1/models: %d %s", st, b)
	}
	return p, k
}

// TestRequestsPerMinuteProxy (DESIGN "Limits", third wave): 2,000 concurrent requests (500 on
// the embedded Redis) of a key limited to 41 requests per minute, all inside one minute: exactly
// 41 are served, with x-ratelimit-limit/remaining/reset-requests; every other one is 429
// rate_limit_exceeded with Retry-After and retry-after-ms to the minute's end (at most a minute:
// counted on the limit clock), the same x-ratelimit-* headers (remaining 0) and the limit's unit
// in the body; refusals never reach the upstream nor cost anything, and after the settle the
// limit lists 41 used, 0 held.
func TestRequestsPerMinuteProxy(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, real bool, total int64) {
		const n, funds = 41, 1_000_000
		p, k := rateProxy(t, real, funds)
		var lim struct{ ID, Unit, Window string }
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": k.ID, "window": "minute", "unit": "requests", "cap": n},
			http.StatusCreated, &lim)
		if lim.Unit != "requests" || lim.Window != "minute" {
			t.Fatalf("created %+v", lim)
		}
		var ok, refused, other atomic.Int64
		var firstOther atomic.Value
		body := `{"model":"m","messages":[{"role":"user","content":"hello"}]}`
		p.fire(k.Key, body, total, func(status int, h http.Header, b []byte, err error) {
			switch {
			case err != nil:
				firstOther.CompareAndSwap(nil, err.Error())
				other.Add(1)
			case status == http.StatusOK && h.Get("x-ratelimit-limit-requests") == strconv.Itoa(n) &&
				h.Get("x-ratelimit-remaining-requests") != "" && h.Get("x-ratelimit-reset-requests") != "":
				ok.Add(1)
			case status == http.StatusTooManyRequests && strings.Contains(string(b), `"code":"rate_limit_exceeded"`) &&
				strings.Contains(string(b), `"type":"rate_limit_exceeded"`) && strings.Contains(string(b), `"unit":"requests"`) &&
				h.Get("x-should-retry") != "false" && waitsWithinAMinute(h) &&
				h.Get("x-ratelimit-limit-requests") == strconv.Itoa(n) && h.Get("x-ratelimit-remaining-requests") == "0" &&
				h.Get("x-ratelimit-reset-requests") != "":
				refused.Add(1)
			default:
				firstOther.CompareAndSwap(nil, strconv.Itoa(status)+" "+string(b)+" "+headerLine(h))
				other.Add(1)
			}
		})()
		if ok.Load() != n || refused.Load() != total-n || other.Load() != 0 {
			t.Fatalf("%d ok, %d rate_limit_exceeded, %d other (first: %v); want %d, %d, 0",
				ok.Load(), refused.Load(), other.Load(), firstOther.Load(), n, total-n)
		}
		if b := p.settled("acme"); b.LedgerBalance != funds-n*20 || b.Available != funds-n*20 {
			t.Fatalf("after settle: %+v, want %d", b, funds-n*20)
		}
		var limits struct {
			Data []struct {
				ID, Unit   string
				Used, Held int64
			}
		}
		p.admin("GET", "/orgs/acme/limits", nil, http.StatusOK, &limits)
		if len(limits.Data) != 1 || limits.Data[0].Unit != "requests" || limits.Data[0].Used != n || limits.Data[0].Held != 0 {
			t.Fatalf("limits after settle: %+v, want %d requests used", limits, n)
		}
	}
	t.Run("real", func(t *testing.T) { t.Parallel(); run(t, true, 2000) })
	t.Run("embedded", func(t *testing.T) { t.Parallel(); run(t, false, 500) })
}

// TestTokensPerMinuteProxy: a key limited to 1,000 tokens per minute; each request (a body of
// B bytes, max_tokens 20) holds B + 20 tokens and is charged its real count (prompt + 20). A
// burst of 200 capped requests is served exactly while the holds fit: the served ones' holds
// stay within the cap, the rest are 429 rate_limit_exceeded (tokens), and after the settle
// the limit's window holds exactly the served requests' real tokens.
func TestTokensPerMinuteProxy(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, real bool) {
		const total, capTokens = 200, 1_000
		p, k := rateProxy(t, real, 1_000_000)
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": k.ID, "window": "minute", "unit": "tokens", "cap": capTokens},
			http.StatusCreated, nil)
		body := `{"model":"m","max_tokens":20,"messages":[{"role":"user","content":"hello"}]}`
		hold := int64(len(body) + 20)
		var ok, refused, other atomic.Int64
		var firstOther atomic.Value
		var wg sync.WaitGroup
		for range total {
			wg.Go(func() {
				st, h, b := p.do("POST", "/v1/chat/completions", k.Key, body)
				switch {
				case st == http.StatusOK && h.Get("x-ratelimit-limit-tokens") == strconv.Itoa(capTokens):
					ok.Add(1)
				case st == http.StatusTooManyRequests && strings.Contains(string(b), `"unit":"tokens"`) && h.Get("Retry-After") != "":
					refused.Add(1)
				default:
					firstOther.CompareAndSwap(nil, strconv.Itoa(st)+" "+string(b))
					other.Add(1)
				}
			})
		}
		wg.Wait()
		if other.Load() != 0 || ok.Load()+refused.Load() != total || ok.Load() < capTokens/hold {
			t.Fatalf("%d ok, %d refused, %d other (first %v); want at least %d served", ok.Load(), refused.Load(), other.Load(), firstOther.Load(), capTokens/hold)
		}
		p.settled("acme")
		var limits struct {
			Data []struct{ Used, Held int64 }
		}
		p.admin("GET", "/orgs/acme/limits", nil, http.StatusOK, &limits)
		var usage struct {
			Data []struct {
				Requests   int64
				Prompt     int64 `json:"prompt_tokens"`
				Completion int64 `json:"completion_tokens"`
			}
		}
		p.admin("GET", "/orgs/acme/usage?group_by=key", nil, http.StatusOK, &usage)
		if len(limits.Data) != 1 || len(usage.Data) != 1 || usage.Data[0].Requests != ok.Load() ||
			limits.Data[0].Used != usage.Data[0].Prompt+usage.Data[0].Completion || limits.Data[0].Held != 0 || limits.Data[0].Used > capTokens {
			t.Fatalf("limits %+v, usage %+v: want the served requests' tokens, at most %d", limits, usage, capTokens)
		}
	}
	t.Run("real", func(t *testing.T) { t.Parallel(); run(t, true) })
	t.Run("embedded", func(t *testing.T) { t.Parallel(); run(t, false) })
}

// waitsWithinAMinute reports whether a refusal of a per-minute limit asks for a wait of at most
// a minute (Retry-After in seconds, retry-after-ms), counted on the limit clock.
func waitsWithinAMinute(h http.Header) bool {
	s, errS := strconv.Atoi(h.Get("Retry-After"))
	ms, errMs := strconv.Atoi(h.Get("retry-after-ms"))
	return errS == nil && errMs == nil && s >= 1 && s <= 60 && ms >= 1 && ms <= 60_000
}

func headerLine(h http.Header) string {
	var b strings.Builder
	for k, v := range h {
		if strings.HasPrefix(strings.ToLower(k), "x-ratelimit") || strings.EqualFold(k, "retry-after") {
			b.WriteString(k + "=" + strings.Join(v, ",") + " ")
		}
	}
	return b.String()
}
