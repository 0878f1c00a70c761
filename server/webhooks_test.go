package server

import (
	"encoding/json"
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
		var mu sync.Mutex
		var got []map[string]any
		var secret string
		recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			mu.Lock()
			defer mu.Unlock()
			if err := webhook.Verify(r.Header.Get(webhook.HeaderSignature), secret, body, time.Minute, time.Now()); err != nil {
				t.Errorf("event %s: %v", body, err)
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			var ev map[string]any
			if err := json.Unmarshal(body, &ev); err != nil || ev["id"] != r.Header.Get(webhook.HeaderEventID) {
				t.Errorf("body %s, event id header %q: %v", body, r.Header.Get(webhook.HeaderEventID), err)
			}
			got = append(got, ev)
		}))
		t.Cleanup(recv.Close)
		events := func() []map[string]any {
			mu.Lock()
			defer mu.Unlock()
			return slices.Clone(got)
		}
		waitEvents := func(n int) []map[string]any {
			t.Helper()
			deadline := time.Now().Add(20 * time.Second)
			for len(events()) < n {
				if time.Now().After(deadline) {
					t.Fatalf("got %d events, want %d: %v", len(events()), n, events())
				}
				time.Sleep(20 * time.Millisecond)
			}
			return events()
		}

		p := startTestProxy(t, real)
		var w struct{ ID, Secret string }
		mu.Lock()
		p.admin("POST", "/webhooks", map[string]any{"url": recv.URL, "events": []string{"balance.low", "credit.received", "key.revoked"}}, http.StatusCreated, &w)
		secret = w.Secret
		mu.Unlock()
		key := p.setup("acme", 1_000, 65) // credits 1000
		p.admin("PATCH", "/orgs/acme", map[string]any{"low_balance_threshold": 970}, http.StatusOK, nil)
		if evs := waitEvents(1); evs[0]["type"] != "credit.received" {
			t.Fatalf("first event %v", evs[0])
		}
		// Each request costs 20: 980 (above), then 960 (crossed).
		for range 2 {
			if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hello world")); st != http.StatusOK {
				t.Fatalf("request: %d %s", st, b)
			}
			p.settled("acme")
		}
		evs := waitEvents(2)
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
		evs = waitEvents(3)
		time.Sleep(200 * time.Millisecond)
		if evs = events(); len(evs) != 3 || evs[2]["type"] != "key.revoked" {
			t.Fatalf("events %v; want the key revocation third and nothing more", evs)
		}
		// Each delivery is recorded as delivered at its first attempt (right after the answer).
		deadline := time.Now().Add(10 * time.Second)
		for {
			var ds struct {
				Data []struct {
					Status   string `json:"status"`
					Attempts int    `json:"attempts"`
				} `json:"data"`
			}
			p.admin("GET", "/webhooks/"+w.ID+"/deliveries", nil, http.StatusOK, &ds)
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
