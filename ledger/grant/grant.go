// Package grant is the ledger's role for credit grants (DESIGN.md "Money in", docs/grants.md): a
// credit may expire and has a priority; spending consumes grants in order (priority, then
// soonest expiry); the unspent rest of an expired grant leaves as one expire entry. The spending
// rule is written here once; memledger and pgledger keep the grants and implement Store.
package grant

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"strconv"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// Priorities: lower is spent first. A credit without one is paid credit.
const (
	PriorityPromotional = 0
	PriorityPaid        = 100
	// MaxPriority bounds a priority (0 … MaxPriority).
	MaxPriority = 1000
)

// KindExpire is the kind of the entry that takes an expired grant's unspent rest out of the
// balance (delta = −rest, possibly 0), one per grant, reference ExpireRef.
const KindExpire ledger.EntryKind = "expire"

// ErrInvalid: a priority out of range, or an expiry that is not in the future.
var ErrInvalid = errors.New("grant: invalid grant")

// Grant is one credit as a grant.
type Grant struct {
	Org       string    `json:"org"`
	Seq       int64     `json:"seq"` // its credit entry's sequence: the grant's id in its org
	Reference string    `json:"reference,omitempty"`
	Amount    int64     `json:"amount"`
	Priority  int       `json:"priority"`
	ExpiresAt time.Time `json:"expires_at,omitzero"` // zero: never
	// Rest is what is left of it: its amount less what the charges (and debits) written after it
	// took from it; 0 once expired.
	Rest    int64 `json:"rest"`
	Expired bool  `json:"expired"`
	// ExpiredAmount is what its expire entry took out (its rest at the expiry).
	ExpiredAmount int64     `json:"expired_amount,omitempty"`
	CreatedAt     time.Time `json:"created_at"`
}

// Options are a credit's grant terms.
type Options struct {
	Priority  int
	ExpiresAt time.Time // zero: never
}

// Paid are the terms of a plain credit: paid, never expires.
var Paid = Options{Priority: PriorityPaid}

// Check validates o against now.
func (o Options) Check(now time.Time) error {
	if o.Priority < 0 || o.Priority > MaxPriority {
		return errors.Join(ErrInvalid, errors.New("priority out of 0…1000"))
	}
	if !o.ExpiresAt.IsZero() && !o.ExpiresAt.After(now) {
		return errors.Join(ErrInvalid, errors.New("expires_at must be in the future"))
	}
	if !o.ExpiresAt.IsZero() && o.ExpiresAt.UnixMilli() >= 1e14 {
		return errors.Join(ErrInvalid, errors.New("expires_at too far"))
	}
	return nil
}

// Store is the ledger's grants role. Both ledgers implement it.
type Store interface {
	// CreditGrant is Accounts.Credit with grant terms (Credit is CreditGrant with Paid). The
	// same reference again returns the original entry (created=false) when org, amount and
	// terms match, else ledger.ErrReferenceConflict.
	CreditGrant(ctx context.Context, org string, amount int64, ref string, o Options) (ledger.LedgerEntry, bool, error)
	// Grants lists the org's grants, in spending order, the expired last.
	Grants(ctx context.Context, org string) ([]Grant, error)
	// DueGrants lists up to limit orgs that have grants whose expiry is at or before upTo and
	// that have no expire entry yet, each with the latest such expiry.
	DueGrants(ctx context.Context, upTo time.Time, limit int) (map[string]time.Time, error)
	// ExpireGrants accounts the org's pending usage (a charge reserved before an expiry spends
	// the grants live then), then writes the expire entry of every grant of the org whose expiry
	// is at or before upTo and that has none yet: its unspent rest, one per grant, exactly once
	// (its reference is ExpireRef), in one transaction. It returns how many it wrote. The caller
	// makes sure no hold reserved before upTo is still in flight (accounting.Worker asks the hot
	// balance): such a hold's usage would come too late to spend the grant.
	ExpireGrants(ctx context.Context, org string, upTo time.Time) (int, error)
}

// ExpireRef is the reference of grant seq's expire entry in org.
func ExpireRef(org string, seq int64) string {
	return "expire:" + org + ":" + strconv.FormatInt(seq, 10)
}

// Compare orders grants for spending: priority, then soonest expiry (never last), then the
// oldest.
func Compare(a, b Grant) int {
	if c := cmp.Compare(a.Priority, b.Priority); c != 0 {
		return c
	}
	switch {
	case a.ExpiresAt.IsZero() && !b.ExpiresAt.IsZero():
		return 1
	case !a.ExpiresAt.IsZero() && b.ExpiresAt.IsZero():
		return -1
	}
	if c := a.ExpiresAt.Compare(b.ExpiresAt); c != 0 {
		return c
	}
	return cmp.Compare(a.Seq, b.Seq)
}

// LiveAt reports whether g may be spent by a charge reserved at t: not expired (no expire entry)
// and its expiry after t. A request reserved before an expiry spends the grants live then,
// whenever it is charged.
func (g Grant) LiveAt(t time.Time) bool {
	return !g.Expired && g.Rest > 0 && (g.ExpiresAt.IsZero() || g.ExpiresAt.After(t))
}

// Spend takes cost (≥ 0) from gs in spending order among the grants live at t, lowering their
// Rest; it returns the indexes of the grants it changed. What no grant covers is left to the
// balance (debt, or credit that is not a grant: adjustments).
func Spend(gs []Grant, cost int64, t time.Time) []int {
	if cost <= 0 {
		return nil
	}
	idx := make([]int, 0, len(gs))
	for i := range gs {
		if gs[i].LiveAt(t) {
			idx = append(idx, i)
		}
	}
	slices.SortFunc(idx, func(a, b int) int { return Compare(gs[a], gs[b]) })
	var changed []int
	for _, i := range idx {
		if cost == 0 {
			break
		}
		take := min(cost, gs[i].Rest)
		gs[i].Rest -= take
		cost -= take
		changed = append(changed, i)
	}
	return changed
}

// Due sums the rests of the grants that expire and have no expire entry yet by expiry time
// (unix ms): what the hot balance keeps (balance.Snapshot.Expiries). Rests of 0 are kept, so the
// hot balance learns that an expiry has nothing left. Never nil.
func Due(gs []Grant) map[int64]int64 {
	out := map[int64]int64{}
	for _, g := range gs {
		if !g.Expired && !g.ExpiresAt.IsZero() {
			out[g.ExpiresAt.UnixMilli()] += g.Rest
		}
	}
	return out
}

// Sorted returns gs in spending order, the expired last (for listing).
func Sorted(gs []Grant) []Grant {
	out := slices.Clone(gs)
	slices.SortFunc(out, func(a, b Grant) int {
		if a.Expired != b.Expired {
			if a.Expired {
				return 1
			}
			return -1
		}
		return Compare(a, b)
	})
	return out
}
