package accounting

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// The operator's limit operations: each writes the ledger, then pushes the new limits version
// to the hot balance (balance.Store.PushLimits) before it returns, so the org's next request
// anywhere meets the change (a freeze refuses it at once). When only the push failed, the
// change is durable, the error wraps ErrHotBalance, and the reconciler pushes it later.

// push sends a durable change to the hot balance. The store learns the ledger's epoch first:
// the push's floor (which refuses seeds of snapshots older than the change) is kept per epoch.
func (o *Ops) push(ctx context.Context, c ledger.LimitChange) error {
	if _, err := o.SyncEpoch(ctx); err != nil {
		return fmt.Errorf("%w: limits of %s (version %d) not pushed: %w", ErrHotBalance, c.Org, c.Version, err)
	}
	// The limits as the ledger has them now (c.Version or a later change's): the push writes
	// them whole, and keeps a newer version already in Redis.
	ls, err := o.ledger.Limits(ctx, c.Org)
	if err != nil {
		return fmt.Errorf("%w: limits of %s (version %d) not pushed: %w", ErrHotBalance, c.Org, c.Version, err)
	}
	dropped, err := o.store.PushLimits(ctx, c.Org, ls)
	if err != nil {
		return fmt.Errorf("%w: limits of %s (version %d) not pushed: %w", ErrHotBalance, c.Org, c.Version, err)
	}
	if dropped {
		// Reseed at once, so that the limits' counters count the holds in flight (seed.lua) and
		// a listing right after the change shows them; on failure the org's next request does.
		_ = o.store.Warm(ctx, c.Org)
	}
	return nil
}

// CreateProject creates a project (a named group of the org's keys).
func (o *Ops) CreateProject(ctx context.Context, org, project string) error {
	c, err := o.ledger.CreateProject(ctx, org, project)
	if err != nil {
		return err
	}
	return o.push(ctx, c)
}

// SetKeyProject puts a key in a project of its org, or in none when project is "".
func (o *Ops) SetKeyProject(ctx context.Context, keyID, project string) error {
	c, err := o.ledger.SetKeyProject(ctx, keyID, project)
	if err != nil {
		return err
	}
	return o.push(ctx, c)
}

// CreateLimit adds a money limit (scope × window × cap in micro-units) and returns it with its
// id (AddLimit for requests and tokens limits).
func (o *Ops) CreateLimit(ctx context.Context, org string, scope balance.Scope, w balance.Window, cap int64) (balance.Limit, error) {
	return o.AddLimit(ctx, org, balance.Limit{Scope: scope, Window: w, Cap: cap})
}

// AddLimit adds the limit l describes (its Scope, Window, Unit and Cap; its ID is given by the
// ledger) and returns it with its id, once pushed to the hot balance.
func (o *Ops) AddLimit(ctx context.Context, org string, l balance.Limit) (balance.Limit, error) {
	l, c, err := o.ledger.CreateLimit(ctx, org, l)
	if err != nil {
		return l, err
	}
	return l, o.push(ctx, c)
}

// SetLimitCap changes a limit's cap. A cap below what is used refuses new holds in scope; it
// never moves money.
func (o *Ops) SetLimitCap(ctx context.Context, org, id string, cap int64) (balance.Limit, error) {
	l, c, err := o.ledger.SetLimitCap(ctx, org, id, cap)
	if err != nil {
		return l, err
	}
	return l, o.push(ctx, c)
}

// DeleteLimit deletes a limit.
func (o *Ops) DeleteLimit(ctx context.Context, org, id string) error {
	c, err := o.ledger.DeleteLimit(ctx, org, id)
	if err != nil {
		return err
	}
	return o.push(ctx, c)
}

// Freeze refuses every new hold of the scope (the org, one of its projects or keys) from the
// next request on; holds in flight finish normally. For a key, org may be "".
func (o *Ops) Freeze(ctx context.Context, org string, scope balance.Scope) error {
	return o.setFrozen(ctx, org, scope, true)
}

// Unfreeze lifts a freeze.
func (o *Ops) Unfreeze(ctx context.Context, org string, scope balance.Scope) error {
	return o.setFrozen(ctx, org, scope, false)
}

func (o *Ops) setFrozen(ctx context.Context, org string, scope balance.Scope, frozen bool) error {
	c, err := o.ledger.SetFrozen(ctx, org, scope, frozen)
	if err != nil {
		return err
	}
	return o.push(ctx, c)
}

