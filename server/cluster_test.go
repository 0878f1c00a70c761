package server

import (
	"net/http"
	"sync"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestClusterFlows: on a private 3-master Redis Cluster (every end-to-end flow also runs there,
// through eachMode), several orgs whose keys live on different masters are served and settle,
// each to its own ledger, around a recharge.
func TestClusterFlows(t *testing.T) {
	t.Parallel()
	cl := testutil.StartRedisCluster(t)
	start := func(t *testing.T) *testProxy { return startClusterProxy(t, cl) }

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
			masters[cl.NodeFor(balance.KeysOf(balance.DefaultPrefix, org).Acct).Addr()] = true
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
