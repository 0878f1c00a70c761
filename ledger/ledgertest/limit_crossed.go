package ledgertest

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// limitCrossedTests cover the limit.crossed webhook event (accounting/limit_crossed.go): the
// ledger's spend in a limit's window crossing 80 % and 100 % of its cap, written with the
// charges that cross.
var limitCrossedTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"LimitCrossedOncePerThresholdAndWindow", testLimitCrossedOnce},
	{"LimitCrossedAttribution", testLimitCrossedAttribution},
	{"LimitCrossedOnlySubscribed", testLimitCrossedSubscribed},
	{"LimitCrossedCapChangesAndDeletes", testLimitCrossedCaps},
}

// laterDay is the start of the day after tomorrow (UTC): its windows are later than the
// ledger's current ones for the whole test, so they are kept and fire.
func laterDay() time.Time {
	start, _ := balance.Day.Bounds(time.Now())
	return start.AddDate(0, 0, 2)
}

// limitEvents claims every due delivery and returns the limit.crossed events each webhook got,
// as briefs, in event order: by time, then (the events of one transaction may share their time)
// by limit id, window start, end user and threshold.
func limitEvents(t *testing.T, h ledger.Webhooks) map[string][]string {
	t.Helper()
	num := func(e sentEvent, k string) int64 {
		n, _ := strconv.ParseInt(jsonText(e.Data[k]), 10, 64)
		return n
	}
	out := map[string][]string{}
	for id, es := range claimAll(t, h) {
		slices.SortStableFunc(es, func(a, b sentEvent) int {
			return cmp.Or(a.CreatedAt.Compare(b.CreatedAt), cmp.Compare(num(a, "limit_id"), num(b, "limit_id")),
				cmp.Compare(jsonText(a.Data["window_start"]), jsonText(b.Data["window_start"])),
				cmp.Compare(jsonText(a.Data["end_user"]), jsonText(b.Data["end_user"])), cmp.Compare(num(a, "threshold"), num(b, "threshold")))
		})
		for _, e := range es {
			if e.Type == string(ledger.EventLimitCrossed) {
				out[id] = append(out[id], brief(e))
			}
		}
	}
	return out
}

// crossed is the brief of a limit.crossed event of org o.
func crossed(l balance.Limit, start time.Time, used int64, pct int) string {
	ws := "null"
	if l.Window != balance.Lifetime {
		ws = start.UTC().Format(time.RFC3339)
	}
	return fmt.Sprintf("limit.crossed o cap=%d limit_id=%s scope=%s scope_id=%s threshold=%d used=%d window=%s window_start=%s",
		l.Cap, l.ID, l.Scope.Kind, l.Scope.ID, pct, used, l.Window, ws)
}

