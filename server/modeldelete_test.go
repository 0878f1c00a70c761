package server

import (
	"net/http"
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
	g := startGatedModel(t, true, 100_000_000)
	a, b, key, arrived, release := g.a, g.b, g.key, g.arrived, g.release

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
	release()
	wg.Wait()
	t.Logf("%d requests during and after the refused DELETE: %v", len(statuses), statuses)
	a.admin("GET", "/models/slow", nil, http.StatusOK, nil)
}
