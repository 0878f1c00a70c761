package ledgertest

import (
	"slices"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// limitsTests cover ledger.LimitStore and balance.LimitLedger (DESIGN.md "Limits"): limits,
// projects and freezes as ledger rows with a version, and the seed's spend per window.
var limitsTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"LimitsLifecycle", testLimitsLifecycle},
	{"LimitsVersionRaisedByEveryChange", testLimitsVersion},
	{"LimitsUnknownIDsRefused", testLimitsUnknown},
	{"LimitsInvalidRefused", testLimitsInvalid},
	{"LimitsFreezesAndProjects", testLimitsFreezes},
	{"LimitsChargeAttribution", testLimitsAttribution},
	{"LimitsSnapshotSinceWindows", testSnapshotSince},
	{"LimitsSnapshotSinceAccountsPending", testSnapshotSincePending},
	{"LimitsSnapshotSinceUnits", testSnapshotSinceUnits},
	{"LimitsUsageUpToSeq", testLimitUsageSeq},
}

func newKey(t *testing.T, l ledger.Ledger, org string) ledger.APIKey {
	t.Helper()
	k, _, err := l.CreateKey(ctx(t), org)
	noErr(t, err)
	return k
}

func scope(kind balance.ScopeKind, id string) balance.Scope { return balance.Scope{Kind: kind, ID: id} }

var orgScope = balance.Scope{Kind: balance.ScopeOrg}

func limitsOf(t *testing.T, l ledger.Ledger, org string) balance.Limits {
	t.Helper()
	return must(l.Limits(ctx(t), org))
}

func mustLimit(t *testing.T, l ledger.Ledger, org string, s balance.Scope, w balance.Window, cap int64) balance.Limit {
	t.Helper()
	lim, ch, err := l.CreateLimit(ctx(t), org, balance.Limit{Scope: s, Window: w, Unit: balance.Money, Cap: cap})
	noErr(t, err)
	if ch.Org != org || ch.Version < 1 {
		t.Fatalf("CreateLimit change %+v", ch)
	}
	return lim
}

// testLimitsLifecycle: create, list (by id), change a cap, delete; ids are never reused.
func testLimitsLifecycle(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	k := newKey(t, l, "o")
	must(l.CreateProject(c, "o", "staging"))
	a := mustLimit(t, l, "o", orgScope, balance.Month, 2_000)
	b := mustLimit(t, l, "o", scope(balance.ScopeProject, "staging"), balance.Day, 500)
	d := mustLimit(t, l, "o", scope(balance.ScopeKey, k.ID), balance.Lifetime, 50)
	if a.ID == "" || a.ID == b.ID || b.ID == d.ID || a.Cap != 2_000 || b.Window != balance.Day || d.Scope != scope(balance.ScopeKey, k.ID) {
		t.Fatalf("limits %+v %+v %+v", a, b, d)
	}
	if got := limitsOf(t, l, "o").Limits; !slices.Equal(got, []balance.Limit{a, b, d}) {
		t.Fatalf("Limits = %+v, want %+v", got, []balance.Limit{a, b, d})
	}
	b2, _ := must2(l.SetLimitCap(c, "o", b.ID, 400))
	if b2.Cap != 400 || b2.ID != b.ID || b2.Scope != b.Scope || b2.Window != b.Window {
		t.Fatalf("SetLimitCap = %+v", b2)
	}
	must(l.DeleteLimit(c, "o", a.ID))
	e := mustLimit(t, l, "o", orgScope, balance.Month, 2_000) // the same limit again: a new id
	if e.ID == a.ID || e.ID == b.ID || e.ID == d.ID {
		t.Fatalf("a new limit took the id %s of an earlier one", e.ID)
	}
	if got := limitsOf(t, l, "o").Limits; !slices.Equal(got, []balance.Limit{b2, d, e}) {
		t.Fatalf("Limits after a change and a delete = %+v", got)
	}
	_, err := l.DeleteLimit(c, "o", a.ID)
	wantErr(t, err, ledger.ErrUnknownLimit, "deleting a deleted limit")
	_, _, err = l.SetLimitCap(c, "o", a.ID, 1)
	wantErr(t, err, ledger.ErrUnknownLimit, "changing a deleted limit")
	// Another org's limits are its own.
	noErr(t, l.CreateOrg(c, "p"))
	f := mustLimit(t, l, "p", orgScope, balance.Hour, 9)
	if slices.Contains([]string{a.ID, b.ID, d.ID, e.ID}, f.ID) {
		t.Fatalf("org p's limit took id %s of org o", f.ID)
	}
	_, err = l.DeleteLimit(c, "p", b.ID)
	wantErr(t, err, ledger.ErrUnknownLimit, "deleting another org's limit")
	if got := limitsOf(t, l, "p").Limits; !slices.Equal(got, []balance.Limit{f}) {
		t.Fatalf("org p's limits %+v", got)
	}
}

