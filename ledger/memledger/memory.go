package memledger

import (
	"cmp"
	"context"
	"crypto/sha256"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
)

// Ledger is the in-memory ledger: the embedded default for a single process with an embedded
// Redis. It implements ledger.Ledger exactly like the Postgres ledger (pgledger) does (the same
// conformance suite runs on both) but forgets everything when the process ends, so each one has
// a new random epoch: a hot balance written against an earlier memory ledger never matches it.
type Ledger struct {
	mu       sync.Mutex
	epoch    balance.Epoch
	accounts map[string]*memAccount
	events   map[string]*memEvent
	pending  map[string][]*memEvent // org → pending events in (CreatedAt, ID) order
	refs     map[refKey]ledger.LedgerEntry
	models   map[string]ledger.Model
	keys     map[string]*memKey // id → key
	keyHash  map[[32]byte]*memKey
	subs     map[*memSub]struct{}
	console  memConsole // names and the audit trail (memory_read.go)
	hooks    memHooks   // webhooks: endpoints, thresholds, the outbox (memory_webhooks.go)
	tokens   memTokens  // scoped admin tokens (memory_admintokens.go)
	topups   memTopUps  // auto top-up settings and attempts (memory_topup.go)
	jobs     memJobs    // background responses and batches (memory_jobs.go)
	bfiles   memFiles   // batch files (memory_batchfiles.go)
	// lastLimit is the last limit id given out (ids are never reused).
	lastLimit int64
}

type memAccount struct {
	exempt  bool // OrgFlags
	balance int64
	settled int64
	entries []ledger.LedgerEntry // entries[i].Seq == i+1
	created time.Time
	attr    map[int64]entryAttr // a charge's attribution, by seq
	lims    memLimits           // memory_limits.go
	windows map[winKey]int64    // the spend of limits' current and later windows (limit_crossed.go)
	// The sums the customer views read (Spend), kept as charges are written (pgledger's
	// migration 021): the org's charges, each key's, and each key's per UTC day.
	charged    int64
	keyCharged map[string]int64
	keyDays    map[keyDay]int64
	grants     memGrants // credit grants (memory_grants.go)
}

// keyDay is a key and a UTC day (midnight).
type keyDay struct {
	key string
	day time.Time
}

// utcDay is t's UTC day, as midnight UTC: the start of its balance.Day window.
func utcDay(t time.Time) time.Time {
	start, _ := balance.Day.Bounds(t)
	return start
}

// entryAttr is what a charge entry carries for limits.
type entryAttr struct {
	key, project string
	endUser      string
	at           time.Time // reserve time, else the usage's record time
	tokens       int64     // the usage's input + output tokens
}

type memEvent struct {
	ev     ledger.UsageEvent
	seq    int64 // 0 while pending
	voided bool  // a tombstone (VoidUsage): never pending, never charged
}

type refKey struct {
	kind ledger.EntryKind
	ref  string
}

type memKey struct {
	key     ledger.APIKey
	hash    [32]byte
	revoked bool
	created time.Time
	revAt   time.Time
	project string // "" for none
	frozen  bool
	used    time.Time // the reserve time of its latest accounted request
}

type memSub struct {
	ch     chan string
	closed bool
}

var (
	_ ledger.Ledger          = (*Ledger)(nil)
	_ ledger.QuietUsageStore = (*Ledger)(nil)
)

// New returns an empty in-memory ledger with a new random epoch (generation 1).
func New() *Ledger {
	return &Ledger{
		epoch:    balance.Epoch{Gen: 1, ID: ledger.RandomHex(16)},
		accounts: map[string]*memAccount{},
		events:   map[string]*memEvent{},
		pending:  map[string][]*memEvent{},
		refs:     map[refKey]ledger.LedgerEntry{},
		models:   map[string]ledger.Model{},
		keys:     map[string]*memKey{},
		keyHash:  map[[32]byte]*memKey{},
		subs:     map[*memSub]struct{}{},
	}
}

// Epoch returns the ledger's epoch.
func (m *Ledger) Epoch(ctx context.Context) (balance.Epoch, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epoch, nil
}

// RaiseEpoch starts a new epoch with a higher generation.
func (m *Ledger) RaiseEpoch(ctx context.Context) (balance.Epoch, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.epoch = balance.Epoch{Gen: m.epoch.Gen + 1, ID: ledger.RandomHex(16)}
	return m.epoch, nil
}

