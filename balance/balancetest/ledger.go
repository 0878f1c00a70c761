// Package balancetest holds the conformance suite of package balance, runnable against any
// Redis (miniredis, a single server, a Cluster), and a small in-memory Ledger double.
package balancetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// FakeLedger is a minimal balance.Ledger for tests: per org, a list of entries (seq from 1) and
// a set of hold ids with unsettled usage. It is safe for concurrent use.
type FakeLedger struct {
	mu        sync.Mutex
	epoch     balance.Epoch
	orgs      map[string][]balance.Entry
	unsettled map[string]bool
	limits    map[string]balance.Limits
	staleBy   int   // Snapshot leaves out the last staleBy entries (a stale read)
	err       error // returned by every call when set

	Snapshots    atomic.Int64 // Snapshot calls
	EndUserLoads atomic.Int64 // EndUserUsed calls
	// SnapshotDelay makes every Snapshot take this long (set before use).
	SnapshotDelay time.Duration
	inSnapshot    atomic.Int64
	maxInSnapshot atomic.Int64
}

// MaxConcurrentSnapshots is the most Snapshot calls that ran at once.
func (l *FakeLedger) MaxConcurrentSnapshots() int64 { return l.maxInSnapshot.Load() }

// NewFakeLedger returns an empty ledger with a fresh epoch of generation gen.
func NewFakeLedger(gen int64) *FakeLedger {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &FakeLedger{
		epoch:     balance.Epoch{Gen: gen, ID: hex.EncodeToString(b[:])},
		orgs:      map[string][]balance.Entry{},
		unsettled: map[string]bool{},
		limits:    map[string]balance.Limits{},
	}
}

// Epoch returns the ledger's epoch (balance.New reads it when the ledger offers it).
func (l *FakeLedger) Epoch(context.Context) (balance.Epoch, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.epoch, l.err
}

// CurrentEpoch is Epoch without a context or error.
func (l *FakeLedger) CurrentEpoch() balance.Epoch {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.epoch
}

// SetEpoch replaces the epoch (a restore, or another ledger).
func (l *FakeLedger) SetEpoch(e balance.Epoch) {
	l.mu.Lock()
	l.epoch = e
	l.mu.Unlock()
}

// Add appends an entry to org's ledger and returns it.
func (l *FakeLedger) Add(org string, delta int64, holdID string) balance.Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := balance.Entry{Seq: int64(len(l.orgs[org])) + 1, Delta: delta, HoldID: holdID}
	l.orgs[org] = append(l.orgs[org], e)
	return e
}

// Entries returns org's entries with Seq > after.
func (l *FakeLedger) Entries(org string, after int64) []balance.Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []balance.Entry
	for _, e := range l.orgs[org] {
		if e.Seq > after {
			out = append(out, e)
		}
	}
	return out
}

// B is the org's ledger balance after its entries with Seq ≤ k.
func (l *FakeLedger) B(org string, k int64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b int64
	for _, e := range l.orgs[org] {
		if e.Seq <= k {
			b += e.Delta
		}
	}
	return b
}

// Seq is the org's last sequence number.
func (l *FakeLedger) Seq(org string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return int64(len(l.orgs[org]))
}

// SetUnsettled marks (or unmarks) hold ids as having unsettled usage.
func (l *FakeLedger) SetUnsettled(on bool, ids ...string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		if on {
			l.unsettled[id] = true
		} else {
			delete(l.unsettled, id)
		}
	}
}

// SetStale makes Snapshot leave out the org's last n entries (0 turns it off).
func (l *FakeLedger) SetStale(n int) {
	l.mu.Lock()
	l.staleBy = n
	l.mu.Unlock()
}

// SetErr makes every call fail with err (nil: back to normal).
func (l *FakeLedger) SetErr(err error) {
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
}

// SetLimits replaces org's limits (freezes, key → project map) with lim at the next version,
// and returns that version (push it with Store.PushLimits).
func (l *FakeLedger) SetLimits(org string, lim balance.Limits) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	lim.Version = l.limits[org].Version + 1
	l.limits[org] = lim
	return lim.Version
}

// Limits returns org's limits.
func (l *FakeLedger) Limits(org string) balance.Limits {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.limits[org]
}

// AddUsage appends a charge of cost for hold id, attributed to key, project and reservedAt.
func (l *FakeLedger) AddUsage(org string, cost int64, holdID, key, project string, reservedAt time.Time) balance.Entry {
	return l.AddUsageTokens(org, cost, 0, holdID, key, project, reservedAt)
}

// AddUsageTokens is AddUsage of a charge that used tokens (input + output).
func (l *FakeLedger) AddUsageTokens(org string, cost, tokens int64, holdID, key, project string, reservedAt time.Time) balance.Entry {
	return l.AddCharge(org, balance.Entry{Delta: -cost, HoldID: holdID, KeyID: key, Project: project, ReservedAt: reservedAt, Tokens: tokens})
}

// AddCharge appends e (its attribution as given: key, project, end user, reserve time, tokens)
// with the org's next sequence number, and returns it.
func (l *FakeLedger) AddCharge(org string, e balance.Entry) balance.Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	e.Seq = int64(len(l.orgs[org])) + 1
	l.orgs[org] = append(l.orgs[org], e)
	return e
}

// inScope reports whether entry e counts against lim.
func inScope(lim balance.Limit, e balance.Entry) bool {
	if e.ReservedAt.IsZero() {
		return false
	}
	switch lim.Scope.Kind {
	case balance.ScopeProject:
		return e.Project == lim.Scope.ID
	case balance.ScopeKey:
		return e.KeyID == lim.Scope.ID
	case balance.ScopeEndUser:
		return e.EndUser != "" && (lim.Scope.ID == "" || e.EndUser == lim.Scope.ID)
	}
	return true
}