// testLimitsVersion: every change raises the org's version, and only that org's; a refused
// change raises nothing.
func testLimitsVersion(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	noErr(t, l.CreateOrg(c, "other"))
	k := newKey(t, l, "o")
	if v := limitsOf(t, l, "o").Version; v != 0 {
		t.Fatalf("a new org's limits version is %d, want 0", v)
	}
	var lim balance.Limit
	steps := []struct {
		name string
		do   func() (ledger.LimitChange, error)
	}{
		{"create project", func() (ledger.LimitChange, error) { return l.CreateProject(c, "o", "p1") }},
		{"key into project", func() (ledger.LimitChange, error) { return l.SetKeyProject(c, k.ID, "p1") }},
		{"create limit", func() (ledger.LimitChange, error) {
			var ch ledger.LimitChange
			var err error
			lim, ch, err = l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeProject, "p1"), Window: balance.Week, Unit: balance.Money, Cap: 10})
			return ch, err
		}},
		{"change cap", func() (ledger.LimitChange, error) {
			_, ch, err := l.SetLimitCap(c, "o", lim.ID, 5)
			return ch, err
		}},
		{"freeze org", func() (ledger.LimitChange, error) { return l.SetFrozen(c, "o", orgScope, true) }},
		{"freeze project", func() (ledger.LimitChange, error) {
			return l.SetFrozen(c, "o", scope(balance.ScopeProject, "p1"), true)
		}},
		{"freeze key", func() (ledger.LimitChange, error) { return l.SetFrozen(c, "", scope(balance.ScopeKey, k.ID), true) }},
		{"unfreeze key", func() (ledger.LimitChange, error) {
			return l.SetFrozen(c, "o", scope(balance.ScopeKey, k.ID), false)
		}},
		{"unfreeze org", func() (ledger.LimitChange, error) { return l.SetFrozen(c, "o", orgScope, false) }},
		{"delete limit", func() (ledger.LimitChange, error) { return l.DeleteLimit(c, "o", lim.ID) }},
		{"key out of project", func() (ledger.LimitChange, error) { return l.SetKeyProject(c, k.ID, "") }},
	}
	prev := int64(0)
	for _, s := range steps {
		ch := must(s.do())
		got := limitsOf(t, l, "o").Version
		if ch.Org != "o" || ch.Version <= prev || got != ch.Version {
			t.Fatalf("%s: change %+v, Limits version %d, previous %d: want a raised version, read back", s.name, ch, got, prev)
		}
		prev = ch.Version
		// A refused change raises nothing.
		_, err := l.CreateProject(c, "o", "p1")
		wantErr(t, err, ledger.ErrProjectExists, "creating a project twice")
		if v := limitsOf(t, l, "o").Version; v != prev {
			t.Fatalf("%s: a refused change moved the version to %d from %d", s.name, v, prev)
		}
	}
	if v := limitsOf(t, l, "other").Version; v != 0 {
		t.Fatalf("another org's version moved to %d", v)
	}
}

