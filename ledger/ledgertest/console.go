package ledgertest

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// consoleTests cover ledger.Console: lists, names, reports, one request, model deletion and
// the audit trail.
var consoleTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"ConsoleOrgs", testConsoleOrgs},
	{"ConsoleKeys", testConsoleKeys},
	{"ConsoleEntries", testConsoleEntries},
	{"ConsoleUsageReport", testConsoleUsage},
	{"ConsoleTopSpenders", testConsoleTopSpenders},
	{"ConsoleRequest", testConsoleRequest},
	{"ConsoleDeleteModel", testConsoleDeleteModel},
	{"ConsoleAudit", testConsoleAudit},
	{"ConsoleSpend", testConsoleSpend},
	{"ConsoleReserveTime", testConsoleReserveTime},
}

// testConsoleReserveTime (issue 26): every view reads a request at its reserve time, as limits
// do — the usage report, the entries' range, the top spenders — so one hour adds up the same in
// each. A request reserved at 03:59:59.999 and recorded at 04:00:01 belongs to 03:00; a
// fail-open one (no reserve time) to its record time. Before: the report read the record time
// and the entries their accounting time.
func testConsoleReserveTime(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	const org = "rt-org"
	noErr(t, l.CreateOrg(c, org))
	must2(l.Credit(c, org, 1_000_000, "pay-"+org))
	h3 := time.Date(2026, 1, 2, 3, 0, 0, 0, time.UTC)
	late := event(org, 700, 0)
	late.ReservedAt, late.CreatedAt = h3.Add(time.Hour-time.Millisecond), h3.Add(time.Hour+time.Second)
	failOpen := event(org, 50, 1)
	failOpen.CreatedAt = h3.Add(30 * time.Minute)
	next := event(org, 9, 2)
	next.ReservedAt, next.CreatedAt = h3.Add(time.Hour), h3.Add(time.Hour+2*time.Second)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{late, failOpen, next}))
	for {
		n, err := l.AccountPending(c, 1000)
		noErr(t, err)
		if n == 0 {
			break
		}
	}
	for _, w := range []struct {
		from          time.Time
		requests, sum int64
	}{{h3, 2, 750}, {h3.Add(time.Hour), 1, 9}} {
		to := w.from.Add(time.Hour)
		rows := must(l.UsageReport(c, org, ledger.UsageQuery{From: w.from, To: to, GroupBy: ledger.GroupByModel}))
		if len(rows) != 1 || rows[0].Requests != w.requests || rows[0].Cost != w.sum {
			t.Fatalf("usage report of %s: %+v, want %d requests costing %d", w.from, rows, w.requests, w.sum)
		}
		es := must(l.ListEntries(c, org, ledger.EntryQuery{Kind: ledger.KindCharge, From: w.from, To: to}))
		var sum int64
		for _, e := range es.Data {
			sum -= e.Delta
		}
		if int64(len(es.Data)) != w.requests || sum != w.sum {
			t.Fatalf("charges of %s: %+v, want %d costing %d", w.from, es.Data, w.requests, w.sum)
		}
		top := must(l.TopSpenders(c, ledger.TopQuery{From: w.from, To: to}))
		if len(top) != 1 || top[0].Group != org || top[0].Requests != w.requests || top[0].Cost != w.sum {
			t.Fatalf("top spenders of %s: %+v", w.from, top)
		}
	}
	days := must(l.UsageReport(c, org, ledger.UsageQuery{GroupBy: ledger.GroupByDay}))
	if len(days) != 1 || days[0].Group != "2026-01-02" || days[0].Requests != 3 {
		t.Fatalf("by day: %+v", days)
	}
}

// pages follows a list's cursors to its end and returns every row.
func pages[T any](t *testing.T, list func(cursor string) (ledger.Page[T], error)) (all []T, n int) {
	t.Helper()
	cursor := ""
	for {
		p, err := list(cursor)
		noErr(t, err)
		all = append(all, p.Data...)
		n++
		if p.Next == "" {
			return all, n
		}
		if n > 1000 {
			t.Fatal("list never ends")
		}
		cursor = p.Next
	}
}

