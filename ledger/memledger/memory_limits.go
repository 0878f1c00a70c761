package memledger

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

var _ balance.LimitLedger = (*Ledger)(nil)

// memLimits is an org's limits, projects and freezes in the memory ledger.
type memLimits struct {
	version  int64
	frozen   bool
	limits   []balance.Limit // live limits, by id
	projects map[string]bool // project → frozen
}

// orgLocked returns the org's account, or ErrUnknownOrg.
func (m *Ledger) orgLocked(org string) (*memAccount, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	a := m.accounts[org]
	if a == nil {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return a, nil
}

// changed raises the org's limits version.
func changed(org string, a *memAccount) ledger.LimitChange {
	a.lims.version++
	return ledger.LimitChange{Org: org, Version: a.lims.version}
}

// CreateProject creates a project of org.
func (m *Ledger) CreateProject(ctx context.Context, org, project string) (ledger.LimitChange, error) {
	if err := ledger.CheckProjectID(project); err != nil {
		return ledger.LimitChange{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil {
		return ledger.LimitChange{}, err
	}
	if _, ok := a.lims.projects[project]; ok {
		return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrProjectExists, project)
	}
	if a.lims.projects == nil {
		a.lims.projects = map[string]bool{}
	}
	a.lims.projects[project] = false
	return changed(org, a), nil
}

// SetKeyProject puts the key in a project of its org ("" for none).
func (m *Ledger) SetKeyProject(ctx context.Context, keyID, project string) (ledger.LimitChange, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys[keyID]
	if k == nil {
		return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownKey, keyID)
	}
	a, err := m.orgLocked(k.key.Org)
	if err != nil {
		return ledger.LimitChange{}, err
	}
	if _, ok := a.lims.projects[project]; project != "" && !ok {
		return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownProject, project)
	}
	k.project = project
	return changed(k.key.Org, a), nil
}

// CreateLimit adds a limit with a new id.
func (m *Ledger) CreateLimit(ctx context.Context, org string, l balance.Limit) (balance.Limit, ledger.LimitChange, error) {
	if err := ledger.CheckLimit(l); err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	if err := m.scopeLocked(org, a, l.Scope); err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	if len(a.lims.limits) >= ledger.MaxLimits {
		return balance.Limit{}, ledger.LimitChange{}, fmt.Errorf("%w: an org has at most %d limits", ledger.ErrInvalidLimit, ledger.MaxLimits)
	}
	m.lastLimit++
	l.ID = strconv.FormatInt(m.lastLimit, 10)
	a.lims.limits = append(a.lims.limits, l)
	return l, changed(org, a), nil
}

// scopeLocked checks that the scope's project or key is the org's.
func (m *Ledger) scopeLocked(org string, a *memAccount, s balance.Scope) error {
	switch s.Kind {
	case balance.ScopeProject:
		if _, ok := a.lims.projects[s.ID]; !ok {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownProject, s.ID)
		}
	case balance.ScopeKey:
		if k := m.keys[s.ID]; k == nil || k.key.Org != org {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, s.ID)
		}
	}
	return nil
}

// limitLocked returns the index of the org's live limit id.
func (m *Ledger) limitLocked(org, id string) (*memAccount, int, error) {
	a, err := m.orgLocked(org)
	if err != nil {
		return nil, 0, err
	}
	i := slices.IndexFunc(a.lims.limits, func(l balance.Limit) bool { return l.ID == id })
	if i < 0 {
		return nil, 0, fmt.Errorf("%w: %q", ledger.ErrUnknownLimit, id)
	}
	return a, i, nil
}

// SetLimitCap changes a limit's cap.
func (m *Ledger) SetLimitCap(ctx context.Context, org, id string, cap int64) (balance.Limit, ledger.LimitChange, error) {
	if err := ledger.CheckCap(cap); err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a, i, err := m.limitLocked(org, id)
	if err != nil {
		return balance.Limit{}, ledger.LimitChange{}, err
	}
	a.lims.limits[i].Cap = cap
	return a.lims.limits[i], changed(org, a), nil
}