// testLimitsUnknown: unknown orgs, projects, keys and limits are refused with their sentinel.
func testLimitsUnknown(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	noErr(t, l.CreateOrg(c, "p"))
	k := newKey(t, l, "o")
	pk := newKey(t, l, "p")
	must(l.CreateProject(c, "p", "theirs"))
	lim := mustLimit(t, l, "p", orgScope, balance.Day, 10)
	v0 := limitsOf(t, l, "o").Version

	_, err := l.CreateProject(c, "nobody", "x")
	wantErr(t, err, ledger.ErrUnknownOrg, "a project of an unknown org")
	_, _, err = l.CreateLimit(c, "nobody", balance.Limit{Scope: orgScope, Window: balance.Day, Unit: balance.Money, Cap: 1})
	wantErr(t, err, ledger.ErrUnknownOrg, "a limit of an unknown org")
	_, err = l.SetFrozen(c, "nobody", orgScope, true)
	wantErr(t, err, ledger.ErrUnknownOrg, "freezing an unknown org")
	_, err = l.Limits(c, "nobody")
	wantErr(t, err, ledger.ErrUnknownOrg, "the limits of an unknown org")
	_, err = l.LimitUsage(c, "nobody", t0, -1)
	wantErr(t, err, ledger.ErrUnknownOrg, "the limit usage of an unknown org")

	_, _, err = l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeProject, "theirs"), Window: balance.Day, Unit: balance.Money, Cap: 1})
	wantErr(t, err, ledger.ErrUnknownProject, "a limit on another org's project")
	_, err = l.SetKeyProject(c, k.ID, "theirs")
	wantErr(t, err, ledger.ErrUnknownProject, "a key into another org's project")
	_, err = l.SetKeyProject(c, k.ID, "none")
	wantErr(t, err, ledger.ErrUnknownProject, "a key into an unknown project")
	_, err = l.SetFrozen(c, "o", scope(balance.ScopeProject, "none"), true)
	wantErr(t, err, ledger.ErrUnknownProject, "freezing an unknown project")

	_, _, err = l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeKey, pk.ID), Window: balance.Day, Unit: balance.Money, Cap: 1})
	wantErr(t, err, ledger.ErrUnknownKey, "a limit on another org's key")
	_, _, err = l.CreateLimit(c, "o", balance.Limit{Scope: scope(balance.ScopeKey, "key_nope"), Window: balance.Day, Unit: balance.Money, Cap: 1})
	wantErr(t, err, ledger.ErrUnknownKey, "a limit on an unknown key")
	_, err = l.SetKeyProject(c, "key_nope", "")
	wantErr(t, err, ledger.ErrUnknownKey, "the project of an unknown key")
	_, err = l.SetFrozen(c, "", scope(balance.ScopeKey, "key_nope"), true)
	wantErr(t, err, ledger.ErrUnknownKey, "freezing an unknown key")
	_, err = l.SetFrozen(c, "o", scope(balance.ScopeKey, pk.ID), true)
	wantErr(t, err, ledger.ErrUnknownKey, "freezing another org's key under this org")

	for _, id := range []string{lim.ID, "999999", "abc", "", "-1", "01"} {
		_, _, err = l.SetLimitCap(c, "o", id, 5)
		wantErr(t, err, ledger.ErrUnknownLimit, "changing limit "+id+" of another org or none")
		_, err = l.DeleteLimit(c, "o", id)
		wantErr(t, err, ledger.ErrUnknownLimit, "deleting limit "+id+" of another org or none")
	}
	if v := limitsOf(t, l, "o").Version; v != v0 {
		t.Fatalf("refused changes moved the version from %d to %d", v0, v)
	}
	if got := limitsOf(t, l, "p"); len(got.Limits) != 1 || got.Limits[0].Cap != 10 || len(got.Frozen) != 0 {
		t.Fatalf("org p's limits changed by org o's calls: %+v", got)
	}
}