func testConsoleOrgs(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	ids := []string{"o-c", "o-a", "o-e", "o-b", "o-d"}
	for _, id := range ids {
		noErr(t, l.CreateOrg(c, id))
	}
	noErr(t, l.SetOrgName(c, "o-b", "Bee Ltd"))
	must2(l.Credit(c, "o-b", 700, "pay-o-b"))
	got, n := pages(t, func(cur string) (ledger.Page[ledger.OrgInfo], error) {
		return l.ListOrgs(c, ledger.ListQuery{Cursor: cur, Limit: 2})
	})
	var gotIDs []string
	for _, o := range got {
		gotIDs = append(gotIDs, o.ID)
	}
	if want := []string{"o-a", "o-b", "o-c", "o-d", "o-e"}; !slices.Equal(gotIDs, want) || n != 3 {
		t.Fatalf("orgs in pages of 2: %v in %d pages, want %v in 3", gotIDs, n, want)
	}
	if b := got[1]; b.Name != "Bee Ltd" || b.Balance != 700 || b.LedgerSeq != 1 || b.CreatedAt.IsZero() {
		t.Fatalf("org o-b: %+v", b)
	}
	// A page exactly as long as what is left is the last one.
	if p := must(l.ListOrgs(c, ledger.ListQuery{Limit: 5})); len(p.Data) != 5 || p.Next != "" {
		t.Fatalf("page of 5 of 5: %d rows, next %q", len(p.Data), p.Next)
	}
	o := must(l.Org(c, "o-b"))
	if o.Name != "Bee Ltd" || o.Balance != 700 {
		t.Fatalf("Org(o-b) = %+v", o)
	}
	_, err := l.Org(c, "nobody")
	wantErr(t, err, ledger.ErrUnknownOrg, "Org of an unknown org")
	wantErr(t, l.SetOrgName(c, "nobody", "x"), ledger.ErrUnknownOrg, "SetOrgName of an unknown org")
	wantErr(t, l.SetOrgName(c, "o-a", strings.Repeat("x", ledger.MaxNameLen+1)), ledger.ErrInvalidQuery, "a name too long")
	wantErr(t, l.SetOrgName(c, "o-a", "tab\there"), ledger.ErrInvalidQuery, "a name with a control character")
	_, err = l.ListOrgs(c, ledger.ListQuery{Cursor: "not a cursor!"})
	wantErr(t, err, ledger.ErrInvalidCursor, "a malformed cursor")
	// A cursor of another list is refused, not misread.
	for i := range 2 {
		must(l.RecordAudit(c, ledger.AuditRecord{Actor: "t", Action: fmt.Sprint("a", i), Status: 200}))
	}
	other := must(l.AuditLog(c, ledger.ListQuery{Limit: 1})).Next
	if other == "" {
		t.Fatal("audit log of 2 in pages of 1 has no next page")
	}
	_, err = l.ListOrgs(c, ledger.ListQuery{Cursor: other})
	wantErr(t, err, ledger.ErrInvalidCursor, "another list's cursor")
}