// CreateOrg creates an account with balance 0.
func (m *Ledger) CreateOrg(ctx context.Context, org string) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] != nil {
		return fmt.Errorf("%w: %q", ledger.ErrOrgExists, org)
	}
	m.accounts[org] = &memAccount{created: time.Now()}
	return nil
}

// Account returns the org's account.
func (m *Ledger) Account(ctx context.Context, org string) (ledger.Account, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Account{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return ledger.Account{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return ledger.Account{Org: org, Balance: a.balance, LedgerSeq: int64(len(a.entries)), SettledSeq: a.settled, Pending: int64(len(m.pending[org]))}, nil
}

// Snapshot accounts the org's pending usage, then returns its balance and ledger sequence.
func (m *Ledger) Snapshot(ctx context.Context, org string) (balance.Snapshot, error) {
	return m.snapshot(org, nil)
}

// SnapshotSince is Snapshot plus, under the same lock, the org's limits and the spend of their
// windows from the one that contains since on (balance.LimitLedger).
func (m *Ledger) SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error) {
	return m.snapshot(org, &since)
}

func (m *Ledger) snapshot(org string, since *time.Time) (balance.Snapshot, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return balance.Snapshot{}, err
	}
	m.mu.Lock()
	a := m.accounts[org]
	if a == nil && len(m.pending[org]) == 0 {
		m.mu.Unlock()
		return balance.Snapshot{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	n, err := m.accountOrgLocked(org, -1, nil)
	a = m.accounts[org]
	snap := balance.Snapshot{Epoch: m.epoch, Balance: a.balance, Seq: int64(len(a.entries))}
	snap.Expiries = a.grants.expiries()
	if since != nil && err == nil {
		ls := m.limitsLocked(org)
		snap.Limits = &balance.LimitSnapshot{Limits: ls, Used: a.usedLocked(ls.Limits, *since, snap.Seq, true)}
	}
	m.mu.Unlock()
	if n > 0 {
		m.notify(org)
	}
	if err != nil {
		return balance.Snapshot{}, err
	}
	return snap, nil
}

// EntriesAfter returns up to limit entries of org with Seq > after, in Seq order.
func (m *Ledger) EntriesAfter(ctx context.Context, org string, after int64, limit int) ([]balance.Entry, balance.Epoch, error) {
	return m.entriesOf(org, func(a *memAccount) []balance.Entry { return a.entriesFrom(after, limit) })
}

// entriesOf validates org and reads entries of its account under the lock, with the epoch (no
// entries for an org without an account).
func (m *Ledger) entriesOf(org string, read func(a *memAccount) []balance.Entry) ([]balance.Entry, balance.Epoch, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, balance.Epoch{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return nil, m.epoch, nil
	}
	return read(a), m.epoch, nil
}

// UnsettledEntries returns up to limit entries of org past its settled sequence.
func (m *Ledger) UnsettledEntries(ctx context.Context, org string, limit int) ([]balance.Entry, balance.Epoch, error) {
	return m.entriesOf(org, func(a *memAccount) []balance.Entry { return a.unsettled(limit) })
}

// unsettled returns up to limit entries past the settled sequence, each with its Recorded time:
// the entry's own (accounting is in-process), the settle-lag clock.
func (a *memAccount) unsettled(limit int) []balance.Entry {
	out := a.entriesFrom(a.settled, limit)
	for i := range out {
		out[i].Recorded = a.entries[out[i].Seq-1].CreatedAt
	}
	return out
}

// UnsettledEntriesOf returns, for each of orgs with entries past its settled sequence, up to
// limit of them, with the epoch.
func (m *Ledger) UnsettledEntriesOf(ctx context.Context, orgs []string, limit int) (map[string][]balance.Entry, balance.Epoch, error) {
	for _, org := range orgs {
		if err := balance.ValidateOrg(org); err != nil {
			return nil, balance.Epoch{}, err
		}
	}
	out := make(map[string][]balance.Entry, len(orgs))
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, org := range orgs {
		a := m.accounts[org]
		if a == nil || out[org] != nil {
			continue
		}
		if es := a.unsettled(limit); len(es) > 0 {
			out[org] = es
		}
	}
	return out, m.epoch, nil
}

func (a *memAccount) entriesFrom(after int64, limit int) []balance.Entry {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	after = max(after, 0)
	var out []balance.Entry
	for i := after; i < int64(len(a.entries)) && len(out) < limit; i++ {
		e := a.entries[i]
		be := balance.Entry{Seq: e.Seq, Delta: e.Delta, HoldID: e.HoldID}
		if at, ok := a.attr[e.Seq]; ok {
			be.KeyID, be.Project, be.ReservedAt = ledger.AttrID(balance.ScopeKey, at.key), ledger.AttrID(balance.ScopeProject, at.project), at.at
			be.EndUser = ledger.AttrID(balance.ScopeEndUser, at.endUser)
			be.Tokens = at.tokens
		}
		a.grants.mark(&be)
		out = append(out, be)
	}
	if n := len(out); n > 0 && out[n-1].Seq == int64(len(a.entries)) {
		out[n-1].Expiries = a.grants.expiries()
	}
	return out
}

// UnsettledUsage reports, for each of holdIDs, whether the org has usage recorded for it that is
// not settled yet: a pending event, or a charge entry past settled_seq.
func (m *Ledger) UnsettledUsage(ctx context.Context, org string, holdIDs []string) (map[string]bool, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]bool, len(holdIDs))
	a := m.accounts[org]
	for _, id := range holdIDs {
		out[id] = false
		key := id
		if u, err := uuid.Parse(id); err == nil {
			key = u.String()
		}
		if j := m.jobs.byID[key]; j != nil && j.Org == org && j.Live() {
			out[id] = true // a live job's hold
			continue
		}
		e := m.events[key]
		if e == nil || e.ev.Org != org || e.voided {
			continue
		}
		out[id] = e.seq == 0 || a == nil || e.seq > a.settled
	}
	return out, nil
}