// testLimitsInvalid: malformed scopes, windows, caps and project ids, and more than MaxLimits.
func testLimitsInvalid(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	for _, id := range []string{"", "a:b", "a b", "a,b", "a;b", "a|b", string(make([]byte, 129)), "é"} {
		_, err := l.CreateProject(c, "o", id)
		wantErr(t, err, ledger.ErrInvalidLimit, "project id "+id)
	}
	bad := []struct {
		s   balance.Scope
		w   balance.Window
		cap int64
	}{
		{orgScope, "year", 1},
		{orgScope, balance.Day, 0},
		{orgScope, balance.Day, -5},
		{orgScope, balance.Day, balance.MaxAmount + 1},
		{scope(balance.ScopeOrg, "x"), balance.Day, 1},
		{scope("team", "x"), balance.Day, 1},
		{scope(balance.ScopeProject, ""), balance.Day, 1},
	}
	for _, b := range bad {
		_, _, err := l.CreateLimit(c, "o", balance.Limit{Scope: b.s, Window: b.w, Unit: balance.Money, Cap: b.cap})
		wantErr(t, err, ledger.ErrInvalidLimit, "limit "+b.s.String()+" "+string(b.w))
	}
	lim := mustLimit(t, l, "o", orgScope, balance.Lifetime, balance.MaxAmount)
	_, _, err := l.SetLimitCap(c, "o", lim.ID, 0)
	wantErr(t, err, ledger.ErrInvalidLimit, "a cap of 0")
	for i := 1; i < ledger.MaxLimits; i++ {
		mustLimit(t, l, "o", orgScope, balance.Hour, int64(i))
	}
	_, _, err = l.CreateLimit(c, "o", balance.Limit{Scope: orgScope, Window: balance.Hour, Unit: balance.Money, Cap: 1})
	wantErr(t, err, ledger.ErrInvalidLimit, "one limit more than MaxLimits")
	must(l.DeleteLimit(c, "o", lim.ID))
	mustLimit(t, l, "o", orgScope, balance.Hour, 1) // room again
}

