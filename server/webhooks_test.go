package server

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/webhook"
)

// TestWebhooksThroughTheProxy: on the running proxy (real Redis + Postgres, and embedded), a
// webhook made through the admin API receives, signed, the credit, the one low-balance event
// that requests served through the proxy cause when they take the balance below the org's
// threshold, and the key revocation.
func TestWebhooksThroughTheProxy(t *testing.T) {
	t.Parallel()
	bothModes(t, func(t *testing.T, real bool) {
		recv := newSignedReceiver(t)

		p := startTestProxy(t, real, allowPrivateWebhooks) // the receiver is an httptest server on loopback
		hookID := recv.subscribe(p, "balance.low", "credit.received", "key.revoked")
		key := p.setup("acme", 1_000, 65) // credits 1000
		p.admin("PATCH", "/orgs/acme", map[string]any{"low_balance_threshold": 970}, http.StatusOK, nil)
		if evs := recv.wait(1); evs[0]["type"] != "credit.received" {
			t.Fatalf("first event %v", evs[0])
		}
		// Each request costs 20: 980 (above), then 960 (crossed).
		for range 2 {
			if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hello world")); st != http.StatusOK {
				t.Fatalf("request: %d %s", st, b)
			}
			p.settled("acme")
		}
		evs := recv.wait(2)
		if evs[1]["type"] != "balance.low" || evs[1]["org"] != "acme" {
			t.Fatalf("second event %v", evs[1])
		}
		if data := evs[1]["data"].(map[string]any); data["balance"] != 960.0 || data["threshold"] != 970.0 {
			t.Fatalf("balance.low data %v", data)
		}
		// Further below: no new event until the balance comes back and crosses again.
		if st, _, _ := p.do("POST", "/v1/chat/completions", key, chat("hello world")); st != http.StatusOK {
			t.Fatal(st)
		}
		p.settled("acme")
		var k struct{ ID string }
		p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)
		p.admin("DELETE", "/keys/"+k.ID, nil, http.StatusNoContent, nil)
		evs = recv.wait(3)
		time.Sleep(200 * time.Millisecond)
		if evs = recv.events(); len(evs) != 3 || evs[2]["type"] != "key.revoked" {
			t.Fatalf("events %v; want the key revocation third and nothing more", evs)
		}
		// Each delivery is recorded as delivered at its first attempt (right after the answer).
		deadline := time.Now().Add(time.Minute)
		for {
			var ds struct {
				Data []struct {
					Status   string `json:"status"`
					Attempts int    `json:"attempts"`
				} `json:"data"`
			}
			p.admin("GET", "/webhooks/"+hookID+"/deliveries", nil, http.StatusOK, &ds)
			done := len(ds.Data) == 3
			for _, d := range ds.Data {
				done = done && d.Status == "delivered" && d.Attempts == 1
			}
			if done {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("deliveries %+v", ds)
			}
			time.Sleep(20 * time.Millisecond)
		}
		_, _, metrics := p.do("GET", "/metrics", "", nil)
		for _, want := range []string{"escrow_webhook_delivered_total 3\n", "escrow_webhook_attempts_total 3\n", "escrow_webhook_failed_total 0\n"} {
			if !strings.Contains(string(metrics), want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
	})
}

// TestLimitWebhooksThroughTheProxy: on the running proxy (real Redis + Postgres, and embedded),
// a webhook subscribed to limit.crossed through the admin API receives, signed, the 80 % event
// when the requests of a key with a daily cap have spent 80 % of it, then the 100 % event, each
// once, and nothing for the request the cap refuses.
func TestLimitWebhooksThroughTheProxy(t *testing.T) {
	t.Parallel()
	bothModes(t, func(t *testing.T, real bool) {
		recv := newSignedReceiver(t)

		p := startTestProxy(t, real, allowPrivateWebhooks) // the receiver is an httptest server on loopback
		recv.subscribe(p, "limit.crossed")
		p.setup("acme", 10_000, 20) // hold = cost = 20 per request
		var k struct{ ID, Key string }
		p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)
		var lim struct{ ID string }
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "key", "scope_id": k.ID, "window": "day", "cap": 100}, http.StatusCreated, &lim)
		request := func(want int) {
			t.Helper()
			if st, _, b := p.do("POST", "/v1/chat/completions", k.Key, chat("hello world")); st != want {
				t.Fatalf("request: %d %s, want %d", st, b, want)
			}
			p.settled("acme")
		}
		check := func(ev map[string]any, pct, used float64) {
			t.Helper()
			data, _ := ev["data"].(map[string]any)
			start, err := time.Parse(time.RFC3339, fmt.Sprint(data["window_start"]))
			if ev["type"] != "limit.crossed" || ev["org"] != "acme" || data["limit_id"] != lim.ID || data["scope"] != "key" ||
				data["scope_id"] != k.ID || data["window"] != "day" || data["cap"] != 100.0 || data["threshold"] != pct ||
				data["used"] != used || err != nil || !start.Equal(start.Truncate(24*time.Hour)) || time.Since(start) > 25*time.Hour {
				t.Fatalf("event %v; want limit.crossed %v%% at %v used", ev, pct, used)
			}
		}
		for range 3 {
			request(http.StatusOK) // 20, 40, 60
		}
		time.Sleep(100 * time.Millisecond)
		if evs := recv.events(); len(evs) != 0 {
			t.Fatalf("events below 80 %%: %v", evs)
		}
		request(http.StatusOK) // 80: 80 %
		check(recv.wait(1)[0], 80, 80)
		request(http.StatusOK) // 100: 100 %
		check(recv.wait(2)[1], 100, 100)
		if st, _, b := p.do("POST", "/v1/chat/completions", k.Key, chat("hello world")); st != http.StatusTooManyRequests {
			t.Fatalf("over the cap: %d %s", st, b)
		}
		time.Sleep(200 * time.Millisecond)
		if evs := recv.events(); len(evs) != 2 {
			t.Fatalf("events %v; want the 80 %% and 100 %% crossings only", evs)
		}
	})
}