// eachEndUser reports whether lim applies to each end user apart (one counter per end user).
func eachEndUser(lim balance.Limit) bool {
	return lim.Scope.Kind == balance.ScopeEndUser && lim.Scope.ID == ""
}

// Used is the model of a counter: Σ over org's entries with seq ≤ upTo attributed to limit id
// in the window starting at start (ms) of what each counts in the limit's unit.
func (l *FakeLedger) Used(org, id string, start, upTo int64) int64 {
	return l.UsedBy(org, id, start, "", upTo)
}

// UsedBy is Used of one end user's counter of a limit of each end user apart (endUser "" for
// every other limit).
func (l *FakeLedger) UsedBy(org, id string, start int64, endUser string, upTo int64) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var n int64
	for _, lim := range l.limits[org].Limits {
		if lim.ID != id {
			continue
		}
		for _, e := range l.orgs[org] {
			if e.Seq <= upTo && inScope(lim, e) && lim.Window.StartMS(e.ReservedAt) == start &&
				(!eachEndUser(lim) || e.EndUser == endUser) {
				n += lim.Unit.Count(-e.Delta, e.Tokens)
			}
		}
	}
	return n
}

// EndUserUsed is the ledger read behind the lazy end users' lifetime counters (balance's Store
// finds it by its signature; see balance.Config.EndUserFields): for each of limits, what the
// org's charges of endUser with seq ≤ upto count in the limit's unit. EndUserLoads counts calls.
func (l *FakeLedger) EndUserUsed(_ context.Context, org, endUser string, limits []balance.Limit, upto int64) ([]balance.WindowUsed, error) {
	l.EndUserLoads.Add(1)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	out := make([]balance.WindowUsed, 0, len(limits))
	for _, lim := range limits {
		var n int64
		for _, e := range l.orgs[org] {
			if e.Seq <= upto && !e.ReservedAt.IsZero() && e.EndUser == endUser {
				n += lim.Unit.Count(-e.Delta, e.Tokens)
			}
		}
		out = append(out, balance.WindowUsed{LimitID: lim.ID, EndUser: endUser, Used: n})
	}
	return out, nil
}

// SnapshotSince implements balance.LimitLedger: Snapshot plus the org's limits and the spend of
// every window starting at or after since's, grouped by the entries' reserve times.
func (l *FakeLedger) SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error) {
	snap, err := l.Snapshot(ctx, org)
	if err != nil {
		return snap, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := &balance.LimitSnapshot{Limits: l.limits[org]}
	for _, lim := range ls.Limits.Limits {
		from := lim.Window.StartMS(since)
		type window struct {
			start   int64
			endUser string
		}
		sums := map[window]int64{}
		for _, e := range l.orgs[org][:snap.Seq] {
			if inScope(lim, e) {
				if st := lim.Window.StartMS(e.ReservedAt); st >= from {
					w := window{start: st}
					if eachEndUser(lim) {
						w.endUser = e.EndUser
					}
					sums[w] += lim.Unit.Count(-e.Delta, e.Tokens)
				}
			}
		}
		for w, n := range sums {
			ls.Used = append(ls.Used, balance.WindowUsed{LimitID: lim.ID, Start: w.start, EndUser: w.endUser, Used: n})
		}
	}
	snap.Limits = ls
	return snap, nil
}

// Snapshot implements balance.Ledger.
func (l *FakeLedger) Snapshot(_ context.Context, org string) (balance.Snapshot, error) {
	l.Snapshots.Add(1)
	n := l.inSnapshot.Add(1)
	defer l.inSnapshot.Add(-1)
	for {
		m := l.maxInSnapshot.Load()
		if n <= m || l.maxInSnapshot.CompareAndSwap(m, n) {
			break
		}
	}
	time.Sleep(l.SnapshotDelay)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return balance.Snapshot{}, l.err
	}
	es := l.orgs[org]
	keep := max(len(es)-l.staleBy, 0)
	var b int64
	for _, e := range es[:keep] {
		b += e.Delta
	}
	return balance.Snapshot{Epoch: l.epoch, Balance: b, Seq: int64(keep)}, nil
}

// EntriesAfter implements balance.Ledger.
func (l *FakeLedger) EntriesAfter(_ context.Context, org string, after int64, limit int) ([]balance.Entry, balance.Epoch, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, balance.Epoch{}, l.err
	}
	var out []balance.Entry
	for _, e := range l.orgs[org] {
		if e.Seq > after && len(out) < limit {
			out = append(out, e)
		}
	}
	return out, l.epoch, nil
}

// UnsettledUsage implements balance.Ledger.
func (l *FakeLedger) UnsettledUsage(_ context.Context, _ string, ids []string) (map[string]bool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil, l.err
	}
	out := map[string]bool{}
	for _, id := range ids {
		if l.unsettled[id] {
			out[id] = true
		}
	}
	return out, nil
}

var _ balance.LimitLedger = (*FakeLedger)(nil)

// pushLimits pushes the fake ledger's limits of the org (as SetLimits last set them) at version
// v, as the admin plane does after a change (Store.PushLimits).
func (x *h) pushLimits(v int64) (bool, error) {
	ls := x.l.Limits(x.org)
	ls.Version = v
	return x.s.PushLimits(x.ctx, x.org, ls)
}
