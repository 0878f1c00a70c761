package server

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestExemptOrgProxy (issue 36): an exempt org (PATCH /orgs/:org {"exempt": true}) with a zero
// balance gets a burst of 2,000 concurrent requests served, all in flight together (the
// upstream gate opens once every request is decided), none of them holding money; after the
// settle its ledger and hot balance are exactly −2,000 × 20, shown as such with exempt: true.
// A second exempt org with a lifetime limit of 5 requests gets exactly 5 of 20 served: its
// limits still refuse. The same zero balance without the flag is refused (insufficient_quota).
func TestExemptOrgProxy(t *testing.T) {
	const total, unit, capped = 2000, 20, 5
	g := &gate{h: fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), open: make(chan struct{})}
	p := startTestProxyWith(t, true, []Option{WithUpstream(g, "sk-fake-upstream")}, func(c *Config) {
		c.MaxInFlight = 2 * total
		c.ReserveTimeout = time.Minute
	})
	p.admin("PUT", "/models/m", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": unit, "max_cost": unit, "default_hold": unit}, http.StatusOK, nil)
	key := func(org string, exempt bool) string {
		p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
		if exempt {
			var v struct{ Exempt bool }
			p.admin("PATCH", "/orgs/"+org, map[string]any{"exempt": true}, http.StatusOK, &v)
			if !v.Exempt {
				t.Fatalf("PATCH exempt: the org view does not show it")
			}
		}
		var k struct{ ID, Key string }
		p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
		return k.Key
	}
	own, limited, paying := key("own", true), key("own2", true), key("paying", false)
	var lim struct{ ID string }
	p.admin("POST", "/orgs/own2/limits", map[string]any{"scope": "org", "window": "lifetime", "unit": "requests", "cap": capped}, http.StatusCreated, &lim)
	body := `{"model":"m","messages":[{"role":"user","content":"hello"}]}`
	for _, k := range []string{own, limited, paying} { // known to the proxy before the burst
		if st, _, b := p.do("GET", "/v1/models", k, nil); st != http.StatusOK {
			t.Fatalf("GET /v1/models: %d %s", st, b)
		}
	}

	burst := func(key string, n int64) (ok, rateLimited, other int64, first string) {
		var okN, rl, oth atomic.Int64
		var firstOther atomic.Value
		before := g.arrived.Load()
		wait := p.fire(key, body, n, func(status int, h http.Header, b []byte, err error) {
			switch {
			case err == nil && status == http.StatusOK:
				okN.Add(1)
			case err == nil && status == http.StatusTooManyRequests && strings.Contains(string(b), `"code":"rate_limit_exceeded"`):
				rl.Add(1)
			default:
				firstOther.CompareAndSwap(nil, strconv.Itoa(status)+" "+string(b))
				oth.Add(1)
			}
		})
		deadline := time.Now().Add(2 * time.Minute)
		for g.arrived.Load()-before+rl.Load()+oth.Load() < n && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if b := p.balance(orgOf(key, own, limited)); b.Held != 0 {
			t.Errorf("exempt requests in flight hold %d", b.Held)
		}
		close(g.open)
		wait()
		f, _ := firstOther.Load().(string)
		return okN.Load(), rl.Load(), oth.Load(), f
	}

	if ok, rl, other, first := burst(own, total); ok != total || rl != 0 || other != 0 {
		t.Fatalf("exempt burst: %d ok, %d rate limited, %d other (first %s); want all %d served", ok, rl, other, first, total)
	}
	b := p.settled("own")
	acct, err := p.app.ledger.Account(context.Background(), "own")
	if err != nil || b.LedgerBalance != -total*unit || b.Available != -total*unit || acct.Balance != -total*unit {
		t.Fatalf("after the burst: %+v, ledger %+v %v; want both at %d", b, acct, err, -total*unit)
	}
	var view struct {
		Exempt        bool
		LedgerBalance int64 `json:"ledger_balance"`
		Available     int64
	}
	p.admin("GET", "/orgs/own/balance", nil, http.StatusOK, &view)
	if !view.Exempt || view.LedgerBalance != -total*unit {
		t.Fatalf("balance view %+v", view)
	}

	g.open = make(chan struct{}) // every request of the first burst has answered
	if ok, rl, other, first := burst(limited, 20); ok != capped || rl != 20-capped || other != 0 {
		t.Fatalf("exempt org with a limit of %d requests: %d ok, %d rate limited, %d other (first %s)", capped, ok, rl, other, first)
	}
	if b := p.settled("own2"); b.LedgerBalance != -capped*unit {
		t.Fatalf("limited exempt org after settle: %+v, want %d", b, -capped*unit)
	}
	if st, _, b := p.do("POST", "/v1/chat/completions", paying, body); st != http.StatusTooManyRequests || !strings.Contains(string(b), "insufficient_quota") {
		t.Fatalf("a paying org with no balance: %d %s", st, b)
	}
}

func orgOf(key, own, limited string) string {
	if key == own {
		return "own"
	}
	return "own2"
}
