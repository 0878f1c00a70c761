package admin_test

import (
	"context"
	"encoding/csv"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

type endUserRow struct {
	EndUser string `json:"end_user"`
	Used    int64  `json:"used"`
	Held    int64  `json:"held"`
}

// TestLimitEndUserRoutes (issue 26): limits of scope end_user are created with and without a
// scope_id; the list shows, for a limit of each end user apart, how many end users have a
// counter in its current window (used and held: the end user nearest the cap), and
// …/limits/{id}/end_users lists them, paged, from the ledger while the org is cold and from the
// hot counters while it is warm; usage?group_by=end_user adds up to the charges.
func TestLimitEndUserRoutes(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, r *limitsRig) {
		ctx := context.Background()
		r.call("POST", "/orgs", `{"id":"acme"}`, 201, nil)
		r.call("POST", "/orgs/acme/credits", `{"amount":1000000,"reference":"pay-1"}`, 201, nil)

		var each, alice limitRow
		if b := r.call("POST", "/orgs/acme/limits", `{"scope":"end_user","window":"day","cap":100}`, 201, &each); strings.Contains(b, "scope_id") {
			t.Fatalf("a limit of each end user apart has no scope_id: %s", b)
		}
		r.call("POST", "/orgs/acme/limits", `{"scope":"end_user","scope_id":"alice","window":"day","cap":1000}`, 201, &alice)
		if each.Scope != "end_user" || each.ScopeID != "" || alice.Scope != "end_user" || alice.ScopeID != "alice" {
			t.Fatalf("created %+v and %+v", each, alice)
		}
		r.refused("POST", "/orgs/acme/limits", `{"scope":"end_user","scope_id":"a:b","window":"day","cap":5}`, 400, "invalid_value")
		r.refused("POST", "/orgs/acme/limits", `{"scope":"end_user","scope_id":"{x}","window":"day","cap":5}`, 400, "invalid_value")
		r.refused("POST", "/orgs/acme/limits", `{"scope":"end_user","scope_id":"bob","window":"day","cap":5,"require_end_user":true}`, 400, "invalid_value")
		r.refused("POST", "/orgs/acme/limits", `{"scope":"org","window":"day","cap":5,"require_end_user":true}`, 400, "invalid_value")

		// Charges of alice, bob and no end user, reserved at the rig's limit clock (noon).
		noon := time.Date(2030, 6, 14, 12, 0, 0, 0, time.UTC)
		var evs []ledger.UsageEvent
		for i, c := range []struct {
			eu   string
			cost int64
		}{{"alice", 30}, {"bob", 50}, {"", 70}, {"alice", 5}} {
			evs = append(evs, ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: "acme", Model: "m", EndUser: c.eu, Cost: c.cost,
				Usage: pricing.Usage{Prompt: 1}, ReservedAt: noon.Add(time.Duration(i) * time.Second)})
		}
		if err := r.ledger.RecordUsage(ctx, evs); err != nil {
			t.Fatal(err)
		}
		if _, err := r.ledger.AccountPending(ctx, 100); err != nil {
			t.Fatal(err)
		}

		// Cold: the ledger's numbers.
		if err := r.store.Invalidate(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		var ls struct {
			Data []struct {
				limitRow
				EndUsers *int `json:"end_users"`
			} `json:"data"`
		}
		r.call("GET", "/orgs/acme/limits", "", 200, &ls)
		if len(ls.Data) != 2 || ls.Data[0].EndUsers == nil || *ls.Data[0].EndUsers != 2 || ls.Data[0].Used != 50 || ls.Data[0].Held != 0 {
			t.Fatalf("cold: the limit of each end user %+v, want 2 end users, the most used 50", ls.Data)
		}
		if ls.Data[1].EndUsers != nil || ls.Data[1].Used != 35 {
			t.Fatalf("cold: alice's limit %+v, want used 35 and no end user count", ls.Data[1])
		}
		var page struct {
			Data []endUserRow `json:"data"`
			Next *string      `json:"next"`
		}
		r.call("GET", "/orgs/acme/limits/"+each.ID+"/end_users", "", 200, &page)
		if want := []endUserRow{{"alice", 35, 0}, {"bob", 50, 0}}; !slices.Equal(page.Data, want) || page.Next != nil {
			t.Fatalf("cold: end users %+v next %v, want %+v", page.Data, page.Next, want)
		}

		// Warm: the hot counters (the fields '<limit id>:<window start>:<end user>' that reserve
		// and seed keep), with what the live holds add; the ledger's spend up to the watermark
		// is the settled part.
		if err := r.store.Warm(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		start := balance.Day.StartMS(noon)
		field := func(eu string) string { return each.ID + ":" + strconv.FormatInt(start, 10) + ":" + eu }
		u := balance.KeysOf(r.redis.Prefix, "acme").U
		if err := r.redis.Client.HSet(ctx, u, field("alice"), 35+40, field("bob"), 50, field("carol"), 15).Err(); err != nil {
			t.Fatal(err)
		}
		r.call("GET", "/orgs/acme/limits", "", 200, &ls)
		if *ls.Data[0].EndUsers != 3 || ls.Data[0].Used != 75 || ls.Data[0].Held != 40 {
			t.Fatalf("warm: the limit of each end user %+v, want 3 end users, the most used 75 (40 held)", ls.Data[0])
		}
		r.call("GET", "/orgs/acme/limits/"+each.ID+"/end_users?limit=2", "", 200, &page)
		if want := []endUserRow{{"alice", 75, 40}, {"bob", 50, 0}}; !slices.Equal(page.Data, want) || page.Next == nil {
			t.Fatalf("warm: first page %+v next %v, want %+v and a next page", page.Data, page.Next, want)
		}
		r.call("GET", "/orgs/acme/limits/"+each.ID+"/end_users?limit=2&cursor="+*page.Next, "", 200, &page)
		if want := []endUserRow{{"carol", 15, 15}}; !slices.Equal(page.Data, want) || page.Next != nil {
			t.Fatalf("warm: second page %+v next %v, want %+v and no next", page.Data, page.Next, want)
		}
		if b := r.call("GET", "/orgs/acme/limits/"+each.ID+"/end_users?format=csv", "", 200, nil); b != "end_user,used,held\nalice,75,40\nbob,50,0\ncarol,15,15\n" {
			t.Fatalf("end users as CSV: %q", b)
		}
		r.refused("GET", "/orgs/acme/limits/"+alice.ID+"/end_users", "", 400, "invalid_value")
		r.refused("GET", "/orgs/acme/limits/999999/end_users", "", 404, "limit_not_found")
		r.refused("GET", "/orgs/nobody/limits/"+each.ID+"/end_users", "", 404, "org_not_found")
		r.refused("GET", "/orgs/acme/limits/"+each.ID+"/end_users?cursor=bogus", "", 400, "invalid_cursor")

		// Usage by end user adds up to the charges.
		rec := r.call("GET", "/orgs/acme/usage?group_by=end_user&format=csv", "", 200, nil)
		rows, err := csv.NewReader(strings.NewReader(rec)).ReadAll()
		want := [][]string{{"end_user", "requests", "cost"}, {"", "1", "70"}, {"alice", "2", "35"}, {"bob", "1", "50"}}
		if err != nil || len(rows) != len(want) {
			t.Fatalf("usage by end user: %v %v", rows, err)
		}
		for i, w := range want {
			if rows[i][0] != w[0] || rows[i][1] != w[1] || rows[i][2] != w[2] {
				t.Fatalf("usage by end user row %d: %v, want %v…", i, rows[i], w)
			}
		}
	})
}

// TestLimitRequireEndUserRoute: a limit of each end user apart may require an end user; the
// flag comes back in the answer and the list (absent when false).
func TestLimitRequireEndUserRoute(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, r *limitsRig) {
		r.call("POST", "/orgs", `{"id":"acme"}`, 201, nil)
		if b := r.call("POST", "/orgs/acme/limits", `{"scope":"end_user","window":"day","cap":100,"require_end_user":true}`, 201, nil); !strings.Contains(b, `"require_end_user":true`) {
			t.Fatalf("created: %s", b)
		}
		if b := r.call("POST", "/orgs/acme/limits", `{"scope":"org","window":"day","cap":100}`, 201, nil); strings.Contains(b, "require_end_user") {
			t.Fatalf("created: %s", b)
		}
		if b := r.call("GET", "/orgs/acme/limits", "", 200, nil); strings.Count(b, `"require_end_user":true`) != 1 {
			t.Fatalf("list: %s", b)
		}
	})
}