// DeleteLimit deletes a limit; its id is never used again.
func (m *Ledger) DeleteLimit(ctx context.Context, org, id string) (ledger.LimitChange, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a, i, err := m.limitLocked(org, id)
	if err != nil {
		return ledger.LimitChange{}, err
	}
	for k := range a.windows { // a deleted limit never fires
		if k.limit == id {
			delete(a.windows, k)
		}
	}
	a.lims.limits = slices.Delete(a.lims.limits, i, i+1)
	return changed(org, a), nil
}

// SetFrozen freezes or unfreezes the org, a project or a key.
func (m *Ledger) SetFrozen(ctx context.Context, org string, s balance.Scope, frozen bool) (ledger.LimitChange, error) {
	if err := s.Validate(); err != nil {
		return ledger.LimitChange{}, fmt.Errorf("%w: %w", ledger.ErrInvalidLimit, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if s.Kind == balance.ScopeKey {
		k := m.keys[s.ID]
		if k == nil || (org != "" && k.key.Org != org) {
			return ledger.LimitChange{}, fmt.Errorf("%w: %q", ledger.ErrUnknownKey, s.ID)
		}
		a, err := m.orgLocked(k.key.Org)
		if err != nil {
			return ledger.LimitChange{}, err
		}
		k.frozen = frozen
		return changed(k.key.Org, a), nil
	}
	a, err := m.orgLocked(org)
	if err != nil {
		return ledger.LimitChange{}, err
	}
	if err := m.scopeLocked(org, a, s); err != nil {
		return ledger.LimitChange{}, err
	}
	if s.Kind == balance.ScopeOrg {
		a.lims.frozen = frozen
	} else {
		a.lims.projects[s.ID] = frozen
	}
	return changed(org, a), nil
}

// Limits returns the org's limits, freezes and key → project map.
func (m *Ledger) Limits(ctx context.Context, org string) (balance.Limits, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, err := m.orgLocked(org); err != nil {
		return balance.Limits{}, err
	}
	return m.limitsLocked(org), nil
}

// limitsLocked is Limits of an org (zero for an org without an account).
func (m *Ledger) limitsLocked(org string) balance.Limits {
	a := m.accounts[org]
	if a == nil {
		return balance.Limits{}
	}
	ls := balance.Limits{Version: a.lims.version, Limits: slices.Clone(a.lims.limits)}
	if a.lims.frozen {
		ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeOrg})
	}
	for _, p := range slices.Sorted(maps.Keys(a.lims.projects)) {
		if a.lims.projects[p] {
			ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeProject, ID: p})
		}
	}
	var keys []string
	for id, k := range m.keys {
		if k.key.Org == org && !k.revoked && (k.frozen || k.project != "") {
			keys = append(keys, id)
		}
	}
	slices.Sort(keys)
	for _, id := range keys {
		k := m.keys[id]
		if k.frozen {
			ls.Frozen = append(ls.Frozen, balance.Scope{Kind: balance.ScopeKey, ID: id})
		}
		if k.project != "" {
			if ls.Projects == nil {
				ls.Projects = map[string]string{}
			}
			ls.Projects[id] = k.project
		}
	}
	return ls
}

// LimitUsage is the spend of the org's limits' windows from since's on (nothing written).
func (m *Ledger) LimitUsage(ctx context.Context, org string, since time.Time, maxSeq int64) ([]balance.WindowUsed, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil {
		return nil, err
	}
	if maxSeq < 0 {
		maxSeq = int64(len(a.entries))
	}
	return a.usedLocked(a.lims.limits, since, maxSeq, false), nil
}

// usedLocked sums the charges with seq ≤ maxSeq into the limits' windows from since's on.
func (a *memAccount) usedLocked(limits []balance.Limit, since time.Time, maxSeq int64, forSeed bool) []balance.WindowUsed {
	span := ledger.NewLimitSpan(limits, since, forSeed)
	if span.Empty() {
		return nil
	}
	type k struct {
		key, project, endUser string
		start                 int64
	}
	sums := map[k]*ledger.SpendRow{}
	for _, e := range a.entries[:min(maxSeq, int64(len(a.entries)))] {
		at, ok := a.attr[e.Seq]
		if e.Kind != ledger.KindCharge || !ok {
			continue
		}
		g := k{key: at.key, project: at.project, start: span.Bucket(at.at)}
		if span.ByEndUser() {
			g.endUser = at.endUser
		}
		r := sums[g]
		if r == nil {
			r = &ledger.SpendRow{Key: g.key, Project: g.project, EndUser: g.endUser, Start: g.start}
			sums[g] = r
		}
		r.Cost, r.Requests, r.Tokens = r.Cost-e.Delta, r.Requests+1, r.Tokens+at.tokens
	}
	rows := make([]ledger.SpendRow, 0, len(sums))
	for _, r := range sums {
		rows = append(rows, *r)
	}
	return span.Used(rows)
}

