package memledger

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
)

var _ grant.Store = (*Ledger)(nil)

// memGrants are an org's credit grants (pgledger: the grants table of migration 026) and what
// the hot balance is told about them per entry.
type memGrants struct {
	list     []grant.Grant
	expiring bool                // the org has had a grant that expires: its reads carry rests
	marks    map[int64]grantMark // by entry seq
}

// grantMark is what an entry is to the grants: a credit of a grant that expires at expires, or
// the expire entry of a grant of expired (last: the last of that time's).
type grantMark struct {
	expires, expired time.Time
	last             bool
}

func (g *memGrants) add(org string, e ledger.LedgerEntry, o grant.Options) {
	g.list = append(g.list, grant.Grant{Org: org, Seq: e.Seq, Reference: e.Ref, Amount: e.Delta, Priority: o.Priority,
		ExpiresAt: o.ExpiresAt, Rest: e.Delta, CreatedAt: e.CreatedAt})
	if !o.ExpiresAt.IsZero() {
		g.expiring = true
		g.setMark(e.Seq, grantMark{expires: o.ExpiresAt})
	}
}

func (g *memGrants) setMark(seq int64, k grantMark) {
	if g.marks == nil {
		g.marks = map[int64]grantMark{}
	}
	g.marks[seq] = k
}

func (g *memGrants) sameTerms(seq int64, o grant.Options) bool {
	for _, x := range g.list {
		if x.Seq == seq {
			return x.Priority == o.Priority && x.ExpiresAt.Equal(o.ExpiresAt)
		}
	}
	return o == grant.Paid // a credit written before it was a grant
}

func (g *memGrants) spend(cost int64, at time.Time) { grant.Spend(g.list, cost, at) }

func (g *memGrants) mark(e *balance.Entry) {
	k, ok := g.marks[e.Seq]
	if !ok {
		return
	}
	e.GrantExpiry, e.Expired, e.LastOfExpiry = k.expires, k.expired, k.last
}

// expiries are the rests per expiry now, nil for an org that never had a grant that expires.
func (g *memGrants) expiries() *map[int64]int64 {
	if !g.expiring {
		return nil
	}
	d := grant.Due(g.list)
	return &d
}

// CreditGrant credits amount with grant terms o, idempotent by ref like Credit.
func (m *Ledger) CreditGrant(ctx context.Context, org string, amount int64, ref string, o grant.Options) (ledger.LedgerEntry, bool, error) {
	if amount <= 0 || amount > balance.MaxAmount {
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: credit %d", ledger.ErrInvalidAmount, amount)
	}
	if err := o.Check(time.Now()); err != nil {
		return ledger.LedgerEntry{}, false, err
	}
	o.ExpiresAt = truncMS(o.ExpiresAt)
	return m.write(org, ledger.KindCredit, amount, ref, &o)
}

// truncMS is t to the millisecond (the hot balance's clock), in UTC.
func truncMS(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return time.UnixMilli(t.UnixMilli()).UTC()
}

// Grants lists the org's grants in spending order, the expired last.
func (m *Ledger) Grants(ctx context.Context, org string) ([]grant.Grant, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil {
		return nil, err
	}
	return grant.Sorted(a.grants.list), nil
}

// DueGrants lists the orgs with grants expired by upTo and no expire entry yet.
func (m *Ledger) DueGrants(ctx context.Context, upTo time.Time, limit int) (map[string]time.Time, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]time.Time{}
	for _, org := range slices.Sorted(maps.Keys(m.accounts)) {
		for _, g := range m.accounts[org].grants.list {
			if !g.Expired && !g.ExpiresAt.IsZero() && !g.ExpiresAt.After(upTo) {
				if _, ok := out[org]; !ok && len(out) >= limit {
					return out, nil
				}
				if g.ExpiresAt.After(out[org]) {
					out[org] = g.ExpiresAt
				}
			}
		}
	}
	return out, nil
}

// ExpireGrants accounts the org's pending usage, then writes the expire entries of its grants
// expired by upTo.
func (m *Ledger) ExpireGrants(ctx context.Context, org string, upTo time.Time) (int, error) {
	m.mu.Lock()
	a, err := m.orgLocked(org)
	if err != nil {
		m.mu.Unlock()
		return 0, err
	}
	if _, err := m.accountOrgLocked(org, -1, nil); err != nil {
		m.mu.Unlock()
		return 0, err
	}
	n := m.expireOrgLocked(org, a, upTo)
	m.mu.Unlock()
	if n > 0 {
		m.notify(org)
	}
	return n, nil
}

func (m *Ledger) expireOrgLocked(org string, a *memAccount, upTo time.Time) int {
	var due []int
	for i, g := range a.grants.list {
		if !g.Expired && !g.ExpiresAt.IsZero() && !g.ExpiresAt.After(upTo) {
			due = append(due, i)
		}
	}
	if len(due) == 0 {
		return 0
	}
	// By expiry time, then grant: each time's entries together, its last one marked.
	slices.SortFunc(due, func(x, y int) int {
		gx, gy := a.grants.list[x], a.grants.list[y]
		if c := gx.ExpiresAt.Compare(gy.ExpiresAt); c != 0 {
			return c
		}
		return int(gx.Seq - gy.Seq)
	})
	now := time.Now()
	for j, i := range due {
		g := &a.grants.list[i]
		e := ledger.LedgerEntry{Org: org, Seq: int64(len(a.entries)) + 1, Delta: -g.Rest, Kind: grant.KindExpire,
			Ref: grant.ExpireRef(org, g.Seq), CreatedAt: now}
		a.entries = append(a.entries, e)
		a.balance -= g.Rest
		m.refs[refKey{grant.KindExpire, e.Ref}] = e
		last := j == len(due)-1 || !a.grants.list[due[j+1]].ExpiresAt.Equal(g.ExpiresAt)
		a.grants.setMark(e.Seq, grantMark{expired: g.ExpiresAt, last: last})
		m.hooks.balanceChanged(org, a.balance+g.Rest, a.balance)
		g.ExpiredAmount, g.Rest, g.Expired = g.Rest, 0, true
	}
	return len(due)
}