// Credit adds amount (> 0) to the org, idempotent by ref across all orgs.
func (m *Ledger) Credit(ctx context.Context, org string, amount int64, ref string) (ledger.LedgerEntry, bool, error) {
	return m.CreditGrant(ctx, org, amount, ref, grant.Paid)
}

// Adjust writes a signed correction (delta ≠ 0), idempotent by ref like Credit.
func (m *Ledger) Adjust(ctx context.Context, org string, delta int64, ref string) (ledger.LedgerEntry, bool, error) {
	if delta == 0 || delta > balance.MaxAmount || delta < -balance.MaxAmount {
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: adjustment %d", ledger.ErrInvalidAmount, delta)
	}
	return m.write(org, ledger.KindAdjust, delta, ref, nil)
}

// write appends a credit (with its grant terms o) or an adjustment (o nil).
func (m *Ledger) write(org string, kind ledger.EntryKind, delta int64, ref string, o *grant.Options) (ledger.LedgerEntry, bool, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.LedgerEntry{}, false, err
	}
	m.mu.Lock()
	a := m.accounts[org]
	if a == nil {
		m.mu.Unlock()
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	if ref != "" {
		if e, ok := m.refs[refKey{kind, ref}]; ok {
			m.mu.Unlock()
			if e.Org != org || e.Delta != delta || (o != nil && !a.grants.sameTerms(e.Seq, *o)) {
				return ledger.LedgerEntry{}, false, fmt.Errorf("%w: %q", ledger.ErrReferenceConflict, ref)
			}
			return e, false, nil
		}
	}
	if nb := a.balance + delta; nb > balance.MaxAmount || nb < -balance.MaxAmount {
		m.mu.Unlock()
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: balance would leave ±%d", ledger.ErrInvalidAmount, balance.MaxAmount)
	}
	e := ledger.LedgerEntry{Org: org, Seq: int64(len(a.entries)) + 1, Delta: delta, Kind: kind, Ref: ref, CreatedAt: time.Now()}
	a.entries = append(a.entries, e)
	a.balance += delta
	if ref != "" {
		m.refs[refKey{kind, ref}] = e
	}
	switch {
	case o != nil:
		a.grants.add(org, e, *o)
	case delta < 0:
		a.grants.spend(-delta, e.CreatedAt) // a debit takes from the grants like a charge
	}
	if kind == ledger.KindCredit {
		m.hooks.emit(ledger.EventCreditReceived, org, creditData{Amount: delta, Reference: ref, Seq: e.Seq, Balance: a.balance})
	}
	m.hooks.balanceChanged(org, a.balance-delta, a.balance)
	m.mu.Unlock()
	m.notify(org)
	return e, true, nil
}

