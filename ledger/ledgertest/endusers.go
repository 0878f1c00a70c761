package ledgertest

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// endUserTests cover end users (DESIGN.md "Limits", third wave): the end user is attribution
// like the key and the project, kept on the usage event and its charge entry, and counted by the
// limits of scope end_user — without an id each end user apart (one window per end user), with
// an id that end user only; a charge with no end user counts against no end-user limit.
var endUserTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"EndUserAttribution", testEndUserAttribution},
	{"EndUserLimits", testEndUserLimits},
	{"EndUserSnapshotSince", testEndUserSnapshotSince},
	{"EndUserLimitCrossed", testEndUserLimitCrossed},
	{"EndUserUsageReport", testEndUserUsageReport},
}

// chargeOf records and accounts one event of end user eu, reserved at at, with key k.
func chargeOf(t *testing.T, l ledger.Ledger, k, eu string, cost int64, at time.Time) ledger.UsageEvent {
	t.Helper()
	ev := event("o", cost, 0)
	ev.KeyID, ev.EndUser, ev.ReservedAt = k, eu, at
	noErr(t, l.RecordUsage(ctx(t), []ledger.UsageEvent{ev}))
	for must(l.AccountPending(ctx(t), 100)) > 0 {
	}
	return ev
}

// testEndUserAttribution: a charge entry carries its event's end user (EntriesAfter and the
// unsettled reads), the request keeps it; an end user no limit could name is left out of the
// entry, as a key id is.
func testEndUserAttribution(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	at := time.Date(2026, 4, 1, 10, 0, 0, 0, time.UTC)
	alice := chargeOf(t, l, "key_a", "alice", 7, at)
	none := chargeOf(t, l, "key_a", "", 3, at)
	odd := chargeOf(t, l, "key_a", "a:b", 2, at)
	want := []balance.Entry{
		{Seq: 1, Delta: -7, HoldID: alice.ID, KeyID: "key_a", EndUser: "alice", ReservedAt: at},
		{Seq: 2, Delta: -3, HoldID: none.ID, KeyID: "key_a", ReservedAt: at},
		{Seq: 3, Delta: -2, HoldID: odd.ID, KeyID: "key_a", ReservedAt: at},
	}
	es := entries(t, l, "o")
	for i := range es {
		es[i].Recorded = time.Time{}
	}
	if !slices.EqualFunc(es, want, entryEqual) {
		t.Fatalf("EntriesAfter = %+v,\nwant %+v", es, want)
	}
	un, _ := must2(l.UnsettledEntries(c, "o", 10))
	for i := range un {
		un[i].Recorded = time.Time{}
	}
	if !slices.EqualFunc(un, want, entryEqual) {
		t.Fatalf("UnsettledEntries = %+v,\nwant %+v", un, want)
	}
	of, _ := must2(l.UnsettledEntriesOf(c, []string{"o"}, 10))
	for i := range of["o"] {
		of["o"][i].Recorded = time.Time{}
	}
	if !slices.EqualFunc(of["o"], want, entryEqual) {
		t.Fatalf("UnsettledEntriesOf = %+v,\nwant %+v", of["o"], want)
	}
	if r := must(l.Request(c, alice.ID)); r.EndUser != "alice" {
		t.Fatalf("request %+v: end user not kept", r)
	}
	if r := must(l.Request(c, odd.ID)); r.EndUser != "a:b" {
		t.Fatalf("request %+v: the recorded end user is kept as it was", r)
	}
	// The console's entries show each charge's request with its end user, as recorded.
	page := must(l.ListEntries(c, "o", ledger.EntryQuery{}))
	got := map[string]string{}
	for _, e := range page.Data {
		if e.Request == nil {
			t.Fatalf("entry %+v: a charge without its request", e)
		}
		got[e.Request.ID] = e.Request.EndUser
	}
	if wantUsers := map[string]string{alice.ID: "alice", none.ID: "", odd.ID: "a:b"}; !maps.Equal(got, wantUsers) {
		t.Fatalf("ListEntries' requests' end users = %v, want %v", got, wantUsers)
	}
}

