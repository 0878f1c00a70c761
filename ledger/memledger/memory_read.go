package memledger

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// memConsole is the memory ledger's console state; Memory.mu guards it.
type memConsole struct {
	orgNames map[string]string
	keyNames map[string]string
	audit    []ledger.AuditRecord // by ID (1, 2, 3 …)
}

var _ ledger.Console = (*Ledger)(nil)

func (m *Ledger) orgInfoLocked(id string, a *memAccount) ledger.OrgInfo {
	return ledger.OrgInfo{
		ID: id, Name: m.console.orgNames[id], Balance: a.balance, LedgerSeq: int64(len(a.entries)),
		SettledSeq: a.settled, CreatedAt: a.created.UTC().Truncate(time.Microsecond), Exempt: a.exempt,
	}
}

// ListOrgs lists orgs by id.
func (m *Ledger) ListOrgs(ctx context.Context, q ledger.ListQuery) (ledger.Page[ledger.OrgInfo], error) {
	after, err := ledger.ParseOrgCursor(q.Cursor)
	if err != nil {
		return ledger.Page[ledger.OrgInfo]{}, err
	}
	limit := ledger.PageLimit(q.Limit)
	m.mu.Lock()
	defer m.mu.Unlock()
	var ids []string
	for id := range m.accounts {
		if id > after {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	var p ledger.Page[ledger.OrgInfo]
	for _, id := range ids {
		if len(p.Data) == limit {
			p.Next = ledger.OrgCursor(p.Data[limit-1].ID)
			break
		}
		p.Data = append(p.Data, m.orgInfoLocked(id, m.accounts[id]))
	}
	return p, nil
}

// Org returns one org.
func (m *Ledger) Org(ctx context.Context, org string) (ledger.OrgInfo, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.OrgInfo{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return ledger.OrgInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return m.orgInfoLocked(org, a), nil
}

// SetOrgName sets an org's display name.
func (m *Ledger) SetOrgName(ctx context.Context, org, name string) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	if err := ledger.CheckName(name); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	if m.console.orgNames == nil {
		m.console.orgNames = map[string]string{}
	}
	m.console.orgNames[org] = name
	return nil
}

// ListKeys lists an org's keys by (creation time, id).
func (m *Ledger) ListKeys(ctx context.Context, org string, q ledger.ListQuery) (ledger.Page[ledger.KeyInfo], error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Page[ledger.KeyInfo]{}, err
	}
	var afterT time.Time
	afterID := ""
	if q.Cursor != "" {
		var err error
		if afterT, afterID, err = ledger.ParseKeyCursor(q.Cursor); err != nil {
			return ledger.Page[ledger.KeyInfo]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] == nil {
		return ledger.Page[ledger.KeyInfo]{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	var ks []*memKey
	for _, k := range m.keys {
		if k.key.Org != org {
			continue
		}
		if q.Cursor != "" && cmp.Or(k.created.Compare(afterT), cmp.Compare(k.key.ID, afterID)) <= 0 {
			continue
		}
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b *memKey) int {
		return cmp.Or(a.created.Compare(b.created), cmp.Compare(a.key.ID, b.key.ID))
	})
	var p ledger.Page[ledger.KeyInfo]
	for _, k := range ks {
		if len(p.Data) == limit {
			last := p.Data[limit-1]
			p.Next = ledger.KeyCursor(last.CreatedAt, last.ID)
			break
		}
		ki := ledger.KeyInfo{ID: k.key.ID, Org: org, Name: m.console.keyNames[k.key.ID], CreatedAt: k.created, Project: k.project, Frozen: k.frozen,
			Models: k.key.Models}
		if k.revoked {
			at := k.revAt
			ki.RevokedAt = &at
		}
		if !k.used.IsZero() {
			at := k.used
			ki.LastUsedAt = &at
		}
		p.Data = append(p.Data, ki)
	}
	return p, nil
}

// SetKeyName sets a key's display name.
func (m *Ledger) SetKeyName(ctx context.Context, id, name string) error {
	if err := ledger.CheckName(name); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.keys[id] == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, id)
	}
	if m.console.keyNames == nil {
		m.console.keyNames = map[string]string{}
	}
	m.console.keyNames[id] = name
	return nil
}

// ListEntries lists an org's entries, newest first.
func (m *Ledger) ListEntries(ctx context.Context, org string, q ledger.EntryQuery) (ledger.Page[ledger.EntryInfo], error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Page[ledger.EntryInfo]{}, err
	}
	if err := q.Check(); err != nil {
		return ledger.Page[ledger.EntryInfo]{}, err
	}
	before := int64(-1)
	if q.Cursor != "" {
		var err error
		if before, err = ledger.ParseSeqCursor(q.Cursor, "entry"); err != nil {
			return ledger.Page[ledger.EntryInfo]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return ledger.Page[ledger.EntryInfo]{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	var p ledger.Page[ledger.EntryInfo]
	top := int64(len(a.entries))
	if before >= 0 {
		top = min(top, before-1)
	}
	for seq := top; seq >= 1; seq-- {
		e := a.entries[seq-1]
		if (q.Kind != "" && e.Kind != q.Kind) || !inRange(m.entryTime(e), q.From, q.To) {
			continue
		}
		if len(p.Data) == limit {
			p.Next = ledger.EntryCursor(p.Data[limit-1].Seq)
			break
		}
		e.CreatedAt = e.CreatedAt.UTC().Truncate(time.Microsecond)
		ei := ledger.EntryInfo{LedgerEntry: e}
		if ev := m.events[e.HoldID]; e.Kind == ledger.KindCharge && ev != nil {
			ei.Request = &ledger.EntryRequest{ID: ev.ev.ID, KeyID: ev.ev.KeyID, Project: ev.ev.Project, EndUser: ev.ev.EndUser, Model: ev.ev.Model, Usage: ev.ev.Usage,
				Cost: ev.ev.Cost, HoldAmount: ev.ev.HoldAmount, Estimated: ev.ev.Estimated}
		}
		p.Data = append(p.Data, ei)
	}
	return p, nil
}

// TopSpenders sums the accounted usage in the range per org and keeps the largest.
func (m *Ledger) TopSpenders(ctx context.Context, q ledger.TopQuery) ([]ledger.UsageRow, error) {
	if err := q.Check(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := []ledger.UsageRow{}
	for org, a := range m.accounts {
		r := ledger.UsageRow{Group: org}
		for _, e := range a.entries {
			ev := m.events[e.HoldID]
			if e.Kind != ledger.KindCharge || ev == nil || !inRange(attrTime(ev.ev.ReservedAt, ev.ev.CreatedAt), q.From, q.To) {
				continue
			}
			addUsage(&r, -e.Delta, ev.ev.Usage)
		}
		if r.Requests > 0 {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b ledger.UsageRow) int {
		if c := cmp.Compare(b.Cost, a.Cost); c != 0 {
			return c
		}
		return strings.Compare(a.Group, b.Group)
	})
	return out[:min(len(out), q.Limit)], nil
}

// UsageReport sums the org's accounted usage per group, in group order.
func (m *Ledger) UsageReport(ctx context.Context, org string, q ledger.UsageQuery) ([]ledger.UsageRow, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	if err := q.Check(); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	rows := map[string]*ledger.UsageRow{}
	for _, e := range a.entries {
		ev := m.events[e.HoldID]
		at := attrTime(ev0(ev).ReservedAt, ev0(ev).CreatedAt)
		if e.Kind != ledger.KindCharge || ev == nil || !inRange(at, q.From, q.To) {
			continue
		}
		var g string
		switch q.GroupBy {
		case ledger.GroupByDay:
			g = dayOf(at)
		case ledger.GroupByModel:
			g = ev.ev.Model
		case ledger.GroupByKey:
			g = ev.ev.KeyID
		case ledger.GroupByEndUser:
			g = ev.ev.EndUser
		}
		r := rows[g]
		if r == nil {
			r = &ledger.UsageRow{Group: g}
			rows[g] = r
		}
		addUsage(r, -e.Delta, ev.ev.Usage)
	}
	out := make([]ledger.UsageRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b ledger.UsageRow) int { return cmp.Compare(a.Group, b.Group) })
	return out, nil
}

// Request returns one request's usage.
func (m *Ledger) Request(ctx context.Context, id string) (ledger.RequestInfo, error) {
	u, err := uuid.Parse(id)
	if err != nil {
		return ledger.RequestInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownRequest, id)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.events[u.String()]
	if e == nil {
		return ledger.RequestInfo{}, fmt.Errorf("%w: %q", ledger.ErrUnknownRequest, id)
	}
	ri := ledger.RequestInfo{UsageEvent: e.ev, Status: ledger.RequestPending, Seq: e.seq}
	ri.CreatedAt = ri.CreatedAt.UTC()
	switch {
	case e.voided:
		ri.Status = ledger.RequestVoided
	case e.seq > 0:
		ri.Status = ledger.RequestAccounted
	}
	return ri, nil
}

// ModelUsed reports whether a usage event names the model (DeleteModel's ErrModelInUse).
func (m *Ledger) ModelUsed(ctx context.Context, name string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.events {
		if e.ev.Model == name {
			return true, nil
		}
	}
	return false, nil
}

// DeleteModel deletes a model no usage event names.
func (m *Ledger) DeleteModel(ctx context.Context, name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.models[name]; !ok {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownModel, name)
	}
	for _, e := range m.events {
		if e.ev.Model == name {
			return fmt.Errorf("%w: %q", ledger.ErrModelInUse, name)
		}
	}
	delete(m.models, name)
	return nil
}

// RecordAudit appends r to the audit trail with the next id and the current time.
func (m *Ledger) RecordAudit(ctx context.Context, r ledger.AuditRecord) (ledger.AuditRecord, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r.ID = int64(len(m.console.audit)) + 1
	r.At = time.Now().UTC().Truncate(time.Microsecond)
	m.console.audit = append(m.console.audit, r)
	return r, nil
}

// AuditLog lists the audit trail, newest first.
func (m *Ledger) AuditLog(ctx context.Context, q ledger.ListQuery) (ledger.Page[ledger.AuditRecord], error) {
	before := int64(-1)
	if q.Cursor != "" {
		var err error
		if before, err = ledger.ParseSeqCursor(q.Cursor, "audit"); err != nil {
			return ledger.Page[ledger.AuditRecord]{}, err
		}
	}
	limit := ledger.PageLimit(q.Limit)
	m.mu.Lock()
	defer m.mu.Unlock()
	top := int64(len(m.console.audit))
	if before >= 0 {
		top = min(top, before-1)
	}
	var p ledger.Page[ledger.AuditRecord]
	for id := top; id >= 1; id-- {
		if len(p.Data) == limit {
			p.Next = ledger.AuditCursor(p.Data[limit-1].ID)
			break
		}
		p.Data = append(p.Data, m.console.audit[id-1])
	}
	return p, nil
}

// addUsage counts one request of the given cost and usage in row r.
func addUsage(r *ledger.UsageRow, cost int64, u pricing.Usage) {
	r.Add(cost, u)
}

// Spend reads the sums the account pass keeps (memAccount.charged, keyCharged, keyDays) under
// the lock: at most a month of a key's days, never the entries.
func (m *Ledger) Spend(ctx context.Context, org, keyID string, since []time.Time) (ledger.Spend, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Spend{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return ledger.Spend{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	s := ledger.Spend{Balance: a.balance, Charged: a.charged, Key: ledger.KeySpend{ID: keyID, Since: make([]int64, len(since))}}
	if k := m.keys[keyID]; keyID != "" && k != nil && k.key.Org == org {
		s.Key.Name, s.Key.Project = m.console.keyNames[keyID], k.project
	}
	if keyID == "" {
		return s, nil
	}
	s.Key.Charged = a.keyCharged[keyID]
	for kd, c := range a.keyDays {
		if kd.key != keyID {
			continue
		}
		for i, t := range since {
			if !kd.day.Before(utcDay(t)) {
				s.Key.Since[i] += c
			}
		}
	}
	return s, nil
}

// entryTime is the time ranges read an entry at: a charge's request's reserve time (its record
// time for a fail-open request), as limits count it; any other entry's creation. The caller holds
// m.mu.
func (m *Ledger) entryTime(e ledger.LedgerEntry) time.Time {
	if ev := m.events[e.HoldID]; e.Kind == ledger.KindCharge && ev != nil {
		return attrTime(ev.ev.ReservedAt, ev.ev.CreatedAt)
	}
	return e.CreatedAt
}

// ev0 is the event of e, or a zero event for none.
func ev0(e *memEvent) ledger.UsageEvent {
	if e == nil {
		return ledger.UsageEvent{}
	}
	return e.ev
}

// attrTime is the time a charge counts at: its reserve time (whole milliseconds), or its record
// time when it has none (fail-open).
func attrTime(reserved, recorded time.Time) time.Time {
	if reserved.IsZero() {
		return recorded.UTC()
	}
	return reserved.UTC()
}

func inRange(t, from, to time.Time) bool {
	return (from.IsZero() || !t.Before(from)) && (to.IsZero() || t.Before(to))
}

func dayOf(t time.Time) string { return t.UTC().Format("2006-01-02") }

// LimitWindows reads the org's limits' windows as the account pass keeps them (memAccount.windows),
// as pgledger's LimitWindows does.
func (m *Ledger) LimitWindows(ctx context.Context, org string) ([]balance.WindowUsed, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a, err := m.orgLocked(org)
	if err != nil {
		return nil, err
	}
	out := make([]balance.WindowUsed, 0, len(a.windows))
	for k, u := range a.windows {
		out = append(out, balance.WindowUsed{LimitID: k.limit, Start: k.start, EndUser: k.endUser, Used: u})
	}
	return out, nil
}