func testConsoleKeys(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "k-org"))
	noErr(t, l.CreateOrg(c, "k-other"))
	var made []string
	for range 3 {
		k, _ := must2(l.CreateKey(c, "k-org"))
		made = append(made, k.ID)
		time.Sleep(2 * time.Millisecond) // distinct creation times: the list is in creation order
	}
	must2(l.CreateKey(c, "k-other"))
	noErr(t, l.SetKeyName(c, made[1], "prod"))
	noErr(t, l.RevokeKey(c, made[2]))
	got, n := pages(t, func(cur string) (ledger.Page[ledger.KeyInfo], error) {
		return l.ListKeys(c, "k-org", ledger.ListQuery{Cursor: cur, Limit: 2})
	})
	if len(got) != 3 || n != 2 {
		t.Fatalf("keys of k-org in pages of 2: %+v in %d pages", got, n)
	}
	for i, k := range got {
		if k.ID != made[i] || k.Org != "k-org" || k.CreatedAt.IsZero() {
			t.Fatalf("key %d: %+v, want id %s", i, k, made[i])
		}
		if (k.RevokedAt != nil) != (i == 2) {
			t.Fatalf("key %d revoked at %v", i, k.RevokedAt)
		}
	}
	if got[1].Name != "prod" || got[0].Name != "" {
		t.Fatalf("names: %q %q", got[0].Name, got[1].Name)
	}
	_, err := l.ListKeys(c, "nobody", ledger.ListQuery{})
	wantErr(t, err, ledger.ErrUnknownOrg, "keys of an unknown org")
	wantErr(t, l.SetKeyName(c, "key_nope", "x"), ledger.ErrUnknownKey, "naming an unknown key")
	if p := must(l.ListKeys(c, "k-other", ledger.ListQuery{})); len(p.Data) != 1 || p.Next != "" {
		t.Fatalf("keys of k-other: %+v", p)
	}
	// Last use: the reserve time of the key's latest accounted request (a pending one does not
	// count yet); the project it is in.
	if got[0].LastUsedAt != nil || got[0].Project != "" {
		t.Fatalf("unused key: %+v", got[0])
	}
	must2(l.Credit(c, "k-org", 1000, "pay-k-org"))
	_, err = l.CreateProject(c, "k-org", "staging")
	noErr(t, err)
	_, err = l.SetKeyProject(c, made[0], "staging")
	noErr(t, err)
	at := t0.Add(5 * time.Hour)
	for i, when := range []time.Time{at.Add(-time.Minute), at, at.Add(-time.Hour)} {
		ev := event("k-org", 1, 200+i)
		ev.KeyID, ev.ReservedAt = made[0], when
		noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	}
	for {
		n, err := l.AccountPending(c, 1000)
		noErr(t, err)
		if n == 0 {
			break
		}
	}
	late := event("k-org", 1, 300)
	late.KeyID, late.ReservedAt = made[0], at.Add(time.Hour) // recorded, not accounted
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{late}))
	k0 := must(l.ListKeys(c, "k-org", ledger.ListQuery{Limit: 1})).Data[0]
	if k0.LastUsedAt == nil || !k0.LastUsedAt.Equal(at) || k0.Project != "staging" {
		t.Fatalf("used key: %+v, want last used at %v in staging", k0, at)
	}
}

func must2[A, B any](a A, b B, err error) (A, B) {
	if err != nil {
		panic(failure{err})
	}
	return a, b
}

// usageFixture: an org with a credit, an adjustment and six accounted requests over two days,
// two models and two keys, plus one request still pending.
func usageFixture(t *testing.T, l ledger.Ledger, org string) (evs []ledger.UsageEvent, pending ledger.UsageEvent) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, org))
	must2(l.Credit(c, org, 1_000_000, "pay-"+org))
	must2(l.Adjust(c, org, -5, "fix-"+org))
	day2 := t0.Add(24 * time.Hour)
	for i, spec := range []struct {
		at         time.Time
		model, key string
		cost       int64
	}{
		{t0, "m-a", "key_1", 100}, {t0, "m-b", "key_1", 200}, {t0, "m-a", "key_2", 300},
		{day2, "m-a", "key_1", 400}, {day2, "m-b", "", 500}, {day2.Add(time.Hour), "m-b", "key_2", 600},
	} {
		ev := event(org, spec.cost, i)
		ev.CreatedAt, ev.Model, ev.KeyID = spec.at.Add(time.Duration(i)*time.Millisecond), spec.model, spec.key
		ev.Usage = pricing.Usage{Prompt: int64(10 * (i + 1)), Completion: int64(i + 1), Reasoning: 1, Units: pricing.Units{pricing.CachedInput: int64(i)}}
		ev.Estimated = i == 5
		evs = append(evs, ev)
	}
	noErr(t, l.RecordUsage(c, evs))
	for {
		n, err := l.AccountPending(c, 1000)
		noErr(t, err)
		if n == 0 {
			break
		}
	}
	pending = event(org, 9999, 99)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{pending}))
	return evs, pending
}

