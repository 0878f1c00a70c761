package ledger

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Limits, projects and freezes (DESIGN.md "Limits"): the ledger keeps them as rows, raises the
// org's limits version with every change, and hands them to the hot balance with each snapshot
// (balance.LimitLedger), together with the spend of the current windows.

// Sentinel errors of limits. Test for them with errors.Is.
var (
	ErrUnknownProject = errors.New("ledger: unknown project")
	ErrProjectExists  = errors.New("ledger: project already exists")
	ErrUnknownLimit   = errors.New("ledger: unknown limit")
	// ErrInvalidLimit: a malformed scope, window, cap or project id, or too many limits.
	ErrInvalidLimit = errors.New("ledger: invalid limit")
)

// MaxLimits is the most limits an org may have at once.
const MaxLimits = 64

// LimitChange is where a change of limits landed: the org and its new limits version (push it
// to the hot balance with balance.Store.PushLimits).
type LimitChange struct {
	Org     string
	Version int64
}

// LimitStore is the ledger's part of limits. Every write raises the org's limits version in
// the same transaction and returns it. Unknown orgs, projects, keys and limits are
// ErrUnknownOrg, ErrUnknownProject, ErrUnknownKey and ErrUnknownLimit.
type LimitStore interface {
	// CreateProject creates an (empty) project of org (ErrProjectExists).
	CreateProject(ctx context.Context, org, project string) (LimitChange, error)
	// SetKeyProject puts the key in project of its own org, or in none when project is "".
	SetKeyProject(ctx context.Context, keyID, project string) (LimitChange, error)
	// CreateLimit adds a limit counting unit u; its id is never reused, even after it is
	// deleted. A project or key scope names a project or key of org.
	// l's ID is ignored; RequireEndUser only on a limit of each end user apart.
	CreateLimit(ctx context.Context, org string, l balance.Limit) (balance.Limit, LimitChange, error)
	// SetLimitCap changes a limit's cap (lowering it below what is used refuses new holds and
	// never moves money).
	SetLimitCap(ctx context.Context, org, id string, cap int64) (balance.Limit, LimitChange, error)
	// DeleteLimit deletes a limit.
	DeleteLimit(ctx context.Context, org, id string) (LimitChange, error)
	// SetFrozen freezes (or unfreezes) the org, one of its projects or one of its keys. For a
	// key, org may be "" (the key's org is used); otherwise it must be the key's org.
	SetFrozen(ctx context.Context, org string, scope balance.Scope, frozen bool) (LimitChange, error)
	// Limits returns the org's limits (by id), freezes and key → project map (revoked keys left
	// out), with their version.
	Limits(ctx context.Context, org string) (balance.Limits, error)
	// LimitUsage is the spend of the org's limits' windows starting at or after the window
	// (of each limit) that contains since: Σ over the charge entries with seq ≤ maxSeq
	// (maxSeq < 0: all) attributed to each (limit, window start), by each entry's reserve time,
	// of what each counts in the limit's unit (balance.Unit.Count: cost, 1, tokens).
	// It writes nothing (SnapshotSince is the seed's read).
	LimitUsage(ctx context.Context, org string, since time.Time, maxSeq int64) ([]balance.WindowUsed, error)
	// SnapshotSince is Snapshot plus, in the same transaction, the org's Limits and the spend
	// of their windows from since's on up to the snapshot's seq (balance.LimitLedger), but for
	// the lifetime limits of each end user apart (NewLimitSpan).
	SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error)
}

// CheckLimit checks a new limit's scope, window, unit and cap.
func CheckLimit(l balance.Limit) error {
	if err := l.Scope.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidLimit, err)
	}
	if !l.Window.Valid() {
		return fmt.Errorf("%w: window %q (lifetime, minute, hour, day, week or month)", ErrInvalidLimit, l.Window)
	}
	if l.Unit != balance.Money && l.Unit != balance.Requests && l.Unit != balance.Tokens {
		return fmt.Errorf("%w: unit %q (money, requests or tokens)", ErrInvalidLimit, l.Unit)
	}
	if l.RequireEndUser && !eachEndUser(l) {
		return fmt.Errorf("%w: require_end_user is for a limit of scope end_user without scope_id (each end user apart)", ErrInvalidLimit)
	}
	return CheckCap(l.Cap)
}

