package accounting

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
)

// ErrNoGrants: the ledger has no grants role (grant.Store). Both of escrow's ledgers have it.
var ErrNoGrants = errors.New("accounting: the ledger has no grants role")

// defaultGrantGrace is WorkerConfig.GrantGrace's default.
const defaultGrantGrace = 2 * time.Minute

func (w *Worker) grants() (grant.Store, bool) {
	g, ok := w.ledger.(grant.Store)
	return g, ok
}

// ExpireGrants writes the expire entries of the grants whose expiry is GrantGrace past (the
// hot balance took their rests out at the expiry itself; the grace lets the requests reserved
// before it be charged to them first) and settles the orgs that got some. It returns how many
// orgs got entries.
func (w *Worker) ExpireGrants(ctx context.Context) (int, error) {
	g, ok := w.grants()
	if !ok {
		return 0, nil
	}
	return w.expireDue(ctx, g, time.Now().Add(-w.cfg.GrantGrace))
}

// expireDue expires the grants due by upTo (ExpireGrants' work, on any clock).
func (w *Worker) expireDue(ctx context.Context, g grant.Store, upTo time.Time) (int, error) {
	due, err := g.DueGrants(ctx, upTo, w.cfg.AccountBatch)
	if err != nil {
		return 0, fmt.Errorf("accounting: expire grants: %w", err)
	}
	n := 0
	for org, at := range due {
		if err := w.expireOrg(ctx, g, org, at); err != nil {
			w.log.Warn("grant expiry failed", "org", org, "err", err)
			continue
		}
		n++
	}
	return n, nil
}

// expireOrg writes org's expire entries up to at — only once no hold reserved before at is left
// in the hot balance: the usage of such a hold spends the grants live when it was reserved, so
// it must be in the ledger first (a pinned hold waits for its journal) — and settles them.
func (w *Worker) expireOrg(ctx context.Context, g grant.Store, org string, at time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
	defer cancel()
	st, err := w.store.State(ctx, org)
	if err != nil {
		return err
	}
	if st.Holds > 0 && st.Oldest.Before(at) {
		w.stats.grantsWaiting.Add(1)
		w.log.Debug("grant expiry waits for holds reserved before it", "org", org, "expiry", at, "oldest", st.Oldest)
		return nil
	}
	n, err := g.ExpireGrants(ctx, org, at)
	if err != nil || n == 0 {
		return err
	}
	w.stats.grantsExpired.Add(int64(n))
	w.log.Info("grants expired", "org", org, "entries", n)
	if err := w.SettleOrg(ctx, org); err != nil {
		w.Notify(org) // the pass settles it
	}
	return nil
}

// CreditGrant records a credit with grant terms (an expiry, a priority) and returns once it is
// in the hot balance, like Credit.
func (o *Ops) CreditGrant(ctx context.Context, org string, amount int64, ref string, terms grant.Options) (ledger.LedgerEntry, bool, error) {
	g, ok := o.worker.grants()
	if !ok {
		return ledger.LedgerEntry{}, false, ErrNoGrants
	}
	e, created, err := g.CreditGrant(ctx, org, amount, ref, terms)
	if err != nil {
		return e, created, err
	}
	if err := o.worker.SettleOrg(ctx, org); err != nil {
		o.worker.Notify(org)
		return e, created, fmt.Errorf("%w: credit %s: %w", ErrHotBalance, ref, err)
	}
	return e, created, nil
}

// Grants lists the org's grants in spending order, the expired last.
func (o *Ops) Grants(ctx context.Context, org string) ([]grant.Grant, error) {
	g, ok := o.worker.grants()
	if !ok {
		return nil, ErrNoGrants
	}
	return g.Grants(ctx, org)
}