// RecordUsage stores events; an event whose ID is already stored is ignored.
func (m *Ledger) RecordUsage(ctx context.Context, events []ledger.UsageEvent) error {
	orgs, err := m.recordUsage(events)
	m.notify(orgs...)
	return err
}

// RecordUsageQuiet is RecordUsage without the notification (QuietUsageStore).
func (m *Ledger) RecordUsageQuiet(ctx context.Context, events []ledger.UsageEvent) error {
	_, err := m.recordUsage(events)
	return err
}

// recordUsage stores events and returns the orgs of those it stored.
func (m *Ledger) recordUsage(events []ledger.UsageEvent) ([]string, error) {
	evs := make([]ledger.UsageEvent, len(events))
	for i, ev := range events {
		var err error
		if evs[i], err = ledger.NormalizeEvent(ev); err != nil {
			return nil, err
		}
	}
	m.mu.Lock()
	orgs := m.storeEvents(evs)
	m.mu.Unlock()
	return orgs, nil
}

// storeEvents stores normalized events, skipping the ids already stored, and returns the orgs
// of those it stored (m.mu held).
func (m *Ledger) storeEvents(evs []ledger.UsageEvent) []string {
	var orgs []string
	for _, ev := range evs {
		if m.events[ev.ID] != nil {
			continue
		}
		e := &memEvent{ev: ev}
		m.events[ev.ID] = e
		q := m.pending[ev.Org]
		i, _ := slices.BinarySearchFunc(q, e, cmpEvents)
		m.pending[ev.Org] = slices.Insert(q, i, e)
		if !slices.Contains(orgs, ev.Org) {
			orgs = append(orgs, ev.Org)
		}
	}
	return orgs
}

// VoidUsage stores a tombstone for ev.ID unless the event is stored (ErrUsageRecorded).
func (m *Ledger) VoidUsage(ctx context.Context, ev ledger.UsageEvent) error {
	ev, err := ledger.NormalizeEvent(ev)
	if err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if e := m.events[ev.ID]; e != nil {
		if e.voided {
			return nil
		}
		return fmt.Errorf("%w: %s", ledger.ErrUsageRecorded, ev.ID)
	}
	m.events[ev.ID] = &memEvent{ev: ev, voided: true}
	return nil
}

func cmpEvents(a, b *memEvent) int {
	return cmp.Or(a.ev.CreatedAt.Compare(b.ev.CreatedAt), cmp.Compare(a.ev.ID, b.ev.ID))
}

// AccountPending turns up to limit pending usage events into charge entries.
func (m *Ledger) AccountPending(ctx context.Context, limit int) (int, error) {
	r, err := m.AccountPass(ctx, limit)
	return r.Accounted, err
}

// AccountPass is AccountPending with the orgs it charged and the learned max costs it found.
func (m *Ledger) AccountPass(ctx context.Context, limit int) (ledger.AccountResult, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	m.mu.Lock()
	// Oldest first across orgs, like Postgres: pick the orgs of the oldest pending events.
	type head struct {
		org string
		e   *memEvent
	}
	var heads []head
	for org, q := range m.pending {
		if len(q) > 0 {
			heads = append(heads, head{org, q[0]})
		}
	}
	slices.SortFunc(heads, func(a, b head) int { return cmpEvents(a.e, b.e) })
	var r ledger.AccountResult
	var firstErr error
	for _, h := range heads {
		if r.Accounted >= limit {
			break
		}
		n, err := m.accountOrgLocked(h.org, limit-r.Accounted, &r)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		if n > 0 {
			r.Accounted += n
			r.Orgs = append(r.Orgs, h.org)
		}
	}
	if len(r.Settle) > 0 {
		r.Epoch = m.epoch
	}
	m.mu.Unlock()
	// No notification: the caller settles r.Orgs itself, and every subscriber of a Memory is in
	// its process (like Postgres.Subscribe, which leaves out its own passes).
	return r, firstErr
}