func testConsoleEntries(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	evs, _ := usageFixture(t, l, "e-org")
	got, n := pages(t, func(cur string) (ledger.Page[ledger.EntryInfo], error) {
		return l.ListEntries(c, "e-org", ledger.EntryQuery{ListQuery: ledger.ListQuery{Cursor: cur, Limit: 3}})
	})
	if len(got) != 8 || n != 3 {
		t.Fatalf("entries in pages of 3: %d in %d pages, want 8 in 3", len(got), n)
	}
	byID := map[string]ledger.UsageEvent{}
	for _, ev := range evs {
		byID[ev.ID] = ev
	}
	var sum int64
	for i, e := range got {
		if want := int64(8 - i); e.Seq != want {
			t.Fatalf("entry %d has seq %d, want %d (newest first)", i, e.Seq, want)
		}
		sum += e.Delta
		switch e.Kind {
		case ledger.KindCharge:
			ev, ok := byID[e.HoldID]
			r := e.Request
			if !ok || r == nil || r.ID != ev.ID || r.Model != ev.Model || r.KeyID != ev.KeyID || !r.Usage.Equal(ev.Usage) ||
				r.Cost != ev.Cost || r.Cost != -e.Delta || r.HoldAmount != ev.HoldAmount || r.Estimated != ev.Estimated {
				t.Fatalf("charge %d: %+v with request %+v, want event %+v", e.Seq, e, r, ev)
			}
		case ledger.KindCredit, ledger.KindAdjust:
			if e.Request != nil || e.Ref == "" {
				t.Fatalf("%s entry %d: %+v", e.Kind, e.Seq, e)
			}
		}
	}
	if a := account(t, l, "e-org"); sum != a.Balance {
		t.Fatalf("entries sum to %d, account balance %d", sum, a.Balance)
	}
	credits := must(l.ListEntries(c, "e-org", ledger.EntryQuery{Kind: ledger.KindCredit}))
	if len(credits.Data) != 1 || credits.Data[0].Delta != 1_000_000 || credits.Next != "" {
		t.Fatalf("credits: %+v", credits)
	}
	_, err := l.ListEntries(c, "e-org", ledger.EntryQuery{Kind: "refund"})
	wantErr(t, err, ledger.ErrInvalidQuery, "an unknown kind")
	_, err = l.ListEntries(c, "nobody", ledger.EntryQuery{})
	wantErr(t, err, ledger.ErrUnknownOrg, "entries of an unknown org")
	// A time range after every entry is empty; one that covers them all is whole (the charges
	// are read at their requests' times, from t0; the credit and the adjust at their creation).
	future := must(l.ListEntries(c, "e-org", ledger.EntryQuery{From: time.Now().Add(time.Hour)}))
	all := must(l.ListEntries(c, "e-org", ledger.EntryQuery{From: t0.Add(-time.Hour), To: time.Now().Add(time.Hour)}))
	if len(future.Data) != 0 || len(all.Data) != 8 {
		t.Fatalf("time filters: %d entries in the future, %d in the last hour", len(future.Data), len(all.Data))
	}
}

