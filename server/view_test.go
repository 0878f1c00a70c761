package server

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/pricing"
)

// Issue 23, item 5: the customer's own view, over HTTP with the key the proxy takes.

// view GETs a customer route with the key (none when ""), and decodes its JSON with numbers
// kept as their text.
func (p *testProxy) view(path, key string) (int, map[string]any) {
	p.t.Helper()
	st, _, b := p.do(http.MethodGet, path, key, nil)
	var out map[string]any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&out); err != nil {
		p.t.Fatalf("%s: %d %s: %v", path, st, b, err)
	}
	return st, out
}

// micros reads a currency amount of a view (a JSON number) as micro-units, exactly.
func micros(t *testing.T, v any) int64 {
	t.Helper()
	n, ok := v.(json.Number)
	if !ok {
		t.Fatalf("%v (%T) is not a number", v, v)
	}
	m, exact, err := pricing.DecimalMicros(string(n), 6, false)
	if err != nil || !exact {
		t.Fatalf("%s: %d %v %v", n, m, exact, err)
	}
	return m
}

// TestCustomerView: with its own key a customer reads, in OpenRouter's shapes (GET /api/v1/key,
// /api/v1/auth/key, /api/v1/credits) and the one-api family's (GET /dashboard/billing/
// subscription and /usage, also under /v1/), in currency units: its key's label, usage and the
// limit with the least room among those in its scope (not another key's), the org's credits,
// what is gone from them (charges and the holds of requests in flight: credits − usage is the
// available balance, to the micro-unit) and its available, held and ledger balance. Reading
// costs nothing; a wrong or missing key is a 401 in the route's own shape.
func TestCustomerView(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			// Unlimited views: this test reads them many times (TestViewRateLimit is the limit's).
			gate := make(chan struct{}) // holds the [slow] request at the upstream until its hold is seen
			defer func() {
				select {
				case <-gate:
				default:
					close(gate)
				}
			}()
			p := startTestProxyWith(t, real, []Option{gatedUpstream(gate, "[slow]")}, func(c *Config) { c.ViewRate = 0 })
			p.setup("acme", 1_000_000, 100) // model m: 1 micro-unit per output token
			var prod, other struct{ ID, Key string }
			p.admin("POST", "/orgs/acme/keys", map[string]string{"name": "prod"}, http.StatusCreated, &prod)
			p.admin("POST", "/orgs/acme/keys", map[string]string{"name": "other"}, http.StatusCreated, &other)
			day0 := time.Now().UTC().Format(time.DateOnly)
			for range 2 {
				if st, _, b := p.do("POST", "/v1/chat/completions", prod.Key, map[string]any{"model": "m", "max_tokens": 20,
					"messages": []map[string]string{{"role": "user", "content": "hi"}}}); st != http.StatusOK {
					t.Fatalf("chat: %d %s", st, b)
				}
			}
			if st, _, b := p.do("POST", "/v1/chat/completions", other.Key, map[string]any{"model": "m", "max_tokens": 3,
				"messages": []map[string]string{{"role": "user", "content": "hi"}}}); st != http.StatusOK {
				t.Fatalf("chat: %d %s", st, b)
			}
			p.settled("acme")
			p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": prod.ID, "window": "day", "cap": 1000}, http.StatusCreated, nil)
			p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "org", "window": "month", "cap": 500_000}, http.StatusCreated, nil)
			p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": other.ID, "window": "day", "cap": 7}, http.StatusCreated, nil)

			for _, path := range []string{"/api/v1/key", "/api/v1/auth/key"} {
				st, body := p.view(path, prod.Key)
				d, _ := body["data"].(map[string]any)
				if st != http.StatusOK || d == nil {
					t.Fatalf("%s: %d %v", path, st, body)
				}
				// The key's day cap of 1,000 binds (the org's 500,000 a month has more room):
				// 960 left of it; the key spent 40, the org 43.
				if d["label"] != "prod" || micros(t, d["limit"]) != 1000 || micros(t, d["limit_remaining"]) != 960 || d["limit_reset"] != "daily" ||
					micros(t, d["usage"]) != 40 || micros(t, d["available"]) != 1_000_000-43 || micros(t, d["held"]) != 0 ||
					micros(t, d["ledger_balance"]) != 1_000_000-43 || d["is_free_tier"] != false || micros(t, d["byok_usage"]) != 0 {
					t.Fatalf("%s: %v", path, d)
				}
				if time.Now().UTC().Format(time.DateOnly) == day0 { // else the day turned: the day's usage is 0
					for _, f := range []string{"usage_daily", "usage_weekly", "usage_monthly"} {
						if micros(t, d[f]) != 40 {
							t.Fatalf("%s: %s %v", path, f, d[f])
						}
					}
				}
				if ls, _ := d["limits"].([]any); len(ls) != 2 {
					t.Fatalf("%s: limits in scope %v, want the key's and the org's", path, d["limits"])
				}
			}
			if _, body := p.view("/api/v1/key", other.Key); micros(t, body["data"].(map[string]any)["limit_remaining"]) != 4 {
				t.Fatalf("other key: %v", body)
			}

			// A request in flight: its hold is held, counted in the usage until it settles.
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				st, _, b := p.do("POST", "/v1/chat/completions", prod.Key, map[string]any{"model": "m", "max_tokens": 5,
					"messages": []map[string]string{{"role": "user", "content": "[slow]"}}})
				if st != http.StatusOK {
					t.Errorf("slow chat: %d %s", st, b)
				}
			}()
			for deadline := time.Now().Add(time.Minute); ; { // bounds a hang
				_, body := p.view("/api/v1/credits", prod.Key)
				d := body["data"].(map[string]any)
				if held := micros(t, d["held"]); held > 0 {
					if micros(t, d["total_credits"]) != 1_000_000 || micros(t, d["total_usage"]) != 43+held ||
						micros(t, d["available"]) != 1_000_000-43-held || micros(t, d["ledger_balance"]) != 1_000_000-43 {
						t.Fatalf("credits in flight: %v", d)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the slow request's hold never showed: %v", d)
				}
				time.Sleep(20 * time.Millisecond)
			}
			close(gate)
			wg.Wait()
			p.settled("acme")
			const spent = 48 // 40 + 3 + 5
			_, body := p.view("/api/v1/credits", prod.Key)
			if d := body["data"].(map[string]any); micros(t, d["total_credits"]) != 1_000_000 || micros(t, d["total_usage"]) != spent ||
				micros(t, d["available"]) != 1_000_000-spent || micros(t, d["held"]) != 0 {
				t.Fatalf("credits: %v", d)
			}
			for _, prefix := range []string{"", "/v1"} {
				st, sub := p.view(prefix+"/dashboard/billing/subscription", prod.Key)
				if st != http.StatusOK || sub["object"] != "billing_subscription" || micros(t, sub["hard_limit_usd"]) != 1_000_000 ||
					micros(t, sub["soft_limit_usd"]) != 1_000_000 || sub["has_payment_method"] != true || micros(t, sub["available"]) != 1_000_000-spent {
					t.Fatalf("%s subscription: %d %v", prefix, st, sub)
				}
				// total_usage is in hundredths of the currency: 48 micro-units are 0.0048 of them.
				st, u := p.view(prefix+"/dashboard/billing/usage?start_date=2026-01-01&end_date=2026-02-01", prod.Key)
				if n, _ := u["total_usage"].(json.Number); st != http.StatusOK || u["object"] != "list" || n != "0.0048" {
					t.Fatalf("%s usage: %d %v", prefix, st, u)
				}
			}
			if b := p.settled("acme"); b.LedgerBalance != 1_000_000-spent || b.Available != 1_000_000-spent {
				t.Fatalf("reading the view cost something: %+v", b)
			}

			// A wrong or missing key: 401 in the route's shape.
			for _, key := range []string{"sk-esc-wrong", ""} {
				for _, path := range []string{"/api/v1/key", "/api/v1/credits"} {
					st, body := p.view(path, key)
					e, _ := body["error"].(map[string]any)
					if code, _ := e["code"].(json.Number); st != http.StatusUnauthorized || code != "401" || e["message"] == "" || e["type"] != nil {
						t.Fatalf("%s with key %q: %d %v", path, key, st, body)
					}
				}
				for _, path := range dashboardPaths {
					st, body := p.view(path, key)
					e, _ := body["error"].(map[string]any)
					if st != http.StatusUnauthorized || e["type"] != "invalid_request_error" || e["code"] != "invalid_api_key" {
						t.Fatalf("%s with key %q: %d %v", path, key, st, body)
					}
				}
			}
		})
	}
}