// signedReceiver is a webhook endpoint (a real HTTP server) that checks each delivery's
// signature with the endpoint's secret and keeps the events it got.
type signedReceiver struct {
	t      *testing.T
	srv    *httptest.Server
	mu     sync.Mutex
	got    []map[string]any
	secret string
}

func newSignedReceiver(t *testing.T) *signedReceiver {
	r := &signedReceiver{t: t}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		defer r.mu.Unlock()
		if err := webhook.Verify(req.Header.Get(webhook.HeaderSignature), r.secret, body, time.Minute, time.Now()); err != nil {
			t.Errorf("event %s: %v", body, err)
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		var ev map[string]any
		if err := json.Unmarshal(body, &ev); err != nil || ev["id"] != req.Header.Get(webhook.HeaderEventID) || ev["type"] != req.Header.Get(webhook.HeaderEventType) {
			t.Errorf("body %s, headers %v: %v", body, req.Header, err)
		}
		r.got = append(r.got, ev)
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// subscribe makes a webhook to the receiver for events through p's admin API, keeps its secret
// and returns its id.
func (r *signedReceiver) subscribe(p *testProxy, events ...string) string {
	var w struct{ ID, Secret string }
	r.mu.Lock()
	defer r.mu.Unlock()
	p.admin("POST", "/webhooks", map[string]any{"url": r.srv.URL, "events": events}, http.StatusCreated, &w)
	r.secret = w.Secret
	return w.ID
}

func (r *signedReceiver) events() []map[string]any {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// wait returns the events once there are at least n (fails the test after a minute: a hang).
func (r *signedReceiver) wait(n int) []map[string]any {
	r.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for len(r.events()) < n {
		if time.Now().After(deadline) {
			r.t.Fatalf("got %d events, want %d: %v", len(r.events()), n, r.events())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return r.events()
}

// allowPrivateWebhooks lets webhooks reach the tests' receivers on loopback.
func allowPrivateWebhooks(c *Config) { c.WebhookAllowPrivate = true }

// TestWebhookAddressPolicy (issue 22 item 4): the admin API refuses webhook endpoints on
// loopback, unspecified, link-local (cloud metadata) and private addresses, and URLs with
// credentials, naming the reason; ESCROW_WEBHOOK_ALLOW_PRIVATE lets the private ones in, never
// the credentials.
func TestWebhookAddressPolicy(t *testing.T) {
	t.Parallel()
	private := []string{"http://127.0.0.1:9/h", "http://[::1]:9/h", "http://0.0.0.0:9/h", "http://169.254.169.254/latest/meta-data/",
		"http://localhost:6379", "http://10.1.2.3/h", "http://192.168.0.10/h", "http://172.20.0.1/h", "http://[fd12::1]/h"}
	creds := "https://user:pass@hooks.example.com/h"
	create := func(p *testProxy, u string) (int, string) {
		st, _, b := p.do("POST", "/admin/v1/webhooks", testAdmin, map[string]any{"url": u, "events": []string{"credit.received"}})
		return st, string(b)
	}
	p := startTestProxy(t, true)
	for _, u := range append(private, creds) {
		if st, b := create(p, u); st != http.StatusBadRequest || !strings.Contains(b, "not allowed") {
			t.Errorf("%s: %d %s, want 400 naming the refusal", u, st, b)
		}
	}
	if st, b := create(p, "https://hooks.example.com/h"); st != http.StatusCreated {
		t.Errorf("a public endpoint: %d %s", st, b)
	}
	allowed := startTestProxy(t, true, allowPrivateWebhooks)
	for _, u := range private {
		if st, b := create(allowed, u); st != http.StatusCreated {
			t.Errorf("%s with private addresses allowed: %d %s", u, st, b)
		}
	}
	if st, b := create(allowed, creds); st != http.StatusBadRequest {
		t.Errorf("%s with private addresses allowed: %d %s, want 400", creds, st, b)
	}
}
