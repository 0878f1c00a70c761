package main

import (
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/testutil"
)

// TestClusterFlows runs the end-to-end flows against a private 3-master Redis Cluster (REDIS_URL
// with one URL per master) and real Postgres: every script the proxy calls must stay within one
// slot (a CROSSSLOT error would fail the flows), and the orgs of the run land on different
// masters.
func TestClusterFlows(t *testing.T) {
	t.Parallel()
	cl := testutil.StartRedisCluster(t)
	urls := make([]string, 0, 3)
	for _, a := range cl.Addrs() {
		urls = append(urls, "redis://"+a)
	}
	start := func(t *testing.T) *testProxy {
		pg := testutil.Postgres(t)
		return startTestProxy(t, false, func(c *config) {
			c.RedisURL, c.DatabaseURL, c.Prefix = strings.Join(urls, ","), pg.URL, testutil.RandomName("c")
		})
	}

	// Flow A: 20 concurrent requests, all in flight together, then settled to the micro-unit.
	t.Run("A", func(t *testing.T) {
		t.Parallel()
		p := start(t)
		key := p.setup("acme", 10_000, 65)
		var wg sync.WaitGroup
		statuses := make([]int, 20)
		for i := range statuses {
			wg.Go(func() { statuses[i], _, _ = p.do("POST", "/v1/chat/completions", key, chat("[slow] hello world")) })
		}
		deadline := time.Now().Add(3 * time.Second)
		var seen balanceView
		for time.Now().Before(deadline) {
			if seen = p.balance("acme"); seen.Holds == 20 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if seen.Holds != 20 || seen.Held != 20*65 || seen.Available != 10_000-20*65 {
			t.Fatalf("in flight: %+v, want 20 holds of 65", seen)
		}
		wg.Wait()
		for i, s := range statuses {
			if s != http.StatusOK {
				t.Fatalf("request %d: status %d", i, s)
			}
		}
		if b := p.settled("acme"); b.Available != 10_000-20*20 || b.LedgerBalance != 10_000-20*20 {
			t.Fatalf("after settle: %+v, want %d", b, 10_000-20*20)
		}
	})

	// Flow B: balance 200, hold 65, cost 20, 10 concurrent requests → 3 pass, 7 get 429.
	t.Run("B", func(t *testing.T) {
		t.Parallel()
		p := start(t)
		key := p.setup("acme", 200, 65)
		var wg sync.WaitGroup
		statuses := make([]int, 10)
		for i := range statuses {
			wg.Go(func() { statuses[i], _, _ = p.do("POST", "/v1/chat/completions", key, chat("[slow] hi")) })
		}
		wg.Wait()
		count := map[int]int{}
		for _, s := range statuses {
			count[s]++
		}
		if count[http.StatusOK] != 3 || count[http.StatusTooManyRequests] != 7 {
			t.Fatalf("statuses %v; want 3 × 200 and 7 × 429", count)
		}
		if b := p.settled("acme"); b.Available != 140 || b.LedgerBalance != 140 {
			t.Fatalf("final: %+v, want 140", b)
		}
	})

	// Several orgs (spread over the masters) and a recharge: each settles to its own ledger.
	t.Run("orgs", func(t *testing.T) {
		t.Parallel()
		p := start(t)
		orgs := []string{"org-a", "org-b", "org-c", "org-d", "org-e", "org-f"}
		keys := map[string]string{}
		for i, org := range orgs {
			if i == 0 {
				keys[org] = p.setup(org, 1000, 65)
				continue
			}
			p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
			p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": 1000, "reference": "init-" + org}, http.StatusCreated, nil)
			var k struct{ Key string }
			p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
			keys[org] = k.Key
		}
		masters := map[string]bool{}
		for _, org := range orgs {
			masters[cl.NodeFor("esc:{"+org+"}:acct").Addr()] = true
		}
		if len(masters) < 2 {
			t.Fatalf("the orgs all live on one master; pick other names")
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		bad := 0
		for _, org := range orgs {
			for range 5 {
				wg.Go(func() {
					if st, _, _ := p.do("POST", "/v1/chat/completions", keys[org], chat("hello")); st != http.StatusOK {
						mu.Lock()
						bad++
						mu.Unlock()
					}
				})
			}
		}
		wg.Wait()
		if bad != 0 {
			t.Fatalf("%d requests failed", bad)
		}
		p.admin("POST", "/orgs/org-c/credits", map[string]any{"amount": 500, "reference": "pay-c"}, http.StatusCreated, nil)
		for _, org := range orgs {
			want := int64(1000 - 5*20)
			if org == "org-c" {
				want += 500
			}
			if b := p.settled(org); b.Available != want || b.LedgerBalance != want {
				t.Fatalf("%s: %+v, want %d", org, b, want)
			}
		}
	})
}