// testLimitsFreezes: freezes of the org, its projects and keys, and the key → project map, as
// Limits returns them (revoked keys left out).
func testLimitsFreezes(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	k1, k2, k3 := newKey(t, l, "o"), newKey(t, l, "o"), newKey(t, l, "o")
	must(l.CreateProject(c, "o", "staging"))
	must(l.CreateProject(c, "o", "prod"))
	must(l.SetKeyProject(c, k1.ID, "staging"))
	must(l.SetKeyProject(c, k2.ID, "prod"))
	must(l.SetKeyProject(c, k2.ID, "staging")) // a key is in at most one project
	must(l.SetKeyProject(c, k3.ID, "prod"))
	must(l.SetFrozen(c, "o", orgScope, true))
	must(l.SetFrozen(c, "o", scope(balance.ScopeProject, "prod"), true))
	must(l.SetFrozen(c, "", scope(balance.ScopeKey, k1.ID), true))
	ls := limitsOf(t, l, "o")
	wantFrozen := []balance.Scope{orgScope, scope(balance.ScopeProject, "prod"), scope(balance.ScopeKey, k1.ID)}
	for _, f := range wantFrozen {
		if !slices.Contains(ls.Frozen, f) {
			t.Fatalf("Frozen %v lacks %v", ls.Frozen, f)
		}
	}
	if len(ls.Frozen) != len(wantFrozen) {
		t.Fatalf("Frozen %v, want %v", ls.Frozen, wantFrozen)
	}
	if want := map[string]string{k1.ID: "staging", k2.ID: "staging", k3.ID: "prod"}; !mapsEqual(ls.Projects, want) {
		t.Fatalf("Projects %v, want %v", ls.Projects, want)
	}
	must(l.SetFrozen(c, "o", orgScope, false))
	must(l.SetFrozen(c, "o", scope(balance.ScopeProject, "prod"), false))
	must(l.SetKeyProject(c, k1.ID, ""))
	noErr(t, l.RevokeKey(c, k3.ID))
	ls = limitsOf(t, l, "o")
	if !slices.Equal(ls.Frozen, []balance.Scope{scope(balance.ScopeKey, k1.ID)}) {
		t.Fatalf("Frozen after unfreezing %v", ls.Frozen)
	}
	if want := map[string]string{k2.ID: "staging"}; !mapsEqual(ls.Projects, want) {
		t.Fatalf("Projects after clearing k1 and revoking k3: %v, want %v", ls.Projects, want)
	}
	must(l.SetFrozen(c, "o", scope(balance.ScopeKey, k1.ID), false))
	if ls = limitsOf(t, l, "o"); len(ls.Frozen) != 0 {
		t.Fatalf("Frozen after unfreezing everything: %v", ls.Frozen)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// charge records and accounts one event with attribution.
func charge(t *testing.T, l ledger.Ledger, org, key, project string, cost int64, reserved, recorded time.Time) ledger.UsageEvent {
	t.Helper()
	ev := event(org, cost, 0)
	ev.KeyID, ev.Project, ev.ReservedAt, ev.CreatedAt = key, project, reserved, recorded
	noErr(t, l.RecordUsage(ctx(t), []ledger.UsageEvent{ev}))
	for must(l.AccountPending(ctx(t), 100)) > 0 {
	}
	return ev
}

// testLimitsAttribution: a charge entry carries its event's key, project and reserve time
// (whole milliseconds, exact), or its record time without one; ids no limit could name are left
// out; credits carry none.
func testLimitsAttribution(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000, "pay-attr"))
	at := time.Date(2026, 3, 31, 23, 59, 59, 999_000_000, time.UTC)
	rec := at.Add(2 * time.Second) // recorded after midnight
	ev := charge(t, l, "o", "key_a", "staging", 7, at.Add(400*time.Microsecond), rec)
	failOpen := charge(t, l, "o", "key_b", "", 3, time.Time{}, rec.Add(time.Millisecond))
	odd := charge(t, l, "o", "user:42", "a b", 2, at, rec)
	want := []balance.Entry{
		{Seq: 1, Delta: 1_000},
		{Seq: 2, Delta: -7, HoldID: ev.ID, KeyID: "key_a", Project: "staging", ReservedAt: at},
		{Seq: 3, Delta: -3, HoldID: failOpen.ID, KeyID: "key_b", ReservedAt: rec.Add(time.Millisecond)},
		{Seq: 4, Delta: -2, HoldID: odd.ID, ReservedAt: at},
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
	r := must(l.Request(c, ev.ID))
	if r.Project != "staging" || !r.ReservedAt.Equal(at) || r.KeyID != "key_a" {
		t.Fatalf("request %+v: project and reserve time not kept", r)
	}
}

func entryEqual(a, b balance.Entry) bool {
	return a.Seq == b.Seq && a.Delta == b.Delta && a.HoldID == b.HoldID && a.KeyID == b.KeyID && a.Project == b.Project && a.EndUser == b.EndUser &&
		a.ReservedAt.Equal(b.ReservedAt) && a.Recorded.Equal(b.Recorded)
}

// testSnapshotSinceUnits (DESIGN "Limits", third wave): a requests limit counts 1 per charge, a
// tokens limit its input + output tokens, a money limit its cost, each in its window from since's
// on; a minute window counts only the charges reserved in it (the seed's buckets are minutes
// from the earliest minute window on, hours before), the others every charge of theirs.
func testSnapshotSinceUnits(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	k := newKey(t, l, "o")
	must2(l.Credit(c, "o", 1_000_000, "pay-units"))
	ks := scope(balance.ScopeKey, k.ID)
	rpm := mustUnitLimit(t, l, ks, balance.Minute, balance.Requests, 10)
	tph := mustUnitLimit(t, l, ks, balance.Hour, balance.Tokens, 10_000)
	money := mustUnitLimit(t, l, ks, balance.Hour, balance.Money, 10_000)
	if rpm.Unit != balance.Requests || limitsOf(t, l, "o").Limits[0].Unit != balance.Requests || limitsOf(t, l, "o").Limits[1].Unit != balance.Tokens {
		t.Fatalf("units not kept: %+v, %+v", rpm, limitsOf(t, l, "o").Limits)
	}
	since := time.Date(2026, 5, 5, 10, 30, 20, 0, time.UTC)
	minute := since.Truncate(time.Minute)
	charge(t, l, "o", k.ID, "", 5, minute.Add(time.Second), time.Time{})      // this minute
	charge(t, l, "o", k.ID, "", 7, minute.Add(59*time.Second), time.Time{})   // this minute, its last second
	charge(t, l, "o", k.ID, "", 11, minute.Add(-time.Second), time.Time{})    // the minute before: the hour's only
	charge(t, l, "o", k.ID, "", 13, minute.Add(time.Minute), time.Time{})     // the next minute
	charge(t, l, "o", k.ID, "", 17, minute.Add(-31*time.Minute), time.Time{}) // the hour before
	perCharge := event("o", 0, 0).Usage.Tokens()
	ms := func(t time.Time) int64 { return t.UnixMilli() }
	hour := since.Truncate(time.Hour)
	want := []balance.WindowUsed{
		{LimitID: rpm.ID, Start: ms(minute), Used: 2},
		{LimitID: rpm.ID, Start: ms(minute.Add(time.Minute)), Used: 1},
		{LimitID: tph.ID, Start: ms(hour), Used: 4 * perCharge},
		{LimitID: money.ID, Start: ms(hour), Used: 5 + 7 + 11 + 13},
	}
	snap := must(l.SnapshotSince(c, "o", since))
	if got := snap.Limits.Used; !slices.Equal(got, want) {
		t.Fatalf("Used = %+v,\nwant %+v", got, want)
	}
	if got := must(l.LimitUsage(c, "o", since, -1)); !slices.Equal(got, want) {
		t.Fatalf("LimitUsage = %+v,\nwant %+v", got, want)
	}
}

func mustUnitLimit(t *testing.T, l ledger.Ledger, s balance.Scope, w balance.Window, u balance.Unit, cap int64) balance.Limit {
	t.Helper()
	lim, _, err := l.CreateLimit(ctx(t), "o", balance.Limit{Scope: s, Window: w, Unit: u, Cap: cap})
	noErr(t, err)
	return lim
}

// testSnapshotSince: the spend of each limit's windows from since's on, grouped by reserve time
// (never record time), attributed to the org's limits (every charge), its project's (charges
// with that project) and its key's (charges with that key).
func testSnapshotSince(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	k1, k2 := newKey(t, l, "o"), newKey(t, l, "o")
	must(l.CreateProject(c, "o", "staging"))
	must2(l.Credit(c, "o", 1_000_000, "pay-since"))
	orgDay := mustLimit(t, l, "o", orgScope, balance.Day, 1_000)
	orgMonth := mustLimit(t, l, "o", orgScope, balance.Month, 10_000)
	projDay := mustLimit(t, l, "o", scope(balance.ScopeProject, "staging"), balance.Day, 500)
	keyDay := mustLimit(t, l, "o", scope(balance.ScopeKey, k1.ID), balance.Day, 50)
	keyLife := mustLimit(t, l, "o", scope(balance.ScopeKey, k1.ID), balance.Lifetime, 5_000)
	keyHour := mustLimit(t, l, "o", scope(balance.ScopeKey, k2.ID), balance.Hour, 70)

	d := time.Date(2026, 3, 31, 0, 0, 0, 0, time.UTC) // a Tuesday, the month's last day
	late := d.Add(24*time.Hour - time.Second)         // 23:59:59
	next := d.Add(24 * time.Hour)                     // April 1st
	since := d.Add(12 * time.Hour)

	charge(t, l, "o", k1.ID, "staging", 11, late, next.Add(5*time.Second))                             // reserved 23:59:59, recorded after midnight
	charge(t, l, "o", k1.ID, "", 13, d.Add(-time.Hour), d.Add(time.Hour))                              // the day before: not in a day window from since's on
	charge(t, l, "o", k2.ID, "staging", 17, d.Add(12*time.Hour+30*time.Minute), time.Time{})           // in the current hour of since
	charge(t, l, "o", k2.ID, "", 19, d.Add(11*time.Hour+59*time.Minute), time.Time{})                  // the hour before since's: not counted for hours
	charge(t, l, "o", "", "", 23, time.Time{}, next.Add(time.Hour))                                    // fail-open: its record time, April 1st
	charge(t, l, "o", k1.ID, "staging", 29, time.Date(2026, 2, 28, 8, 0, 0, 0, time.UTC), time.Time{}) // February 28: the lifetime limit only

	snap := must(l.SnapshotSince(c, "o", since))
	plain := must(l.Snapshot(c, "o"))
	if snap.Balance != plain.Balance || snap.Seq != plain.Seq || snap.Epoch != plain.Epoch || snap.Seq != 7 {
		t.Fatalf("SnapshotSince %+v and Snapshot %+v differ", snap, plain)
	}
	if snap.Limits == nil {
		t.Fatal("SnapshotSince returned no limits")
	}
	wantLimits := []balance.Limit{orgDay, orgMonth, projDay, keyDay, keyLife, keyHour}
	if !slices.Equal(snap.Limits.Limits.Limits, wantLimits) || snap.Limits.Version != limitsOf(t, l, "o").Version {
		t.Fatalf("snapshot limits %+v", snap.Limits.Limits)
	}
	ms := func(t time.Time) int64 { return t.UnixMilli() }
	want := []balance.WindowUsed{
		{LimitID: orgDay.ID, Start: ms(d), Used: 11 + 17 + 19},
		{LimitID: orgDay.ID, Start: ms(next), Used: 23},
		{LimitID: orgMonth.ID, Start: ms(time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)), Used: 11 + 13 + 17 + 19},
		{LimitID: orgMonth.ID, Start: ms(next), Used: 23},
		{LimitID: projDay.ID, Start: ms(d), Used: 11 + 17},
		{LimitID: keyDay.ID, Start: ms(d), Used: 11},
		{LimitID: keyLife.ID, Start: 0, Used: 11 + 13 + 29},
		{LimitID: keyHour.ID, Start: ms(d.Add(12 * time.Hour)), Used: 17},
	}
	if got := snap.Limits.Used; !slices.Equal(got, want) {
		t.Fatalf("Used = %+v,\nwant %+v", got, want)
	}
	if got := must(l.LimitUsage(c, "o", since, -1)); !slices.Equal(got, want) {
		t.Fatalf("LimitUsage = %+v,\nwant %+v", got, want)
	}
	// From April on, March's windows are not returned.
	april := must(l.SnapshotSince(c, "o", next.Add(30*time.Minute)))
	wantApril := []balance.WindowUsed{
		{LimitID: orgDay.ID, Start: ms(next), Used: 23},
		{LimitID: orgMonth.ID, Start: ms(next), Used: 23},
		{LimitID: keyLife.ID, Start: 0, Used: 11 + 13 + 29},
	}
	if got := april.Limits.Used; !slices.Equal(got, wantApril) {
		t.Fatalf("Used from April = %+v,\nwant %+v", got, wantApril)
	}
	// An org without limits: a snapshot with none.
	noErr(t, l.CreateOrg(c, "bare"))
	if s := must(l.SnapshotSince(c, "bare", since)); s.Limits == nil || len(s.Limits.Limits.Limits) != 0 || len(s.Limits.Used) != 0 || s.Limits.Version != 0 {
		t.Fatalf("snapshot of an org without limits: %+v", s.Limits)
	}
}

