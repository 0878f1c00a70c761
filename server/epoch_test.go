package server

import (
	"net/http"
	"testing"
)

// TestAdminRaiseEpoch: after the admin raises the ledger epoch (as after a restore), the hot
// balance of the old epoch is dropped and reseeded: requests go on and money still adds up.
func TestAdminRaiseEpoch(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 1000, 65)
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); st != http.StatusOK {
			t.Fatalf("before: %d %s", st, b)
		}
		p.settled("acme")
		var e1, e2 struct{ Generation int64 }
		p.admin("POST", "/ledger/epoch", nil, http.StatusOK, &e1)
		p.admin("POST", "/ledger/epoch", nil, http.StatusOK, &e2)
		if e1.Generation < 2 || e2.Generation != e1.Generation+1 {
			t.Fatalf("generations %d then %d", e1.Generation, e2.Generation)
		}
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hi")); st != http.StatusOK {
			t.Fatalf("after: %d %s", st, b)
		}
		if b := p.settled("acme"); b.LedgerBalance != 960 || b.Available != 960 {
			t.Fatalf("final %+v, want 960", b)
		}
	})
}
