package webhook_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// TestSlowEndpointKeepsItsShare (issue 22 item 9): an endpoint that does not answer holds at
// most PerEndpoint (default Concurrency/4) of the sender's slots, so another endpoint's events
// are all delivered while it hangs.
func TestSlowEndpointKeepsItsShare(t *testing.T) {
	t.Parallel()
	ledgers(t, func(t *testing.T, l ledger.Ledger) {
		release := make(chan struct{})
		var mu sync.Mutex
		var running, most int
		slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			mu.Lock()
			running++
			most = max(most, running)
			mu.Unlock()
			defer func() {
				mu.Lock()
				running--
				mu.Unlock()
			}()
			select {
			case <-release:
			case <-req.Context().Done():
			}
		}))
		t.Cleanup(slow.Close)
		fast := newReceiver(t, func(int) int { return http.StatusOK })
		h := l.(ledger.Webhooks)
		events := []ledger.EventType{ledger.EventCreditReceived}
		if _, _, err := h.CreateWebhook(context.Background(), slow.URL, events); err != nil {
			t.Fatal(err)
		}
		fw, _, err := h.CreateWebhook(context.Background(), fast.URL, events)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.CreateOrg(context.Background(), "o"); err != nil {
			t.Fatal(err)
		}
		const n = 12 // more than the 8 slots
		for i := range n {
			if _, _, err := l.Credit(context.Background(), "o", 1, fmt.Sprintf("p%d", i)); err != nil {
				t.Fatal(err)
			}
		}
		cfg := fastConfig()
		cfg.Timeout, cfg.Lease = time.Minute, 2*time.Minute // the slow endpoint hangs until the test ends
		s := startSender(t, l, cfg)
		t.Cleanup(func() { close(release) }) // before the sender stops and the server closes
		waitFor(t, "every event delivered to the healthy endpoint", func() bool {
			ds := deliveries(t, l, fw.ID)
			for _, d := range ds {
				if d.Status != ledger.DeliveryDelivered {
					return false
				}
			}
			return len(ds) == n
		})
		mu.Lock()
		m := most
		mu.Unlock()
		if per := s.Config().PerEndpoint; per != 2 || m > per {
			t.Fatalf("%d attempts to the slow endpoint ran at once; PerEndpoint %d", m, per)
		}
	})
}
