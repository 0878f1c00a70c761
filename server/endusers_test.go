package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
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

// TestEndUserCountersOnlyForHoldsThatPassed (issue 34, item 2), over HTTP on real Redis and
// Postgres and on the embedded parts: 300 requests, each naming a new end user, under two limits
// of each end user apart (requests a day, money for a lifetime) all fail upstream (nothing is
// charged), and 40 more new end users are refused by their own lifetime cap before the upstream
// is called. Afterwards no per-end-user counter field is left in Redis: a hold that cost nothing
// takes the field it created with it, and a refusal creates none. One served request then
// leaves exactly its end user's two counters, with its cost and its 1 request.
func TestEndUserCountersOnlyForHoldsThatPassed(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, real bool) {
		p, k := rateProxy(t, real, 1_000_000)
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "end_user", "window": "day", "unit": "requests", "cap": 5},
			http.StatusCreated, nil)
		p.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "end_user", "window": "lifetime", "cap": 10},
			http.StatusCreated, nil)
		// send may run on any goroutine: a transport error is a status 0, never a t.Fatal
		send := func(user, content string, maxTokens int, hdr map[string]string) (int, string) {
			body := `{"model":"m","max_tokens":` + strconv.Itoa(maxTokens) + `,"messages":[{"role":"user","content":"` + content + `"}],"user":"` + user + `"}`
			req, err := http.NewRequest(http.MethodPost, p.base+"/v1/chat/completions", strings.NewReader(body))
			if err != nil {
				return 0, err.Error()
			}
			req.Header.Set("Authorization", "Bearer "+k.Key)
			req.Header.Set("Content-Type", "application/json")
			for h, v := range hdr {
				req.Header.Set(h, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0, err.Error()
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		var wg sync.WaitGroup
		errs := make(chan string, 400)
		for w := range 8 {
			wg.Go(func() {
				for i := w; i < 300; i += 8 {
					if st, b := send(fmt.Sprintf("failing-%03d@example.com", i), "[fail]", 5, nil); st < 400 || st == http.StatusServiceUnavailable {
						errs <- fmt.Sprintf("a failing request answered %d %s", st, b)
					}
				}
				for i := w; i < 40; i += 8 {
					// a hold of 20 > the lifetime cap of 10: refused before the upstream
					if st, b := send(fmt.Sprintf("refused-%03d", i), "hi", 20, map[string]string{"x-escrow-fit": "off"}); st != http.StatusTooManyRequests {
						errs <- fmt.Sprintf("an over-cap request answered %d %s", st, b)
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Fatal(e)
		}
		p.settled("acme")
		ks := balance.KeysOf(p.app.cfg.Prefix, "acme")
		ctx := context.Background()
		endUserFields := func() map[string]string {
			all, err := p.app.rdb.HGetAll(ctx, ks.U).Result()
			if err != nil {
				t.Fatal(err)
			}
			out := map[string]string{}
			for f, v := range all {
				if strings.Count(f, ":") >= 2 { // '<limit id>:<window start>:<end user>'
					out[f] = v
				}
			}
			return out
		}
		if left := endUserFields(); len(left) != 0 {
			t.Fatalf("%d per-end-user counter fields left by requests that cost nothing, e.g. %v", len(left), first(left))
		}
		if st, b := send("served", "hi", 5, nil); st != http.StatusOK {
			t.Fatalf("served: %d %s", st, b)
		}
		p.settled("acme")
		got := endUserFields()
		var used []string
		for f, v := range got {
			if !strings.HasSuffix(f, ":served") {
				t.Fatalf("field %s=%s of another end user", f, v)
			}
			used = append(used, v)
		}
		slices.Sort(used)
		if len(used) != 2 || used[0] != "1" || used[1] != "5" {
			t.Fatalf("the served end user's counters %v, want 1 request and a cost of 5", got)
		}
	}
	t.Run("real", func(t *testing.T) { t.Parallel(); run(t, true) })
	t.Run("embedded", func(t *testing.T) { t.Parallel(); run(t, false) })
}

func first(m map[string]string) string {
	for k, v := range m {
		return k + "=" + v
	}
	return ""
}