// LimitView is a limit with the state of its current window.
type LimitView struct {
	ID      string            `json:"id"`
	Scope   balance.ScopeKind `json:"scope"`
	ScopeID string            `json:"scope_id,omitempty"` // the project, key or end user; absent for the org and each end user apart
	Window  balance.Window    `json:"window"`
	Unit    string            `json:"unit,omitempty"` // requests or tokens (absent: money): what Cap, Used and Held count
	Cap     int64             `json:"cap"`
	// Used is the current window's counter: the cost of the charges attributed to it plus what
	// its requests in flight hold (from the hot balance when the org is warm, else the
	// ledger's charges). It may exceed Cap only by real costs beyond their holds, or after the
	// cap was lowered.
	Used int64 `json:"used"`
	// Held is the part of Used held by requests in flight (0 when the org is cold).
	Held     int64      `json:"held"`
	ResetsAt *time.Time `json:"resets_at"` // the next window's start; null for lifetime
	// EndUsers, for a limit of each end user apart (scope end_user without an id), is how many
	// end users have a counter in its current window (LimitEndUsers lists them); Used and Held
	// are then those of the end user who used the most, the nearest to the cap. Absent for
	// every other limit.
	EndUsers *int `json:"end_users,omitempty"`
	// RequireEndUser: the limit refuses the org's requests that name no end user.
	RequireEndUser bool `json:"require_end_user,omitempty"`
}

// EndUserUsed is one end user's counter of a limit of each end user apart in its current window
// (LimitView's Used and Held, for that end user).
type EndUserUsed struct {
	EndUser string `json:"end_user"`
	Used    int64  `json:"used"`
	Held    int64  `json:"held"`
}

// eachEndUser: l has one counter per end user (scope end_user without an id).
func eachEndUser(l balance.Limit) bool {
	return l.Scope.Kind == balance.ScopeEndUser && l.Scope.ID == ""
}

// ListLimits lists the org's limits (by id) with their current windows, on the Redis clock.
// While Redis does not answer, the windows are those of this process's clock and the numbers
// the ledger's (Held 0): a report, not an error.
func (o *Ops) ListLimits(ctx context.Context, org string) ([]LimitView, error) {
	return o.listLimits(ctx, org, false)
}

// windowReader is a ledger that reads its limits' windows as its account pass keeps them
// (pgledger's and memledger's LimitWindows): the customer views read those rather than sum the
// windows' charges (issue 34).
type windowReader interface {
	LimitWindows(ctx context.Context, org string) ([]balance.WindowUsed, error)
}

// listLimits is ListLimits; kept reads the ledger's part from the windows the ledger keeps when
// it can (a customer view: a few rows, never the charges; the windows are at the ledger's last
// charge rather than the hot watermark, so a held amount is clamped at 0).
func (o *Ops) listLimits(ctx context.Context, org string, kept bool) ([]LimitView, error) {
	st, err := o.limitState(ctx, org, kept)
	if err != nil {
		return nil, err
	}
	out := make([]LimitView, 0, len(st.limits))
	for _, l := range st.limits {
		v := LimitView{ID: l.ID, Scope: l.Scope.Kind, ScopeID: l.Scope.ID, Window: l.Window, Unit: string(l.Unit), Cap: l.Cap, RequireEndUser: l.RequireEndUser}
		if eachEndUser(l) {
			us := st.endUsers(l)
			n := len(us)
			v.EndUsers = &n
			for _, u := range us {
				if u.Used > v.Used {
					v.Used, v.Held = u.Used, u.Held
				}
			}
		} else {
			v.Used, v.Held = st.used(balance.Counter{LimitID: l.ID, Start: l.Window.StartMS(st.now)})
		}
		if l.Window != balance.Lifetime {
			_, next := l.Window.Bounds(st.now)
			v.ResetsAt = &next
		}
		out = append(out, v)
	}
	return out, nil
}

// LimitEndUsers lists, by end user id, the end users with a counter in the current window of
// the org's limit id, a limit of each end user apart (ErrUnknownLimit; another limit is
// ErrInvalidLimit), with what each used and holds, as ListLimits reads them. A page starts after
// q.Cursor's end user.
func (o *Ops) LimitEndUsers(ctx context.Context, org, id string, q ledger.ListQuery) (ledger.Page[EndUserUsed], error) {
	after, err := ledger.ParseEndUserCursor(q.Cursor)
	if err != nil {
		return ledger.Page[EndUserUsed]{}, err
	}
	st, err := o.limitState(ctx, org, false)
	if err != nil {
		return ledger.Page[EndUserUsed]{}, err
	}
	i := slices.IndexFunc(st.limits, func(l balance.Limit) bool { return l.ID == id })
	if i < 0 {
		return ledger.Page[EndUserUsed]{}, fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
	}
	if !eachEndUser(st.limits[i]) {
		return ledger.Page[EndUserUsed]{}, fmt.Errorf("%w: limit %s is not of each end user apart (scope end_user without an id)", ledger.ErrInvalidLimit, id)
	}
	us := st.endUsers(st.limits[i])
	us = us[sort.Search(len(us), func(j int) bool { return us[j].EndUser > after }):]
	limit := ledger.PageLimit(q.Limit)
	return ledger.PageOf(us[:min(len(us), limit+1)], limit, func(u EndUserUsed) string { return ledger.EndUserCursor(u.EndUser) }), nil
}