func wantEvents(t *testing.T, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("%s:\n%s\nwant\n%s", what, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// batch records events of o (key, project, cost, reserve time) and accounts them in one pass.
func batch(t *testing.T, l ledger.Ledger, evs ...ledger.UsageEvent) {
	t.Helper()
	noErr(t, l.RecordUsage(ctx(t), evs))
	if n := must(l.AccountPending(ctx(t), 100)); n != len(evs) {
		t.Fatalf("accounted %d of %d", n, len(evs))
	}
}

func usage(key, project string, cost int64, at time.Time) ledger.UsageEvent {
	ev := event("o", cost, 0)
	ev.KeyID, ev.Project, ev.ReservedAt, ev.CreatedAt = key, project, at, time.Time{}
	return ev
}

// testLimitCrossedOnce: 80 % and 100 % each fire once per window (at the threshold exactly is
// a crossing); a batch that jumps past both fires both; the next window fires again; the
// snapshot's accounting of pending usage fires too.
func testLimitCrossedOnce(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay"))
	w, _, err := h.CreateWebhook(c, "https://example.com/limits", []ledger.EventType{ledger.EventLimitCrossed})
	noErr(t, err)
	day := mustLimit(t, l, "o", orgScope, balance.Day, 1_000)
	d := laterDay()

	batch(t, l, usage("k", "", 700, d.Add(time.Hour)))
	batch(t, l, usage("k", "", 100, d.Add(2*time.Hour))) // 800: 80 %, exactly
	batch(t, l, usage("k", "", 100, d.Add(3*time.Hour))) // 900
	batch(t, l, usage("k", "", 99, d.Add(4*time.Hour)))  // 999
	batch(t, l, usage("k", "", 1, d.Add(5*time.Hour)))   // 1000: 100 %
	batch(t, l, usage("k", "", 50, d.Add(6*time.Hour)))  // 1050: over, no new crossing
	next := d.AddDate(0, 0, 1)
	batch(t, l, usage("k", "", 600, next.Add(time.Hour)), usage("k", "", 600, next.Add(2*time.Hour)), // the next day's window: both at once
		usage("k", "", 5, d.Add(7*time.Hour))) // and the first day's again: nothing
	// The seed's snapshot accounts pending usage: its charges cross like the worker's.
	after := next.AddDate(0, 0, 1)
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{usage("k", "", 850, after)}))
	must(l.Snapshot(c, "o"))
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{usage("k", "", 150, after.Add(time.Minute))}))
	must(l.SnapshotSince(c, "o", time.Now()))

	wantEvents(t, "limit.crossed events", limitEvents(t, h)[w.ID], []string{
		crossed(day, d, 800, 80),
		crossed(day, d, 1000, 100),
		crossed(day, next, 1200, 80),
		crossed(day, next, 1200, 100),
		crossed(day, after, 850, 80),
		crossed(day, after, 1000, 100),
	})
	checkLedger(t, l, "o")
}

// testLimitCrossedAttribution: an org limit counts every charge, a project limit the charges
// of that project, a key limit the charges of that key, each in the window of the charge's
// reserve time (its record time without one); a lifetime limit has one window (window_start
// null); a charge in a window before the current one moves and fires nothing.
func testLimitCrossedAttribution(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay"))
	k1, k2 := newKey(t, l, "o"), newKey(t, l, "o")
	must(l.CreateProject(c, "o", "staging"))
	w, _, err := h.CreateWebhook(c, "https://example.com/all", ledger.EventTypes)
	noErr(t, err)
	proj := mustLimit(t, l, "o", scope(balance.ScopeProject, "staging"), balance.Day, 100)
	key := mustLimit(t, l, "o", scope(balance.ScopeKey, k1.ID), balance.Week, 100)
	life := mustLimit(t, l, "o", scope(balance.ScopeKey, k2.ID), balance.Lifetime, 1_000)
	mustLimit(t, l, "o", orgScope, balance.Month, 1_000_000) // never crossed
	d := laterDay()
	past := d.AddDate(0, 0, -30) // a month ago: every window of it is past

	batch(t, l, usage(k2.ID, "staging", 50, d.Add(time.Hour)))   // project 50, lifetime 50
	batch(t, l, usage(k1.ID, "", 80, d.Add(2*time.Hour)))        // key 80: 80 %
	batch(t, l, usage(k2.ID, "", 700, d.Add(3*time.Hour)))       // lifetime 750
	batch(t, l, usage("other", "prod", 500, d.Add(4*time.Hour))) // nobody's limit but the month's
	batch(t, l, usage(k1.ID, "staging", 30, d.Add(5*time.Hour))) // project 80: 80 %; key 110: 100 %
	batch(t, l, usage(k1.ID, "staging", 500, past))              // past windows: nothing moves
	batch(t, l, usage(k2.ID, "staging", 19, d.Add(6*time.Hour))) // project 99; lifetime 769
	batch(t, l, usage(k2.ID, "", 31, time.Now().Add(time.Hour))) // lifetime 800: 80 % (any time is its window)
	fo := usage(k2.ID, "staging", 1, time.Time{})                // fail-open: counted at its record time
	fo.CreatedAt = d.Add(7 * time.Hour)
	batch(t, l, fo) // project 100: 100 %; lifetime 801

	weekStart, _ := balance.Week.Bounds(d)
	wantEvents(t, "limit.crossed events", limitEvents(t, h)[w.ID], []string{
		crossed(key, weekStart, 80, 80),
		crossed(proj, d, 80, 80),
		crossed(key, weekStart, 110, 100),
		crossed(life, time.Time{}, 800, 80),
		crossed(proj, d, 100, 100),
	})
}