func testConsoleUsage(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	usageFixture(t, l, "u-org")
	var charges int64
	for _, e := range entries(t, l, "u-org") {
		if e.HoldID != "" {
			charges -= e.Delta
		}
	}
	check := func(by string, q ledger.UsageQuery, want []ledger.UsageRow) {
		t.Helper()
		q.GroupBy = by
		got := must(l.UsageReport(c, "u-org", q))
		if !slices.EqualFunc(got, want, ledger.UsageRow.Equal) {
			t.Fatalf("usage by %s %v..%v:\n got %+v\nwant %+v", by, q.From, q.To, got, want)
		}
	}
	// Prompt 10(i+1), cached i, completion i+1, reasoning 1 for request i (costs 100 … 600).
	row := func(g string, is ...int) ledger.UsageRow {
		r := ledger.UsageRow{Group: g}
		for _, i := range is {
			r.Add(int64(100*(i+1)), pricing.Usage{Prompt: int64(10 * (i + 1)), Completion: int64(i + 1), Reasoning: 1, Units: pricing.Units{pricing.CachedInput: int64(i)}})
		}
		return r
	}
	check("day", ledger.UsageQuery{}, []ledger.UsageRow{row("2026-01-02", 0, 1, 2), row("2026-01-03", 3, 4, 5)})
	check("model", ledger.UsageQuery{}, []ledger.UsageRow{row("m-a", 0, 2, 3), row("m-b", 1, 4, 5)})
	check("key", ledger.UsageQuery{}, []ledger.UsageRow{row("", 4), row("key_1", 0, 1, 3), row("key_2", 2, 5)})
	if total := row("", 0, 1, 2, 3, 4, 5).Cost; total != charges {
		t.Fatalf("usage adds up to %d, the ledger's charges to %d", total, charges)
	}
	day2 := t0.Add(24 * time.Hour)
	check("model", ledger.UsageQuery{From: day2}, []ledger.UsageRow{row("m-a", 3), row("m-b", 4, 5)})
	check("key", ledger.UsageQuery{To: day2}, []ledger.UsageRow{row("key_1", 0, 1), row("key_2", 2)})
	check("day", ledger.UsageQuery{From: day2.Add(48 * time.Hour)}, []ledger.UsageRow{})
	_, err := l.UsageReport(c, "u-org", ledger.UsageQuery{GroupBy: "week"})
	wantErr(t, err, ledger.ErrInvalidQuery, "an unknown grouping")
	_, err = l.UsageReport(c, "u-org", ledger.UsageQuery{GroupBy: "day", From: day2, To: t0})
	wantErr(t, err, ledger.ErrInvalidQuery, "to before from")
	_, err = l.UsageReport(c, "nobody", ledger.UsageQuery{GroupBy: "day"})
	wantErr(t, err, ledger.ErrUnknownOrg, "usage of an unknown org")
}

func testConsoleTopSpenders(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	// Two orgs with the same spend (7 each, at t0): a tie goes by org id.
	var small []ledger.UsageEvent
	for i, org := range []string{"t-tie-b", "t-tie-a"} {
		noErr(t, l.CreateOrg(c, org))
		must2(l.Credit(c, org, 1000, "pay-"+org))
		ev := event(org, 7, 100+i)
		ev.CreatedAt = t0
		small = append(small, ev)
	}
	noErr(t, l.RecordUsage(c, small))
	usageFixture(t, l, "t-a") // six requests of 2,100 in all, and a pending 9,999 that t-b's fixture accounts
	usageFixture(t, l, "t-b") // six requests of 2,100; its pending 9,999 is never accounted, never counted
	noErr(t, l.CreateOrg(c, "t-idle"))
	check := func(q ledger.TopQuery, want ...string) {
		t.Helper()
		got := must(l.TopSpenders(c, q))
		var ids []string
		for _, r := range got {
			ids = append(ids, fmt.Sprintf("%s:%d/%d", r.Group, r.Cost, r.Requests))
		}
		if strings.Join(ids, " ") != strings.Join(want, " ") {
			t.Fatalf("top spenders %+v: %v, want %v", q, ids, want)
		}
	}
	check(ledger.TopQuery{}, "t-a:12099/7", "t-b:2100/6", "t-tie-a:7/1", "t-tie-b:7/1")
	check(ledger.TopQuery{Limit: 3}, "t-a:12099/7", "t-b:2100/6", "t-tie-a:7/1")
	day2 := t0.Add(24 * time.Hour)
	check(ledger.TopQuery{To: day2}, "t-a:10599/4", "t-b:600/3", "t-tie-a:7/1", "t-tie-b:7/1") // the 9,999 was recorded at t0
	check(ledger.TopQuery{From: day2, To: day2.Add(24 * time.Hour)}, "t-a:1500/3", "t-b:1500/3")
	check(ledger.TopQuery{From: time.Now().Add(time.Hour)})
	// A row is the org's usage report summed.
	var sum ledger.UsageRow
	for _, r := range must(l.UsageReport(c, "t-b", ledger.UsageQuery{GroupBy: "model"})) {
		sum.Requests += r.Requests
		sum.Cost += r.Cost
		sum.Prompt += r.Prompt
		sum.Completion += r.Completion
	}
	top := must(l.TopSpenders(c, ledger.TopQuery{Limit: ledger.MaxPageSize}))
	if top[1].Group != "t-b" || top[1].Requests != sum.Requests || top[1].Cost != sum.Cost || top[1].Prompt != sum.Prompt || top[1].Completion != sum.Completion {
		t.Fatalf("t-b in the top list %+v disagrees with its usage report %+v", top[1], sum)
	}
	for _, bad := range []ledger.TopQuery{{Limit: -1}, {Limit: ledger.MaxPageSize + 1}, {From: day2, To: t0}} {
		_, err := l.TopSpenders(c, bad)
		wantErr(t, err, ledger.ErrInvalidQuery, fmt.Sprintf("query %+v", bad))
	}
}

