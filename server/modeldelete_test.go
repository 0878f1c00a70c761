package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestDeleteModelRefusedStaysVisible (issue 34 item 4): a DELETE that ends in 409
// model_in_flight never makes the model invisible. Before, the model was deleted in the ledger
// and marked deleting in Redis first, and put back only after the wait of a model change: the
// requests that came meanwhile were answered 404 model_not_found. Requests keep coming on
// another proxy for as long as the DELETE runs (each waits at the upstream, so none records
// usage that would refuse the DELETE for another reason); none may be refused.
func TestDeleteModelRefusedStaysVisible(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var once sync.Once
	arrived := make(chan struct{}, 1)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), "wait for me") {
			arrived <- struct{}{}
		}
		<-release
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","model":"slow","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`)
	}))
	t.Cleanup(up.Close)
	ps := startSharedProxies(t, 2, func(c *Config) { c.UpstreamURL, c.UpstreamAPIKey = up.URL, "sk-test-upstream" })
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	a, b := ps[0], ps[1]
	key := a.setup("payer", 100_000_000, 50_000)
	a.admin("PUT", "/models/slow", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": 1000, "default_hold": 1000}, http.StatusOK, nil)

	var wg sync.WaitGroup
	var mu sync.Mutex
	var statuses []int
	ask := func(content string) {
		wg.Go(func() {
			resp, body := b.send("/v1/chat/completions", key, `{"model":"slow","messages":[{"role":"user","content":"`+content+`"}]}`, nil)
			mu.Lock()
			defer mu.Unlock()
			statuses = append(statuses, resp.StatusCode)
			if resp.StatusCode != http.StatusOK {
				t.Errorf("a request while a refused DELETE ran: %d %s", resp.StatusCode, body)
			}
		})
	}
	ask("wait for me")
	<-arrived
	deleted := make(chan int)
	go func() {
		st, _, _ := a.do("DELETE", "/admin/v1/models/slow", testAdmin, nil)
		deleted <- st
	}()
	var st int
	for polling := true; polling; {
		ask("and me")
		select {
		case st = <-deleted:
			polling = false
		case <-time.After(20 * time.Millisecond):
		}
	}
	ask("and me, after it") // one more, after the refusal
	if st != http.StatusConflict {
		t.Fatalf("DELETE with a request in flight: %d, want 409", st)
	}
	once.Do(func() { close(release) })
	wg.Wait()
	t.Logf("%d requests during and after the refused DELETE: %v", len(statuses), statuses)
	a.admin("GET", "/models/slow", nil, http.StatusOK, nil)
}
