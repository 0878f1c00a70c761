package ledger

import (
	"cmp"
	"slices"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Limit crossings (the limit.crossed webhook event): both ledgers keep the ledger's spend of
// each limit's current and later windows (Postgres: the limit_windows table, migration 009),
// moved by the account pass in the transaction that writes the charges, and write an event
// when a batch takes a window's spend from below 80 % (100 %) of the limit's cap to at or above
// it. A charge counts where DESIGN.md "Limits" attributes it: every limit of its org's scope,
// the project's limits for a charge of that project, the key's for a charge of that key, in the
// window that contains its reserve time (attrTime), and the end-user limits for a charge with an
// end user: a limit of each end user apart has one window per end user (its crossing names the
// end user), a limit with an end user id counts that one. A window is touched only while it is the
// current one or a later one (by the ledger's clock): a charge that lands in a past window
// moves nothing and fires nothing. The first batch that charges a window starts its spend from
// the window's charges already in the ledger (a limit created mid-window, or a window no batch
// touched yet), so the table never needs the history summed again.

// limitThresholds are the percentages of a limit's cap whose crossing fires limit.crossed.
var LimitThresholds = []int64{80, 100}

// lifetimeEnd stands for the end of a lifetime limit's one window.
var lifetimeEnd = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)

// ChargeAttr is what the window spend needs of one charge.
type ChargeAttr struct {
	Key, Project string
	EndUser      string    // "" for none; an id no limit can name counts as none
	At           time.Time // attrTime: the reserve time, else the record time
	Cost         int64
	Tokens       int64 // input + output
}

// AttributedTo reports whether a charge of key, project and end user (AttrID's) counts against
// limit l. A charge with no end user never counts against an end-user limit.
func AttributedTo(l balance.Limit, key, project, endUser string) bool {
	switch l.Scope.Kind {
	case balance.ScopeOrg:
		return true
	case balance.ScopeProject:
		return project != "" && project == l.Scope.ID
	case balance.ScopeKey:
		return key != "" && key == l.Scope.ID
	case balance.ScopeEndUser:
		return endUser != "" && (l.Scope.ID == "" || endUser == l.Scope.ID)
	}
	return false
}

// eachEndUser: l has one window per end user (scope end_user without an id).
func eachEndUser(l balance.Limit) bool {
	return l.Scope.Kind == balance.ScopeEndUser && l.Scope.ID == ""
}

// WindowInc is what a batch of charges adds to one window of one limit (of one end user, for a
// limit of each end user apart).
type WindowInc struct {
	Limit       balance.Limit
	Start, Next time.Time // the window (lifetime: the Unix epoch to lifetimeEnd)
	EndUser     string    // the end user of a limit of each end user apart; else ""
	Current     time.Time // the start of the limit's current window: older rows are dropped
	Inc         int64
}

// windowBounds is the window of w that contains t (balance.Window.Bounds; lifetime: all time).
func windowBounds(w balance.Window, t time.Time) (start, next time.Time) {
	if w == balance.Lifetime {
		return time.UnixMilli(0).UTC(), lifetimeEnd
	}
	return w.Bounds(t)
}

// WindowIncs sums a batch's charges into the windows of limits they are attributed to, leaving
// out the windows before each limit's current one at now; zero sums are left out. The answer is
// in limit order, then window start, then end user.
func WindowIncs(limits []balance.Limit, charges []ChargeAttr, now time.Time) []WindowInc {
	var out []WindowInc
	for _, l := range limits {
		cur, _ := windowBounds(l.Window, now)
		first := len(out)
		type win struct {
			start   int64
			endUser string
		}
		index := map[win]int{} // a window's place in out: a batch may have many end users
		for _, c := range charges {
			n := l.Unit.Count(c.Cost, c.Tokens)
			eu := AttrID(balance.ScopeEndUser, c.EndUser)
			if n == 0 || !AttributedTo(l, c.Key, c.Project, eu) {
				continue
			}
			start, next := windowBounds(l.Window, c.At)
			if start.Before(cur) {
				continue
			}
			w := WindowInc{Limit: l, Start: start, Next: next, Current: cur}
			if eachEndUser(l) {
				w.EndUser = eu
			}
			k := win{start.UnixMilli(), w.EndUser}
			i, ok := index[k]
			if !ok {
				i = len(out)
				index[k] = i
				out = append(out, w)
			}
			out[i].Inc += n
		}
		slices.SortFunc(out[first:], func(a, b WindowInc) int {
			return cmp.Or(a.Start.Compare(b.Start), cmp.Compare(a.EndUser, b.EndUser))
		})
	}
	return out
}

// thresholdOf is the least spend at or above pct % of cap (exact: cap ≤ 10^14).
func thresholdOf(cap, pct int64) int64 { return (cap*pct + 99) / 100 }

// CrossedUp lists the limitThresholds a window's spend crosses going from before to after.
func CrossedUp(before, after, cap int64) []int64 {
	var out []int64
	for _, pct := range LimitThresholds {
		if th := thresholdOf(cap, pct); before < th && after >= th {
			out = append(out, pct)
		}
	}
	return out
}

// limitCrossedData is the data of a limit.crossed event (the same fields as the Postgres body).
type limitCrossedData struct {
	LimitID     string  `json:"limit_id"`
	Scope       string  `json:"scope"`
	ScopeID     string  `json:"scope_id"`           // "" for the org scope and for each end user apart
	EndUser     string  `json:"end_user,omitempty"` // the end user who crossed a limit of each end user apart
	Window      string  `json:"window"`             // lifetime, minute, hour, day, week or month
	Unit        string  `json:"unit,omitempty"`     // requests or tokens; absent for money
	WindowStart *string `json:"window_start"`       // RFC 3339, UTC; null for lifetime
	Cap         int64   `json:"cap"`                // the cap when the batch was accounted
	Used        int64   `json:"used"`               // the window's ledger spend after the batch
	Threshold   int64   `json:"threshold"`          // 80 or 100 (percent of the cap)
}

func NewLimitCrossedData(w WindowInc, used, pct int64) limitCrossedData {
	d := limitCrossedData{LimitID: w.Limit.ID, Scope: string(w.Limit.Scope.Kind), ScopeID: w.Limit.Scope.ID,
		Window: string(w.Limit.Window), Unit: string(w.Limit.Unit), Cap: w.Limit.Cap, Used: used, Threshold: pct, EndUser: w.EndUser}
	if w.Limit.Window != balance.Lifetime {
		s := w.Start.UTC().Format(time.RFC3339)
		d.WindowStart = &s
	}
	return d
}
