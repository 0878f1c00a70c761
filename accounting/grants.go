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
	orgs, err := g.ExpireGrants(ctx, time.Now().Add(-w.cfg.GrantGrace), w.cfg.AccountBatch)
	if err != nil {
		return 0, fmt.Errorf("accounting: expire grants: %w", err)
	}
	for _, org := range orgs {
		octx, cancel := context.WithTimeout(ctx, w.cfg.OrgTimeout)
		if err := w.SettleOrg(octx, org); err != nil {
			w.Notify(org) // the pass settles it
		}
		cancel()
	}
	if len(orgs) > 0 {
		w.log.Info("grants expired", "orgs", len(orgs))
	}
	return len(orgs), nil
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