// testLimitCrossedSubscribed: without an endpoint subscribed to limit.crossed nothing is
// written, but the window's spend is kept: a later subscriber gets the next crossing only.
func testLimitCrossedSubscribed(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay"))
	others, _, err := h.CreateWebhook(c, "https://example.com/others", []ledger.EventType{ledger.EventBalanceLow, ledger.EventCreditReceived})
	noErr(t, err)
	lim := mustLimit(t, l, "o", orgScope, balance.Day, 1_000)
	d := laterDay()
	batch(t, l, usage("k", "", 900, d)) // 80 % crossed: no endpoint wants it
	if got := limitEvents(t, h); len(got) != 0 {
		t.Fatalf("limit.crossed without a subscriber: %v", got)
	}
	w, _, err := h.CreateWebhook(c, "https://example.com/limits", []ledger.EventType{ledger.EventLimitCrossed})
	noErr(t, err)
	batch(t, l, usage("k", "", 50, d.Add(time.Hour)))   // 950
	batch(t, l, usage("k", "", 60, d.Add(2*time.Hour))) // 1010: 100 %
	got := limitEvents(t, h)
	wantEvents(t, "limit.crossed events", got[w.ID], []string{crossed(lim, d, 1010, 100)})
	if len(got[others.ID]) != 0 || len(deliveriesOf(t, h, others.ID)) != 0 {
		t.Fatalf("the webhook of other events got %v", deliveriesOf(t, h, others.ID))
	}
}

// testLimitCrossedCaps: a cap change never fires by itself, but the spend then crossing the new
// cap's thresholds does; a deleted limit never fires; a limit made mid-window counts the
// window's charges so far (no event for a threshold already behind it).
func testLimitCrossedCaps(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	must2(l.Credit(c, "o", 1_000_000, "pay"))
	w, _, err := h.CreateWebhook(c, "https://example.com/limits", []ledger.EventType{ledger.EventLimitCrossed})
	noErr(t, err)
	a := mustLimit(t, l, "o", orgScope, balance.Day, 1_000)
	gone := mustLimit(t, l, "o", orgScope, balance.Day, 100)
	d := laterDay()
	batch(t, l, usage("k", "", 850, d)) // a: 80 %; gone: 80 % and 100 %
	must(l.DeleteLimit(c, "o", gone.ID))
	a2, _ := must2(l.SetLimitCap(c, "o", a.ID, 2_000))  // 850 of 2000: no event
	batch(t, l, usage("k", "", 800, d.Add(time.Hour)))  // 1650: 80 % of the new cap
	must2(l.SetLimitCap(c, "o", a.ID, 1_000))           // 1650 of 1000: no event
	batch(t, l, usage("k", "", 10, d.Add(2*time.Hour))) // 1660: nothing crossed
	late := mustLimit(t, l, "o", orgScope, balance.Day, 2_000)
	batch(t, l, usage("k", "", 400, d.Add(3*time.Hour))) // late: 1660 → 2060, 100 % only

	wantEvents(t, "limit.crossed events", limitEvents(t, h)[w.ID], []string{
		crossed(a, d, 850, 80),
		crossed(gone, d, 850, 80),
		crossed(gone, d, 850, 100),
		crossed(a2, d, 1650, 80),
		crossed(late, d, 2060, 100),
	})
}