// accountOrgLocked accounts up to limit (all when < 0) of org's pending events, creating the
// account when the org has none: a request that was served is billed. With r, each event's
// cost of one choice is learned into r.MaxCost, and when every earlier entry was settled, the
// new entries, then the org's unsettled ones, go to r.Settle.
func (m *Ledger) accountOrgLocked(org string, limit int, r *ledger.AccountResult) (int, error) {
	q := m.pending[org]
	if limit < 0 || limit > len(q) {
		limit = len(q)
	}
	if limit == 0 {
		return 0, nil
	}
	a := m.accounts[org]
	if a == nil {
		a = &memAccount{created: time.Now()}
		m.accounts[org] = a
	}
	var sum int64
	for _, e := range q[:limit] {
		sum += e.ev.Cost
	}
	if nb := a.balance - sum; nb < -balance.MaxAmount {
		return 0, fmt.Errorf("%w: org %q: balance would leave ±%d", ledger.ErrInvalidAmount, org, balance.MaxAmount)
	}
	now := time.Now()
	if a.attr == nil {
		a.attr = map[int64]entryAttr{}
	}
	base := int64(len(a.entries))
	var charges []ledger.ChargeAttr // for the limits' windows: only an org with limits pays for them
	for _, e := range q[:limit] {
		e.seq = int64(len(a.entries)) + 1
		a.entries = append(a.entries, ledger.LedgerEntry{Org: org, Seq: e.seq, Delta: -e.ev.Cost, Kind: ledger.KindCharge, HoldID: e.ev.ID, CreatedAt: now})
		at := attrTime(e.ev.ReservedAt, e.ev.CreatedAt)
		a.grants.spend(e.ev.Cost, at) // the grants live at its reserve time
		a.attr[e.seq] = entryAttr{key: e.ev.KeyID, project: e.ev.Project, endUser: e.ev.EndUser, at: at, tokens: e.ev.Usage.Tokens()}
		a.charged += e.ev.Cost
		if e.ev.KeyID != "" {
			if a.keyCharged == nil {
				a.keyCharged, a.keyDays = map[string]int64{}, map[keyDay]int64{}
			}
			a.keyCharged[e.ev.KeyID] += e.ev.Cost
			a.keyDays[keyDay{e.ev.KeyID, utcDay(at)}] += e.ev.Cost
		}
		if r != nil {
			r.Learn(e.ev.Model, e.ev.Cost, e.ev.Choices, e.ev.Estimated)
		}
		if k := m.keys[e.ev.KeyID]; k != nil && at.After(k.used) {
			k.used = at
		}
		if len(a.lims.limits) > 0 {
			charges = append(charges, ledger.ChargeAttr{Key: e.ev.KeyID, Project: e.ev.Project, EndUser: e.ev.EndUser, At: at, Cost: e.ev.Cost, Tokens: e.ev.Usage.Tokens()})
		}
	}
	a.balance -= sum
	m.hooks.balanceChanged(org, a.balance+sum, a.balance)
	if len(charges) > 0 {
		m.chargeWindowsLocked(org, a, base, charges, now)
	}
	if limit == len(q) {
		delete(m.pending, org)
	} else {
		m.pending[org] = slices.Delete(q, 0, limit)
	}
	if r != nil && a.settled == base {
		if r.Settle == nil {
			r.Settle = map[string][]balance.Entry{}
		}
		r.Settle[org] = a.unsettled(limit)
	}
	return limit, nil
}

// MarkSettled sets settled_seq = GREATEST(settled_seq, seq), capped at ledger_seq.
func (m *Ledger) MarkSettled(ctx context.Context, org string, seq int64) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	a.settled = max(a.settled, min(seq, int64(len(a.entries))))
	return nil
}