// testSnapshotSincePending: the snapshot accounts pending usage first, and its spend includes
// those charges (seq ≤ the snapshot's).
func testSnapshotSincePending(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	lim := mustLimit(t, l, "o", orgScope, balance.Day, 100)
	at := time.Date(2026, 5, 5, 10, 0, 0, 0, time.UTC)
	ev := event("o", 40, 0)
	ev.ReservedAt = at
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{ev}))
	snap := must(l.SnapshotSince(c, "o", at))
	if snap.Seq != 1 || snap.Balance != -40 || account(t, l, "o").Pending != 0 {
		t.Fatalf("snapshot %+v did not account the pending event", snap)
	}
	want := []balance.WindowUsed{{LimitID: lim.ID, Start: balance.Day.StartMS(at), Used: 40}}
	if !slices.Equal(snap.Limits.Used, want) {
		t.Fatalf("Used = %+v, want %+v", snap.Limits.Used, want)
	}
}

// testLimitUsageSeq: LimitUsage counts the entries up to maxSeq only.
func testLimitUsageSeq(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	noErr(t, l.CreateOrg(c, "o"))
	lim := mustLimit(t, l, "o", orgScope, balance.Lifetime, 100)
	at := time.Date(2026, 5, 5, 10, 0, 0, 0, time.UTC)
	for _, cost := range []int64{1, 2, 4} {
		charge(t, l, "o", "", "", cost, at, time.Time{})
	}
	for seq, want := range map[int64]int64{1: 1, 2: 3, 3: 7, -1: 7} {
		got := must(l.LimitUsage(c, "o", at, seq))
		if w := []balance.WindowUsed{{LimitID: lim.ID, Used: want}}; !slices.Equal(got, w) {
			t.Fatalf("LimitUsage up to seq %d = %+v, want %+v", seq, got, w)
		}
	}
	if got := must(l.LimitUsage(c, "o", at, 0)); len(got) != 0 {
		t.Fatalf("LimitUsage up to seq 0 = %+v, want none", got)
	}
}
