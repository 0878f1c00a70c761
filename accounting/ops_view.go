package accounting

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger/grant"
)

// CustomerView is what an API key's holder may read about the money it spends (DESIGN "Holds
// that fit", the customer's own view): its org's balance — available (what a new request may
// hold), held by requests in flight, and the ledger's — what was charged and credited, and the
// key with the limits in its scope. Every amount is in micro-units.
type CustomerView struct {
	Org string `json:"org"`
	// Available and Held are the hot balance's (Ops.Balance, which seeds a cold org); when
	// Redis does not answer they are the ledger balance and 0, and Hot is false.
	Available     int64 `json:"available"`
	Held          int64 `json:"held"`
	LedgerBalance int64 `json:"ledger_balance"`
	Hot           bool  `json:"hot"`
	// Charged is the sum of the org's accounted charges; Credited = LedgerBalance + Charged,
	// every credit and adjustment it got (read together, from one snapshot).
	Charged  int64   `json:"charged"`
	Credited int64   `json:"credited"`
	Key      KeyView `json:"key"`
	// Grants (docs/grants.md): the org's credit grants not expired yet, in spending order, and
	// Expired, credit already expired whose expire entry is not in the ledger balance yet (it is
	// out of Available and of Credited, so Credited − Charged − Held stays Available).
	Grants  []grant.Grant `json:"grants"`
	Expired int64         `json:"expired"`
}

// KeyView is the key of a CustomerView: its charges — all of them, and those of the current
// UTC day, week (from Monday) and month, by reserve time as limits count them — and the
// limits in its scope (the org's, its project's, its own), each with its current window.
type KeyView struct {
	ID             string      `json:"id"`
	Name           string      `json:"name"`
	Project        string      `json:"project"`
	Charged        int64       `json:"charged"`
	ChargedDay     int64       `json:"charged_day"`
	ChargedWeek    int64       `json:"charged_week"`
	ChargedMonth   int64       `json:"charged_month"`
	Limits         []LimitView `json:"limits"`
	Binding        *LimitView  `json:"binding"` // the limit with the least room left (nil: none)
	BindingRemains int64       `json:"binding_remains"`
}

// CustomerView reads org's view for the key keyID (as the middleware identified the caller;
// "" for an identity without a key). Times are the Redis clock's, like the limits' windows.
func (o *Ops) CustomerView(ctx context.Context, org, keyID string) (CustomerView, error) {
	now, err := o.store.Now(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return CustomerView{}, ctx.Err()
		}
		now = time.Now()
	}
	now = now.UTC()
	day, _ := balance.Day.Bounds(now)
	week, _ := balance.Week.Bounds(now)
	month, _ := balance.Month.Bounds(now)
	sp, err := o.ledger.Spend(ctx, org, keyID, []time.Time{day, week, month})
	if err != nil {
		return CustomerView{}, err
	}
	v := CustomerView{Org: org, Available: sp.Balance, LedgerBalance: sp.Balance, Charged: sp.Charged, Credited: sp.Balance + sp.Charged}
	switch b, err := o.Balance(ctx, org); {
	case err == nil:
		v.Available, v.Held, v.Hot = b.Available, b.Held, true
		v.Expired, v.Credited = b.Expired, v.Credited-b.Expired
	case !errors.Is(err, ErrHotBalance):
		return CustomerView{}, err
	}
	k := KeyView{ID: keyID, Name: sp.Key.Name, Project: sp.Key.Project, Charged: sp.Key.Charged,
		ChargedDay: sp.Key.Since[0], ChargedWeek: sp.Key.Since[1], ChargedMonth: sp.Key.Since[2], Limits: []LimitView{}}
	ls, err := o.listLimits(ctx, org, true) // the windows the ledger keeps, never its charges
	if err != nil {
		return CustomerView{}, fmt.Errorf("limits of %q: %w", org, err)
	}
	binding := -1
	for _, l := range ls {
		switch {
		case l.Scope == balance.ScopeOrg,
			l.Scope == balance.ScopeProject && k.Project != "" && l.ScopeID == k.Project,
			l.Scope == balance.ScopeKey && keyID != "" && l.ScopeID == keyID:
		default:
			continue
		}
		k.Limits = append(k.Limits, l)
		if room := max(l.Cap-l.Used, 0); binding < 0 || room < k.BindingRemains {
			binding, k.BindingRemains = len(k.Limits)-1, room
		}
	}
	if binding >= 0 {
		k.Binding = &k.Limits[binding]
	}
	v.Key = k
	v.Grants = []grant.Grant{}
	if g, ok := o.worker.grants(); ok {
		gs, err := g.Grants(ctx, org)
		if err != nil {
			return CustomerView{}, fmt.Errorf("grants of %q: %w", org, err)
		}
		for _, x := range gs {
			if !x.Expired {
				v.Grants = append(v.Grants, x)
			}
		}
	}
	return v, nil
}