// MarkSettledMany is MarkSettled for each org of marks; orgs with no account are skipped.
func (m *Ledger) MarkSettledMany(ctx context.Context, marks map[string]int64) error {
	for org := range marks {
		if err := balance.ValidateOrg(org); err != nil {
			return err
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for org, seq := range marks {
		if a := m.accounts[org]; a != nil {
			a.settled = max(a.settled, min(seq, int64(len(a.entries))))
		}
	}
	return nil
}

// OrgsToSettle lists up to limit orgs with settled_seq < ledger_seq or pending usage.
func (m *Ledger) OrgsToSettle(ctx context.Context, limit int) ([]string, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for org, a := range m.accounts {
		if len(out) >= limit {
			return out, nil
		}
		if a.settled < int64(len(a.entries)) || len(m.pending[org]) > 0 {
			out = append(out, org)
		}
	}
	for org := range m.pending {
		if len(out) >= limit {
			break
		}
		if m.accounts[org] == nil {
			out = append(out, org)
		}
	}
	return out, nil
}

// Subscribe delivers the org of every write of entries or usage events until ctx ends. A slow
// reader loses notifications (the channel holds 1024) rather than slowing writers.
func (m *Ledger) Subscribe(ctx context.Context) (<-chan string, error) {
	s := &memSub{ch: make(chan string, ledger.SubscriptionBuffer)}
	m.mu.Lock()
	m.subs[s] = struct{}{}
	m.mu.Unlock()
	context.AfterFunc(ctx, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		delete(m.subs, s)
		if !s.closed {
			s.closed = true
			close(s.ch)
		}
	})
	return s.ch, nil
}

func (m *Ledger) notify(orgs ...string) {
	if len(orgs) == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for s := range m.subs {
		for _, org := range orgs {
			select {
			case s.ch <- org:
			default:
			}
		}
	}
}

// PutModel creates or replaces a model; its max cost never goes below the one stored.
func (m *Ledger) PutModel(ctx context.Context, model ledger.Model) error {
	if err := ledger.ValidateModel(model); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if old, ok := m.models[model.Name]; ok {
		model.MaxCost = max(model.MaxCost, old.MaxCost) // never below what the ledger learned
	}
	model.Prices = maps.Clone(model.Prices) // the caller's map stays the caller's
	m.models[model.Name] = model
	return nil
}

// Model returns a model.
func (m *Ledger) Model(ctx context.Context, name string) (ledger.Model, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	md, ok := m.models[name]
	if !ok {
		return ledger.Model{}, fmt.Errorf("%w: %q", ledger.ErrUnknownModel, name)
	}
	md.Prices = maps.Clone(md.Prices)
	return md, nil
}

// Models lists every model, by name.
func (m *Ledger) Models(ctx context.Context) ([]ledger.Model, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]ledger.Model, 0, len(m.models))
	for _, md := range m.models {
		md.Prices = maps.Clone(md.Prices)
		out = append(out, md)
	}
	slices.SortFunc(out, func(a, b ledger.Model) int { return cmp.Compare(a.Name, b.Name) })
	return out, nil
}

// RaiseMaxCost raises the model's learned max cost to cost when that is higher. Capping it at
// the model's bound is the caller's business.
func (m *Ledger) RaiseMaxCost(ctx context.Context, model string, cost int64) error {
	if cost < 0 || cost > balance.MaxAmount {
		return fmt.Errorf("%w: max cost %d", ledger.ErrInvalidAmount, cost)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	md, ok := m.models[model]
	if !ok {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownModel, model)
	}
	md.MaxCost = max(md.MaxCost, cost)
	m.models[model] = md
	return nil
}

// CreateKey makes a new API key for org and returns its secret, which is not stored.
func (m *Ledger) CreateKey(ctx context.Context, org string) (ledger.APIKey, string, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.APIKey{}, "", err
	}
	k := ledger.APIKey{ID: ledger.NewKeyID(), Org: org}
	secret := ledger.NewSecret()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[org] == nil {
		return ledger.APIKey{}, "", fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	mk := &memKey{key: k, hash: sha256.Sum256([]byte(secret)), created: time.Now().UTC().Truncate(time.Microsecond)}
	m.keys[k.ID] = mk
	m.keyHash[mk.hash] = mk
	return k, secret, nil
}

// LookupKey resolves a secret; revoked and unknown keys are ErrUnknownKey.
func (m *Ledger) LookupKey(ctx context.Context, secret string) (ledger.APIKey, error) {
	h := sha256.Sum256([]byte(secret))
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keyHash[h]
	if k == nil || k.revoked {
		return ledger.APIKey{}, ledger.ErrUnknownKey
	}
	key := k.key
	if a := m.accounts[key.Org]; a != nil {
		key.Exempt = a.exempt
	}
	return key, nil
}

// RevokeKey revokes a key by id (revoking twice is fine).
func (m *Ledger) RevokeKey(ctx context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys[id]
	if k == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, id)
	}
	if !k.revoked {
		k.revoked, k.revAt = true, time.Now().UTC().Truncate(time.Microsecond)
		m.hooks.emit(ledger.EventKeyRevoked, k.key.Org, keyRevokedData{KeyID: id})
	}
	return nil
}

// Close closes every subscription.
func (m *Ledger) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for s := range m.subs {
		if !s.closed {
			s.closed = true
			close(s.ch)
		}
		delete(m.subs, s)
	}
}