// TestViewRateLimit: the views are rate-limited per key (issue 34): past the burst, a key gets
// 429 rate_limit_exceeded with Retry-After, in the route's own shape, while another key of the
// same org still reads its view.
func TestViewRateLimit(t *testing.T) {
	t.Parallel()
	p := startTestProxy(t, false, func(c *Config) { c.ViewRate, c.ViewBurst = 1, 3 })
	p.setup("acme", 1_000_000, 100)
	var a, b struct{ ID, Key string }
	p.admin("POST", "/orgs/acme/keys", map[string]string{"name": "a"}, http.StatusCreated, &a)
	p.admin("POST", "/orgs/acme/keys", map[string]string{"name": "b"}, http.StatusCreated, &b)
	// The burst of 3 (a rate of 1 a second refills at most a token or two meanwhile on a slow
	// machine: the 429 is asserted within 3 + the seconds the loop took).
	start, refused := time.Now(), 0
	var hdr http.Header
	var body []byte
	for i := 0; refused == 0; i++ {
		if i > 3+int(time.Since(start).Seconds())+1 {
			t.Fatalf("no 429 after %d calls", i)
		}
		st, h, bb := p.do(http.MethodGet, "/api/v1/credits", a.Key, nil)
		switch st {
		case http.StatusOK:
		case http.StatusTooManyRequests:
			refused, hdr, body = i, h, bb
		default:
			t.Fatalf("call %d: %d %s", i, st, bb)
		}
	}
	if refused < 3 {
		t.Fatalf("429 at call %d, before the burst of 3 was used", refused)
	}
	if ra, err := strconv.Atoi(hdr.Get("Retry-After")); err != nil || ra < 1 {
		t.Fatalf("Retry-After %q", hdr.Get("Retry-After"))
	}
	var or struct {
		Error struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &or); err != nil || or.Error.Code != http.StatusTooManyRequests || or.Error.Message == "" {
		t.Fatalf("OpenRouter 429 body %s", body)
	}
	// The one-api routes answer in OpenAI's shape; the same key's bucket is shared by the routes.
	st, _, bb := p.do(http.MethodGet, "/dashboard/billing/usage", a.Key, nil)
	var oe struct {
		Error struct{ Type, Code string } `json:"error"`
	}
	if err := json.Unmarshal(bb, &oe); st != http.StatusTooManyRequests || err != nil || oe.Error.Type != "rate_limit_exceeded" || oe.Error.Code != "rate_limit_exceeded" {
		t.Fatalf("dashboard after the burst: %d %s", st, bb)
	}
	// Another key of the org has its own bucket.
	if st, _, bb := p.do(http.MethodGet, "/api/v1/credits", b.Key, nil); st != http.StatusOK {
		t.Fatalf("other key: %d %s", st, bb)
	}
}