// limitState is what a listing of the org's limits reads: the limits, the Redis clock (this
// process's while Redis does not answer), the hot counters when the org is warm, and the
// ledger's spend of the current windows (up to the counters' watermark when warm).
type limitState struct {
	limits []balance.Limit
	now    time.Time
	warm   bool
	hot    map[balance.Counter]int64
	ledger map[balance.Counter]int64
	// kept: ledger holds the windows the ledger keeps (windowReader), where a window no batch
	// has charged since its limit was made has no row: its held part is not known (0).
	kept bool
}

func (o *Ops) limitState(ctx context.Context, org string, kept bool) (limitState, error) {
	ls, err := o.ledger.Limits(ctx, org)
	if err != nil || len(ls.Limits) == 0 {
		return limitState{}, err
	}
	st := limitState{limits: ls.Limits}
	var wm int64
	st.now, err = o.store.Now(ctx) // without Redis: this process's clock
	if err == nil {
		st.hot, wm, st.warm, err = o.hotCounters(ctx, org)
	}
	if err != nil {
		if ctx.Err() != nil {
			return limitState{}, ctx.Err()
		}
		st.warm = false
	}
	maxSeq := int64(-1)
	if st.warm {
		maxSeq = wm
	}
	var lu []balance.WindowUsed
	if wr, ok := o.ledger.(windowReader); kept && ok {
		st.kept = true
		lu, err = wr.LimitWindows(ctx, org)
	} else {
		lu, err = o.ledger.LimitUsage(ctx, org, st.now, maxSeq)
	}
	if err != nil {
		return limitState{}, err
	}
	st.ledger = make(map[balance.Counter]int64, len(lu))
	for _, u := range lu {
		st.ledger[balance.Counter{LimitID: u.LimitID, Start: u.Start, EndUser: u.EndUser}] = u.Used
	}
	return st, nil
}

// used is a counter's used and held: the hot counter when the org is warm (U = the charges up
// to the watermark + the live holds added to it), else the ledger's spend.
func (st limitState) used(k balance.Counter) (used, held int64) {
	if u, ok := st.hot[k]; ok && st.warm {
		l, found := st.ledger[k]
		if !found && st.kept {
			return u, 0
		}
		return u, max(u-l, 0)
	}
	return st.ledger[k], 0
}

// endUsers lists the end users with a counter in l's current window, in the ledger's spend or
// the hot state, by end user id.
func (st limitState) endUsers(l balance.Limit) []EndUserUsed {
	start := l.Window.StartMS(st.now)
	seen := map[string]bool{}
	var out []EndUserUsed
	add := func(cs map[balance.Counter]int64) {
		for k := range cs {
			if k.LimitID == l.ID && k.Start == start && k.EndUser != "" && !seen[k.EndUser] {
				seen[k.EndUser] = true
				u := EndUserUsed{EndUser: k.EndUser}
				u.Used, u.Held = st.used(k)
				out = append(out, u)
			}
		}
	}
	add(st.ledger)
	if st.warm {
		add(st.hot)
	}
	slices.SortFunc(out, func(a, b EndUserUsed) int { return strings.Compare(a.EndUser, b.EndUser) })
	return out
}

// hotCounters reads the org's window counters and the watermark they go with: warm is false
// when the org has no hot balance. The watermark is read before and after the counters, and
// the read is repeated if a settle moved it in between.
func (o *Ops) hotCounters(ctx context.Context, org string) (map[balance.Counter]int64, int64, bool, error) {
	for range 5 {
		st, err := o.store.State(ctx, org)
		if err != nil {
			return nil, 0, false, fmt.Errorf("%w: %w", ErrHotBalance, err)
		}
		if !st.Exists {
			return nil, 0, false, nil
		}
		cs, err := o.store.Counters(ctx, org)
		if err != nil {
			return nil, 0, false, fmt.Errorf("%w: %w", ErrHotBalance, err)
		}
		st2, err := o.store.State(ctx, org)
		if err != nil {
			return nil, 0, false, fmt.Errorf("%w: %w", ErrHotBalance, err)
		}
		if st2.Exists && st2.Watermark == st.Watermark && st2.Epoch == st.Epoch {
			return cs, st.Watermark, true, nil
		}
	}
	return nil, 0, false, nil // busy: the ledger's numbers
}