func testConsoleRequest(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	evs, pending := usageFixture(t, l, "r-org")
	r := must(l.Request(c, evs[2].ID))
	if r.Status != ledger.RequestAccounted || r.Seq < 1 || r.Cost != 300 || r.Model != "m-a" || r.KeyID != "key_2" ||
		r.Org != "r-org" || !r.Usage.Equal(evs[2].Usage) || r.HoldAmount != evs[2].HoldAmount || !r.CreatedAt.Equal(evs[2].CreatedAt) {
		t.Fatalf("request %s: %+v, want %+v", evs[2].ID, r, evs[2])
	}
	es := entries(t, l, "r-org")
	if e := es[r.Seq-1]; e.HoldID != r.ID || e.Delta != -r.Cost {
		t.Fatalf("request's entry %d is %+v", r.Seq, e)
	}
	p := must(l.Request(c, strings.ToUpper(pending.ID)))
	if p.Status != ledger.RequestPending || p.Seq != 0 || p.Cost != 9999 {
		t.Fatalf("pending request: %+v", p)
	}
	void := event("r-org", 7, 7)
	noErr(t, l.VoidUsage(c, void))
	if v := must(l.Request(c, void.ID)); v.Status != ledger.RequestVoided || v.Seq != 0 {
		t.Fatalf("voided request: %+v", v)
	}
	_, err := l.Request(c, NewEventID())
	wantErr(t, err, ledger.ErrUnknownRequest, "an unknown request")
	_, err = l.Request(c, "not-a-uuid")
	wantErr(t, err, ledger.ErrUnknownRequest, "a malformed request id")
}

func testConsoleDeleteModel(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	for _, name := range []string{"unused", "gpt-test"} {
		noErr(t, l.PutModel(c, ledger.Model{Name: name, Prices: pricing.Prices{pricing.Input: 1, pricing.Output: 2}, DefaultHold: 10}))
	}
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("d-org", 5, 0)})) // model gpt-test
	noErr(t, l.DeleteModel(c, "unused"))
	_, err := l.Model(c, "unused")
	wantErr(t, err, ledger.ErrUnknownModel, "a deleted model")
	wantErr(t, l.DeleteModel(c, "unused"), ledger.ErrUnknownModel, "deleting twice")
	wantErr(t, l.DeleteModel(c, "gpt-test"), ledger.ErrModelInUse, "deleting a model with usage")
	must(l.Model(c, "gpt-test"))
}

func testConsoleAudit(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	before := time.Now().Add(-time.Minute)
	for i := range 5 {
		r := must(l.RecordAudit(c, ledger.AuditRecord{Actor: "ops", Action: "POST /admin/v1/orgs", Target: fmt.Sprint("org", i), Status: 201, Detail: `{"id":"x"}`}))
		if r.ID == 0 || r.At.Before(before) {
			t.Fatalf("recorded %+v", r)
		}
	}
	got, n := pages(t, func(cur string) (ledger.Page[ledger.AuditRecord], error) {
		return l.AuditLog(c, ledger.ListQuery{Cursor: cur, Limit: 2})
	})
	if len(got) != 5 || n != 3 {
		t.Fatalf("audit in pages of 2: %d in %d pages", len(got), n)
	}
	for i, r := range got {
		if r.Target != fmt.Sprint("org", 4-i) || r.Actor != "ops" || r.Status != 201 || r.Detail != `{"id":"x"}` || (i > 0 && r.ID >= got[i-1].ID) {
			t.Fatalf("audit row %d: %+v (newest first)", i, r)
		}
	}
}