// TestViewLimiter: the token bucket refills at its rate up to its burst, and tells how long
// until the next token; full buckets are dropped once the map is large.
func TestViewLimiter(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	l := newViewLimiter(5, 10, func() time.Time { return now })
	for i := range 10 {
		if ok, _ := l.allow("k"); !ok {
			t.Fatalf("call %d refused within the burst", i)
		}
	}
	if ok, wait := l.allow("k"); ok || wait != 200*time.Millisecond {
		t.Fatalf("11th call: %v %v, want refused for 200ms", ok, wait)
	}
	now = now.Add(400 * time.Millisecond)
	for i := range 2 {
		if ok, _ := l.allow("k"); !ok {
			t.Fatalf("refilled call %d refused", i)
		}
	}
	if ok, _ := l.allow("k"); ok {
		t.Fatal("a third call after 400ms at 5/s")
	}
	if ok, _ := newViewLimiter(0, 10, time.Now).allow("k"); !ok {
		t.Fatal("rate 0 limits")
	}
	for i := range maxViewBuckets {
		l.allow(strconv.Itoa(i))
	}
	now = now.Add(time.Hour)
	l.allow("new")
	if len(l.buckets) != 1 {
		t.Fatalf("%d buckets kept after every one refilled", len(l.buckets))
	}
}

// TestDecimalUnits: micro-units as exact decimals of the currency (and of its hundredths).
func TestDecimalUnits(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		v      int64
		places int
		want   string
	}{{0, 6, "0"}, {1, 6, "0.000001"}, {1_950_810, 6, "1.95081"}, {1_000_000, 6, "1"}, {-500_000, 6, "-0.5"},
		{48, 4, "0.0048"}, {100_000_000_000_000, 6, "100000000"}, {-1, 6, "-0.000001"}} {
		if got := decimal(c.v, c.places); string(got) != c.want {
			t.Errorf("decimal(%d, %d) = %s, want %s", c.v, c.places, got, c.want)
		}
	}
}