// testEndUserLimits: limits of scope end_user are created without an id (each end user apart)
// and with one (that end user: it names no ledger row, so any valid id will do), listed back,
// and refused for an id no limit field can hold.
func testEndUserLimits(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	each := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Day, balance.Money, 500)
	one := mustUnitLimit(t, l, scope(balance.ScopeEndUser, "alice"), balance.Minute, balance.Requests, 10)
	if each.Scope != scope(balance.ScopeEndUser, "") || one.Scope != scope(balance.ScopeEndUser, "alice") || one.Unit != balance.Requests {
		t.Fatalf("created %+v and %+v", each, one)
	}
	if got := limitsOf(t, l, "o").Limits; !slices.Equal(got, []balance.Limit{each, one}) {
		t.Fatalf("Limits = %+v, want %+v", got, []balance.Limit{each, one})
	}
	for _, id := range []string{"a:b", "a b", "{x}", "a,b", string(make([]byte, 129))} {
		_, _, err := l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeEndUser, id), Window: balance.Day, Unit: balance.Money, Cap: 1})
		wantErr(t, err, ledger.ErrInvalidLimit, fmt.Sprintf("end user %q", id))
	}
	patched, _ := must2(l.SetLimitCap(c, "o", each.ID, 50))
	if patched.Scope != each.Scope || patched.Cap != 50 {
		t.Fatalf("SetLimitCap = %+v", patched)
	}
	// Only a limit of each end user apart may require an end user; the flag is kept.
	req, _ := must2(l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeEndUser, ""), Window: balance.Hour, Cap: 9, RequireEndUser: true}))
	if !req.RequireEndUser || !slices.Contains(limitsOf(t, l, "o").Limits, req) {
		t.Fatalf("created %+v; limits %+v", req, limitsOf(t, l, "o").Limits)
	}
	for _, s := range []balance.Scope{scope(balance.ScopeEndUser, "alice"), scope(balance.ScopeOrg, ""), scope(balance.ScopeKey, "k")} {
		_, _, err := l.CreateLimit(c, "o", balance.Limit{Scope: s, Window: balance.Day, Cap: 1, RequireEndUser: true})
		wantErr(t, err, ledger.ErrInvalidLimit, fmt.Sprintf("require_end_user on %v", s))
	}
}

// testEndUserSnapshotSince: a limit of each end user apart has, per window, one WindowUsed per
// end user with spend (EndUser set), in its unit; a limit of one end user counts that one's
// (EndUser ""); charges with no end user, or one no limit can name, count against neither, but
// against the org's limits as before.
func testEndUserSnapshotSince(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay-eu"))
	each := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Day, balance.Money, 500)
	eachRPM := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Minute, balance.Requests, 10)
	alice := mustUnitLimit(t, l, scope(balance.ScopeEndUser, "alice"), balance.Day, balance.Tokens, 10_000)
	org := mustUnitLimit(t, l, orgScope, balance.Day, balance.Money, 10_000)

	since := time.Date(2026, 5, 5, 10, 30, 20, 0, time.UTC)
	minute, day := since.Truncate(time.Minute), since.Truncate(24*time.Hour)
	chargeOf(t, l, "k", "alice", 5, minute.Add(time.Second))
	chargeOf(t, l, "k", "alice", 7, minute.Add(-time.Hour))
	chargeOf(t, l, "k", "bob", 11, minute.Add(2*time.Second))
	chargeOf(t, l, "k", "bob", 13, minute.Add(time.Minute)) // the next minute
	chargeOf(t, l, "k", "", 17, minute)                     // no end user: the org's only
	chargeOf(t, l, "k", "a:b", 19, minute)                  // an end user no limit can name: the org's only
	chargeOf(t, l, "k", "alice", 23, day.Add(-time.Hour))   // the day before: not from since's on
	perCharge := event("o", 0, 0).Usage.Tokens()
	ms := func(t time.Time) int64 { return t.UnixMilli() }
	want := []balance.WindowUsed{
		{LimitID: each.ID, Start: ms(day), EndUser: "alice", Used: 5 + 7},
		{LimitID: each.ID, Start: ms(day), EndUser: "bob", Used: 11 + 13},
		{LimitID: eachRPM.ID, Start: ms(minute), EndUser: "alice", Used: 1},
		{LimitID: eachRPM.ID, Start: ms(minute), EndUser: "bob", Used: 1},
		{LimitID: eachRPM.ID, Start: ms(minute.Add(time.Minute)), EndUser: "bob", Used: 1},
		{LimitID: alice.ID, Start: ms(day), Used: 2 * perCharge},
		{LimitID: org.ID, Start: ms(day), Used: 5 + 7 + 11 + 13 + 17 + 19},
	}
	if got := must(l.SnapshotSince(c, "o", since)).Limits.Used; !slices.Equal(got, want) {
		t.Fatalf("Used = %+v,\nwant %+v", got, want)
	}
	if got := must(l.LimitUsage(c, "o", since, -1)); !slices.Equal(got, want) {
		t.Fatalf("LimitUsage = %+v,\nwant %+v", got, want)
	}
	// Up to seq 2 (alice's first two charges): bob has no window yet.
	want2 := []balance.WindowUsed{
		{LimitID: each.ID, Start: ms(day), EndUser: "alice", Used: 5 + 7},
		{LimitID: eachRPM.ID, Start: ms(minute), EndUser: "alice", Used: 1},
		{LimitID: alice.ID, Start: ms(day), Used: 2 * perCharge},
		{LimitID: org.ID, Start: ms(day), Used: 5 + 7},
	}
	if got := must(l.LimitUsage(c, "o", since, 3)); !slices.Equal(got, want2) { // seq 1 is the credit
		t.Fatalf("LimitUsage up to seq 3 = %+v,\nwant %+v", got, want2)
	}
}

