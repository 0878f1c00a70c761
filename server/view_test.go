package server

import (
	"bytes"
	"encoding/json"
	"net/http"
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
			p := startTestProxy(t, real)
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
			for deadline := time.Now().Add(10 * time.Second); ; {
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