// winKey is one window of one limit (of one end user, for a limit of each end user apart) in
// memAccount.windows.
type winKey struct {
	limit   string
	start   int64 // ms since the Unix epoch (0 for lifetime)
	endUser string
}

// chargeWindowsLocked moves the spend of the limits' windows by a batch of charges just
// written after entry base (the memory ledger's limit_windows) and emits limit.crossed for each
// threshold a window crosses, under the lock that wrote the charges.
func (m *Ledger) chargeWindowsLocked(org string, a *memAccount, base int64, charges []ledger.ChargeAttr, now time.Time) {
	if a.windows == nil {
		a.windows = map[winKey]int64{}
	}
	for _, w := range ledger.WindowIncs(a.lims.limits, charges, now) {
		k := winKey{w.Limit.ID, w.Start.UnixMilli(), w.EndUser}
		before, ok := a.windows[k]
		if !ok { // the window's first batch: its charges so far, then drop the limit's past windows
			before = a.spentLocked(w, base)
			for old := range a.windows {
				if old.limit == k.limit && old.start < w.Current.UnixMilli() {
					delete(a.windows, old)
				}
			}
		}
		after := before + w.Inc
		a.windows[k] = after
		for _, pct := range ledger.CrossedUp(before, after, w.Limit.Cap) {
			m.hooks.emit(ledger.EventLimitCrossed, org, ledger.NewLimitCrossedData(w, after, pct))
		}
	}
}

// spentLocked sums the charges with seq ≤ maxSeq attributed to w's limit in w's window (of w's
// end user, for a limit of each end user apart).
func (a *memAccount) spentLocked(w ledger.WindowInc, maxSeq int64) int64 {
	var sum int64
	for _, e := range a.entries[:min(maxSeq, int64(len(a.entries)))] {
		at, ok := a.attr[e.Seq]
		eu := ledger.AttrID(balance.ScopeEndUser, at.endUser)
		if w.EndUser != "" && eu != w.EndUser {
			continue
		}
		if e.Kind == ledger.KindCharge && ok && ledger.AttributedTo(w.Limit, at.key, at.project, eu) && !at.at.Before(w.Start) && at.at.Before(w.Next) {
			sum += w.Limit.Unit.Count(-e.Delta, at.tokens)
		}
	}
	return sum
}

// EndUserUsed is endUser's spend of each of limits (the org's lifetime limits of each end user
// apart, ledger.CheckEndUserUsed) as of the org's entry upto: Σ of the end user's charges with
// seq ≤ upto in each limit's unit, what a seed at seq upto would have given that end user's
// field (pgledger's EndUserUsed). The memory ledger sums the entries. An org without an account
// is ErrUnknownOrg (as Snapshot); an end user no limit can name, or a limit of another kind, is
// ErrInvalidLimit.
func (m *Ledger) EndUserUsed(ctx context.Context, org, endUser string, limits []balance.Limit, upto int64) ([]balance.WindowUsed, error) {
	if err := ledger.CheckEndUserUsed(org, endUser, limits); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil || len(limits) == 0 {
		return nil, err
	}
	var cost, n, tokens int64
	for _, e := range a.entries[:max(0, min(upto, int64(len(a.entries))))] {
		at, ok := a.attr[e.Seq]
		if e.Kind == ledger.KindCharge && ok && at.endUser == endUser {
			cost, n, tokens = cost-e.Delta, n+1, tokens+at.tokens
		}
	}
	out := make([]balance.WindowUsed, len(limits))
	for i, l := range limits {
		used := cost
		switch l.Unit {
		case balance.Requests:
			used = n
		case balance.Tokens:
			used = tokens
		}
		out[i] = balance.WindowUsed{LimitID: l.ID, EndUser: endUser, Used: used}
	}
	return out, nil
}