// CheckCap checks a limit's cap: 1 to 10^14 (micro-units, requests or tokens).
func CheckCap(cap int64) error {
	if cap <= 0 || cap > balance.MaxAmount {
		return fmt.Errorf("%w: cap %d (1 to 10^14)", ErrInvalidLimit, cap)
	}
	return nil
}

// ParseUnit reads a unit as the admin API and the limits table spell it: "money" (or ""),
// "requests", "tokens"; ok is false for anything else.
func ParseUnit(s string) (balance.Unit, bool) {
	switch s {
	case "", "money":
		return balance.Money, true
	case "requests":
		return balance.Requests, true
	case "tokens":
		return balance.Tokens, true
	}
	return "", false
}

func CheckProjectID(project string) error {
	if err := (balance.Scope{Kind: balance.ScopeProject, ID: project}).Validate(); err != nil {
		return fmt.Errorf("%w: project id: %w", ErrInvalidLimit, err)
	}
	return nil
}

// AttrID is an entry's key, project or end user id as the hot balance takes it: an id that no
// lim field can hold (a key id from a custom Identify with a ':' in it) is left out, so it can
// never make a settle refuse the entry (no limit can name it anyway).
func AttrID(kind balance.ScopeKind, id string) string {
	if id == "" || (balance.Scope{Kind: kind, ID: id}).Validate() != nil {
		return ""
	}
	return id
}

// The grain of the seed's grouped sum: every window boundary (minute, hour, day, Monday, month,
// all in UTC) is a whole minute, and every one but the minute's a whole hour, so the spend of a
// bucket lies in one window of each limit, and balance.Window.StartMS of the bucket's start is
// that window. Buckets are hours, and minutes from the earliest counted minute window on.
const (
	hourMS   = int64(time.Hour / time.Millisecond)
	minuteMS = int64(time.Minute / time.Millisecond)
)

// SpendRow is the spend of one (key, project, end user, bucket) of an org's charges: their
// cost, their count and their tokens. Start < 0 is a bucket for the entries older than every
// non-lifetime window (only lifetime limits count it). EndUser is "" unless some limit is of
// scope end_user (limitSpan.EndUsers): without one the rows need not be split by end user.
type SpendRow struct {
	Key, Project, EndUser string
	Start                 int64 // the bucket's start, ms (LimitSpan.Bucket)
	Cost                  int64
	Requests              int64
	Tokens                int64
}

// limitSpan is what the grouped sum needs of an org's limits: for each limit the start (ms) of
// the window that contains since, and the earliest such start of the non-lifetime limits
// (older entries matter only to lifetime limits) — from balance.Window, the one rule.
type limitSpan struct {
	limits   []balance.Limit
	from     map[string]int64 // limit id → first window start counted
	Earliest int64            // the earliest non-lifetime start (ms); math.MaxInt64 with none
	// MinuteFrom is the earliest minute limit's counted start (ms): charges from it on are
	// bucketed by minute; math.MaxInt64 with none.
	MinuteFrom int64
	Lifetime   bool     // some limit is lifetime: every entry matters
	Keys       []string // the key ids, project ids and end user ids in the limits' scopes
	Projects   []string
	EndUsers   []string
	Org        bool // some limit is of the org scope: every charge is attributed
	// EachEndUser: some limit is of scope end_user without an id, so every charge with an end
	// user is attributed (to its end user's counter).
	EachEndUser bool
}

// NewLimitSpan is the span of limits ls from since's windows on. A seed's span (forSeed) leaves
// out the lifetime limits of each end user apart (loadedPerEndUser): the seed writes none of
// their per-end-user fields, each one is loaded when a reserve first needs it (EndUserUsed), so a
// seed of an org with a million end users reads no row per end user for them. The operator's
// reports (LimitUsage) keep them.
func NewLimitSpan(ls []balance.Limit, since time.Time, forSeed bool) limitSpan {
	if forSeed && slices.ContainsFunc(ls, loadedPerEndUser) {
		ls = slices.DeleteFunc(slices.Clone(ls), loadedPerEndUser)
	}
	s := limitSpan{limits: ls, from: make(map[string]int64, len(ls)), Earliest: 1<<63 - 1, MinuteFrom: 1<<63 - 1}
	for _, l := range ls {
		start := l.Window.StartMS(since)
		s.from[l.ID] = start
		if l.Window == balance.Minute {
			s.MinuteFrom = min(s.MinuteFrom, start)
		}
		if l.Window == balance.Lifetime {
			s.Lifetime = true
		} else {
			s.Earliest = min(s.Earliest, start)
		}
		switch l.Scope.Kind {
		case balance.ScopeOrg:
			s.Org = true
		case balance.ScopeProject:
			s.Projects = append(s.Projects, l.Scope.ID)
		case balance.ScopeKey:
			s.Keys = append(s.Keys, l.Scope.ID)
		case balance.ScopeEndUser:
			if l.Scope.ID == "" {
				s.EachEndUser = true
			} else {
				s.EndUsers = append(s.EndUsers, l.Scope.ID)
			}
		}
	}
	return s
}