// testConsoleSpend: Spend sums the org's charges (not its pending usage, credits or
// adjustments) and one key's, all time and since each instant's UTC day by reserve time, with the ledger
// balance of the same snapshot (Balance + Charged = every credit and adjustment) and the key's
// name and project; another org's key or an unknown one reads as nothing.
func testConsoleSpend(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "sp"))
	noErr(t, l.CreateOrg(c, "sp-other"))
	k, _ := must2(l.CreateKey(c, "sp"))
	k2, _ := must2(l.CreateKey(c, "sp"))
	other, _ := must2(l.CreateKey(c, "sp-other"))
	noErr(t, l.SetKeyName(c, k.ID, "prod"))
	_, err := l.CreateProject(c, "sp", "staging")
	noErr(t, err)
	_, err = l.SetKeyProject(c, k.ID, "staging")
	noErr(t, err)
	must2(l.Credit(c, "sp", 10_000, "pay-sp"))
	must2(l.Adjust(c, "sp", -500, "adj-sp"))
	// k: 7 the day before t0, 11 at t0, 13 the day after; k2: 17; no key: 19.
	for i, x := range []struct {
		key  string
		at   time.Time
		cost int64
	}{{k.ID, t0.Add(-24 * time.Hour), 7}, {k.ID, t0, 11}, {k.ID, t0.Add(24 * time.Hour), 13}, {k2.ID, t0, 17}, {"", t0, 19}} {
		ev := event("sp", x.cost, 400+i)
		ev.KeyID, ev.ReservedAt = x.key, x.at
		noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	}
	for {
		n, err := l.AccountPending(c, 1000)
		noErr(t, err)
		if n == 0 {
			break
		}
	}
	pending := event("sp", 1000, 500) // recorded, not accounted: not a charge yet
	pending.KeyID = k.ID
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{pending}))
	// Since counts whole UTC days: t0 + 1 min is still t0's day, t0 + 24 h the next.
	s := must(l.Spend(c, "sp", k.ID, []time.Time{t0.Add(time.Minute), t0.Add(24 * time.Hour), t0.Add(-48 * time.Hour)}))
	want := ledger.Spend{Balance: 10_000 - 500 - 67, Charged: 67,
		Key: ledger.KeySpend{ID: k.ID, Name: "prod", Project: "staging", Charged: 31, Since: []int64{24, 13, 31}}}
	if !spendEqual(s, want) {
		t.Fatalf("Spend = %+v, want %+v", s, want)
	}
	if s.Balance+s.Charged != 10_000-500 {
		t.Fatalf("balance + charged = %d, want the credits and adjustments", s.Balance+s.Charged)
	}
	if s := must(l.Spend(c, "sp", k2.ID, nil)); s.Key.Charged != 17 || s.Key.Name != "" || s.Key.Project != "" || len(s.Key.Since) != 0 {
		t.Fatalf("second key: %+v", s)
	}
	for _, id := range []string{other.ID, "key_nope", ""} {
		if s := must(l.Spend(c, "sp", id, []time.Time{t0})); s.Charged != 67 || s.Key.Charged != 0 || s.Key.Name != "" || s.Key.Since[0] != 0 {
			t.Fatalf("key %q: %+v", id, s)
		}
	}
	if s := must(l.Spend(c, "sp-other", other.ID, nil)); s.Charged != 0 || s.Balance != 0 {
		t.Fatalf("other org: %+v", s)
	}
	_, err = l.Spend(c, "nobody", "", nil)
	wantErr(t, err, ledger.ErrUnknownOrg, "spend of an unknown org")
}

func spendEqual(a, b ledger.Spend) bool {
	return a.Balance == b.Balance && a.Charged == b.Charged && a.Key.ID == b.Key.ID && a.Key.Name == b.Key.Name &&
		a.Key.Project == b.Key.Project && a.Key.Charged == b.Key.Charged && slices.Equal(a.Key.Since, b.Key.Since)
}
