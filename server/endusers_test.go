package server

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

// TestEndUsersProxy (DESIGN "Limits", third wave), over HTTP on real Redis and Postgres (and the
// embedded parts): two end users under one per-end-user daily cap of requests are stopped apart
// — each gets exactly the cap, the next is 429 rate_limit_exceeded — and a request naming no
// end user is counted by no end-user limit. The usage report by end user adds up to the ledger.
// After a Redis data loss (the org's keys gone) the counters are rebuilt from the ledger: each
// end user is still at the cap, and a third end user starts from zero.
func TestEndUsersProxy(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, real bool) {
		const perUser = 3
		p, k := rateProxy(t, real, 1_000_000)
		var lim struct{ ID string }
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "end_user", "window": "day", "unit": "requests", "cap": perUser},
			http.StatusCreated, &lim)
		send := func(user string) (int, string) {
			body := `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]`
			if user != "" {
				body += `,"user":"` + user + `"`
			}
			st, _, b := p.do("POST", "/v1/chat/completions", k.Key, body+"}")
			return st, string(b)
		}
		served := func(user string, want int) {
			t.Helper()
			for i := range want {
				if st, b := send(user); st != http.StatusOK {
					t.Fatalf("%s's request %d: %d %s", user, i, st, b)
				}
			}
			if st, b := send(user); st != http.StatusTooManyRequests || !strings.Contains(b, "rate_limit_exceeded") || !strings.Contains(b, `"scope":"end_user"`) {
				t.Fatalf("%s past the cap: %d %s", user, st, b)
			}
		}
		served("alice", perUser)
		served("bob@example.com", perUser)
		for range perUser + 2 {
			if st, b := send(""); st != http.StatusOK {
				t.Fatalf("no end user: %d %s", st, b)
			}
		}
		p.settled("acme")

		var usage struct {
			Data []struct {
				Group    string `json:"group"`
				Requests int64
				Cost     int64
			}
		}
		p.admin("GET", "/orgs/acme/usage?group_by=end_user", nil, http.StatusOK, &usage)
		by, total := map[string]int64{}, int64(0)
		for _, g := range usage.Data {
			by[g.Group] = g.Requests
			total += g.Cost
		}
		if by["alice"] != perUser || by["bob@example.com"] != perUser || by[""] != perUser+2 {
			t.Fatalf("usage by end user %+v", usage.Data)
		}
		if b := p.balance("acme"); total != 1_000_000-b.LedgerBalance {
			t.Fatalf("usage by end user costs %d, the ledger charged %d", total, 1_000_000-b.LedgerBalance)
		}

		// Redis loses the org's data: the next request reseeds the counters from the ledger.
		ks := balance.KeysOf(p.app.cfg.Prefix, "acme")
		if err := p.app.rdb.Del(context.Background(), ks.Acct, ks.Holds, ks.Hexp, ks.Hfin, ks.Gone, ks.Lim, ks.U).Err(); err != nil {
			t.Fatal(err)
		}
		served("carol", perUser)
		if st, b := send("alice"); st != http.StatusTooManyRequests {
			t.Fatalf("alice after the data loss: %d %s, want her counter rebuilt at the cap", st, b)
		}
		p.settled("acme")
		var eus struct {
			Data []struct {
				EndUser string `json:"end_user"`
				Used    int64
			}
		}
		p.admin("GET", "/orgs/acme/limits/"+lim.ID+"/end_users", nil, http.StatusOK, &eus)
		got := map[string]int64{}
		for _, e := range eus.Data {
			got[e.EndUser] = e.Used
		}
		if len(got) != 3 || got["alice"] != perUser || got["bob@example.com"] != perUser || got["carol"] != perUser {
			t.Fatalf("the limit's end users %+v", eus.Data)
		}
	}
	t.Run("real", func(t *testing.T) { t.Parallel(); run(t, true) })
	t.Run("embedded", func(t *testing.T) { t.Parallel(); run(t, false) })
}