// loadedPerEndUser reports whether l is a lifetime limit of each end user apart: one counter per
// end user ever served, which the seed leaves out (NewLimitSpan) and the hot balance loads per
// end user, as of its watermark, with the ledgers' EndUserUsed.
func loadedPerEndUser(l balance.Limit) bool {
	return l.Window == balance.Lifetime && eachEndUser(l)
}

// CheckEndUserUsed checks the arguments of a ledger's EndUserUsed: a valid org, an end user a
// limit field can hold (AttrID; the seed counts no other), and limits that are all lifetime
// limits of each end user apart (loadedPerEndUser: what the seed leaves out).
func CheckEndUserUsed(org, endUser string, limits []balance.Limit) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	if AttrID(balance.ScopeEndUser, endUser) == "" {
		return fmt.Errorf("%w: end user %q", ErrInvalidLimit, endUser)
	}
	for _, l := range limits {
		if !loadedPerEndUser(l) {
			return fmt.Errorf("%w: limit %s is not a lifetime limit of each end user apart", ErrInvalidLimit, l.ID)
		}
	}
	return nil
}

// Empty reports whether no limit is left to sum (then the grouped sum need not run).
func (s limitSpan) Empty() bool { return len(s.limits) == 0 }

// ByEndUser reports whether the grouped sum must split its rows by end user.
func (s limitSpan) ByEndUser() bool { return s.EachEndUser || len(s.EndUsers) > 0 }

// Used sums the rows into each limit's windows from its first counted one on; a limit of each
// end user apart has one window per end user (WindowUsed.EndUser). Rows come in any order; the
// answer is in limit order, then window start, then end user.
func (s limitSpan) Used(rows []SpendRow) []balance.WindowUsed {
	type k struct {
		id      string
		start   int64
		endUser string
	}
	sums := map[k]int64{}
	var order []k
	for _, r := range rows {
		eu := AttrID(balance.ScopeEndUser, r.EndUser)
		for _, l := range s.limits {
			if !AttributedTo(l, r.Key, r.Project, eu) {
				continue
			}
			var start int64
			if l.Window != balance.Lifetime {
				if r.Start < 0 {
					continue
				}
				start = l.Window.StartMS(time.UnixMilli(r.Start))
			}
			if start < s.from[l.ID] {
				continue
			}
			key := k{l.ID, start, ""}
			if eachEndUser(l) {
				key.endUser = eu
			}
			if _, ok := sums[key]; !ok {
				order = append(order, key)
			}
			switch l.Unit {
			case balance.Requests:
				sums[key] += r.Requests
			case balance.Tokens:
				sums[key] += r.Tokens
			default:
				sums[key] += r.Cost
			}
		}
	}
	out := make([]balance.WindowUsed, 0, len(order))
	for _, l := range s.limits {
		var mine []balance.WindowUsed
		for _, key := range order {
			if key.id == l.ID {
				mine = append(mine, balance.WindowUsed{LimitID: key.id, Start: key.start, EndUser: key.endUser, Used: sums[key]})
			}
		}
		sortUsed(mine)
		out = append(out, mine...)
	}
	return out
}

func sortUsed(u []balance.WindowUsed) {
	slices.SortFunc(u, func(a, b balance.WindowUsed) int {
		return cmp.Or(cmp.Compare(a.Start, b.Start), cmp.Compare(a.EndUser, b.EndUser))
	})
}

// Bucket is the start (ms) of t's bucket for the grouped sum: its minute from MinuteFrom on,
// else its hour; -1: older than every non-lifetime window.
func (s limitSpan) Bucket(t time.Time) int64 {
	ms := t.UnixMilli()
	switch {
	case ms < s.Earliest:
		return -1
	case ms >= s.MinuteFrom:
		return ms - ms%minuteMS
	}
	return ms - ms%hourMS
}