// crossedBy is the brief of a limit.crossed event of a limit of each end user apart, which names
// the end user who crossed.
func crossedBy(l balance.Limit, endUser string, start time.Time, used int64, pct int) string {
	return fmt.Sprintf("limit.crossed o cap=%d end_user=%s limit_id=%s scope=%s scope_id= threshold=%d used=%d window=%s window_start=%s",
		l.Cap, endUser, l.ID, l.Scope.Kind, pct, used, l.Window, start.UTC().Format(time.RFC3339))
}

// testEndUserLimitCrossed: a limit of each end user apart crosses per end user (each one's
// window is its own, and the event names the end user); a limit of one end user crosses like a
// key's; a charge with no end user moves neither; an end user first seen mid-window starts from
// its charges already in the ledger (a limit created mid-window).
func testEndUserLimitCrossed(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay"))
	w, _, err := h.CreateWebhook(c, "https://example.com/limits", []ledger.EventType{ledger.EventLimitCrossed})
	noErr(t, err)
	d := laterDay()
	of := func(eu string, cost int64, at time.Time) ledger.UsageEvent {
		ev := usage("k", "", cost, at)
		ev.EndUser = eu
		return ev
	}
	batch(t, l, of("carol", 90, d)) // before any limit: counted when carol's window starts
	each := mustUnitLimit(t, l, scope(balance.ScopeEndUser, ""), balance.Day, balance.Money, 100)
	bob := mustUnitLimit(t, l, scope(balance.ScopeEndUser, "bob"), balance.Day, balance.Money, 1_000)

	batch(t, l, of("alice", 60, d.Add(time.Hour)), of("bob", 70, d.Add(time.Hour))) // alice 60, bob 70
	batch(t, l, of("alice", 20, d.Add(2*time.Hour)), of("bob", 30, d.Add(2*time.Hour)),
		of("", 500, d.Add(2*time.Hour))) // alice 80: 80 %; bob 100: 80 % and 100 % (of each); no end user: nothing
	batch(t, l, of("carol", 10, d.Add(3*time.Hour)))                    // carol 90 → 100: 100 % only
	batch(t, l, of("bob", 700, d.Add(4*time.Hour)))                     // bob 800: 80 % of his own limit
	batch(t, l, of("alice", 30, d.AddDate(0, 0, 1)), of("dave", 1, d))  // alice's next day: 30; dave 1
	batch(t, l, of("alice", 50, d.AddDate(0, 0, 1).Add(time.Hour)))     // alice's next day: 80 %
	batch(t, l, of("alice", 20, d.Add(5*time.Hour)), of("a:b", 500, d)) // alice's first day 100; a:b: no limit can name it

	next := d.AddDate(0, 0, 1)
	wantEvents(t, "limit.crossed events", limitEvents(t, h)[w.ID], []string{
		crossedBy(each, "alice", d, 80, 80),
		crossedBy(each, "bob", d, 100, 80),
		crossedBy(each, "bob", d, 100, 100),
		crossedBy(each, "carol", d, 100, 100),
		crossed(bob, d, 800, 80),
		crossedBy(each, "alice", next, 80, 80),
		crossedBy(each, "alice", d, 100, 100),
	})
}

// testEndUserUsageReport: group_by end_user sums the accounted usage per end user ("" for none)
// and adds up to the ledger's charges.
func testEndUserUsageReport(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	at := time.Date(2026, 4, 1, 10, 0, 0, 0, time.UTC)
	for i, eu := range []string{"alice", "bob", "alice", "", "bob", "alice"} {
		chargeOf(t, l, "k", eu, int64(100*(i+1)), at.Add(time.Duration(i)*time.Hour))
	}
	pending := event("o", 9_999, 0)
	pending.EndUser = "alice"
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{pending})) // not accounted: not counted
	u := event("o", 0, 0).Usage
	row := func(g string, costs ...int64) ledger.UsageRow {
		r := ledger.UsageRow{Group: g}
		for _, cost := range costs {
			r.Add(cost, u)
		}
		return r
	}
	got := must(l.UsageReport(c, "o", ledger.UsageQuery{GroupBy: ledger.GroupByEndUser}))
	want := []ledger.UsageRow{row("", 400), row("alice", 100, 300, 600), row("bob", 200, 500)}
	if !slices.EqualFunc(got, want, ledger.UsageRow.Equal) {
		t.Fatalf("usage by end user:\n got %+v\nwant %+v", got, want)
	}
	var charges, sum int64
	for _, e := range entries(t, l, "o") {
		charges -= e.Delta
	}
	for _, r := range got {
		sum += r.Cost
	}
	if sum != charges {
		t.Fatalf("usage by end user adds up to %d, the ledger's charges to %d", sum, charges)
	}
	got = must(l.UsageReport(c, "o", ledger.UsageQuery{GroupBy: ledger.GroupByEndUser, From: at.Add(2 * time.Hour), To: at.Add(5 * time.Hour)}))
	if want := []ledger.UsageRow{row("", 400), row("alice", 300), row("bob", 500)}; !slices.EqualFunc(got, want, ledger.UsageRow.Equal) {
		t.Fatalf("usage by end user from 12:00 to 15:00:\n got %+v\nwant %+v", got, want)
	}
}
