package accounting

import (
	"context"
	"errors"
	"fmt"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// ErrHotBalance marks an operation whose ledger part is durable but whose hot-balance (Redis)
// part failed: the returned value is valid, and the worker catches the hot balance up later.
var ErrHotBalance = errors.New("accounting: hot balance not updated")

// Ops are the operator's operations, each one call that does the ledger part and then what the
// hot balance needs, so that no caller (the admin API, a CLI, an embedding program) has to know
// the order: a credit or an adjustment is settled into Redis before it returns, a model's max
// cost reaches the store's learned max, a new epoch is seen by the store at once.
type Ops struct {
	ledger ledger.Ledger
	store  *balance.Store
	worker *Worker
}

// NewOps returns the operations over the worker's ledger and store (one source for both, so
// they cannot disagree).
func NewOps(w *Worker) *Ops {
	return &Ops{ledger: w.ledger, store: w.store, worker: w}
}

// Ledger is the ledger the operations run over. What needs nothing of the hot balance is asked
// of it directly, through its roles: creating an org or a key without a name (Accounts,
// KeyStore), the console's lists, names, reports and audit trail (Console), webhook endpoints
// and thresholds (Webhooks, when the ledger has that role).
func (o *Ops) Ledger() ledger.Ledger { return o.ledger }

// Credit records a recharge (idempotent by ref) and returns once it is in the hot balance. When
// only the hot-balance part failed, the entry is valid and the error wraps ErrHotBalance.
func (o *Ops) Credit(ctx context.Context, org string, amount int64, ref string) (ledger.LedgerEntry, bool, error) {
	e, created, err := o.worker.Credit(ctx, org, amount, ref)
	if err != nil && e.Seq != 0 {
		return e, created, fmt.Errorf("%w: %w", ErrHotBalance, err)
	}
	return e, created, err
}

// Adjust records a signed admin correction (idempotent by ref) and settles it into the hot
// balance like Credit; when only that part failed, the worker is told and the error wraps
// ErrHotBalance.
func (o *Ops) Adjust(ctx context.Context, org string, delta int64, ref string) (ledger.LedgerEntry, bool, error) {
	e, created, err := o.ledger.Adjust(ctx, org, delta, ref)
	if err != nil {
		return e, created, err
	}
	if err := o.worker.SettleOrg(ctx, org); err != nil {
		o.worker.Notify(org)
		return e, created, fmt.Errorf("%w: adjustment %s: %w", ErrHotBalance, ref, err)
	}
	return e, created, nil
}

// Balance is an org's money as the ledger and the hot balance see it.
type Balance struct {
	Org           string `json:"org"`
	LedgerBalance int64  `json:"ledger_balance"`
	Available     int64  `json:"available"`
	Held          int64  `json:"held"`
	Holds         int    `json:"holds"`
	LedgerSeq     int64  `json:"ledger_seq"`
	SettledSeq    int64  `json:"settled_seq"`
	Watermark     int64  `json:"watermark"`
	// Exempt: the org's requests are never held nor refused for balance (ledger access.OrgFlags); its
	// balance may be negative.
	Exempt bool `json:"exempt"`
	// Expired: credit whose grant expired, already out of Available, whose expire entry the
	// ledger has not written or settled yet (docs/grants.md).
	Expired int64 `json:"expired,omitempty"`
}

// Balance reads the org's account and its hot balance, seeding a cold org first so the answer
// is what its next request meets. A failing Redis wraps ErrHotBalance.
func (o *Ops) Balance(ctx context.Context, org string) (Balance, error) {
	acct, err := o.ledger.Account(ctx, org)
	if err != nil {
		return Balance{}, err
	}
	info, err := o.ledger.Org(ctx, org)
	if err != nil {
		return Balance{}, err
	}
	st, err := o.store.State(ctx, org)
	if err == nil && !st.Exists {
		if err = o.store.Warm(ctx, org); err == nil {
			st, err = o.store.State(ctx, org)
		}
	}
	if err != nil {
		return Balance{}, fmt.Errorf("%w: %w", ErrHotBalance, err)
	}
	return Balance{
		Org: org, LedgerBalance: acct.Balance, Available: st.Balance, Held: st.Held, Holds: st.Holds, Expired: st.Expired,
		LedgerSeq: acct.LedgerSeq, SettledSeq: acct.SettledSeq, Watermark: st.Watermark, Exempt: info.Exempt,
	}, nil
}

// Reconcile compares the org's hot balance with the ledger and repairs a drift.
func (o *Ops) Reconcile(ctx context.Context, org string) (Drift, error) {
	return o.worker.Reconcile(ctx, org)
}

// RevokeKey revokes a key by id (ErrUnknownKey) in the ledger, then pushes the revocation to
// Redis (balance.Store.RevokeKey), so that no process serves the key from a stale cache entry
// while its ledger is unreachable: the revocation takes effect within the key cache's TTL
// everywhere. When only the Redis part failed, the key is revoked all the same (effective within
// the TTL while the ledger answers), the error wraps ErrHotBalance, and revoking again is safe.
func (o *Ops) RevokeKey(ctx context.Context, id string) error {
	if err := o.ledger.RevokeKey(ctx, id); err != nil {
		return err
	}
	if err := o.store.RevokeKey(ctx, id); err != nil {
		return fmt.Errorf("%w: revocation of key %s not pushed to redis: %w", ErrHotBalance, id, err)
	}
	return nil
}

// PutModel creates or replaces a model in the ledger, then sets the store's learned max cost to
// the model's MaxCost (so an admin can lower it) and gives the model a new version in Redis
// (balance.Store.TouchModel). A model that existed is changed for every hold taken after
// PutModel returns, on every process: it waits until none can still price a hold from what it
// cached (balance.Store.WaitModelChange, about a second). When only the Redis part failed, the
// model is saved and the error wraps ErrHotBalance (the change then reaches the processes within
// their model cache's TTL).
func (o *Ops) PutModel(ctx context.Context, m ledger.Model) error {
	_, err := o.ledger.Model(ctx, m.Name)
	existed := err == nil
	if err := o.ledger.PutModel(ctx, m); err != nil {
		return err
	}
	// The ledger keeps the larger of the max cost given and the one it learned; Redis is raised
	// to it, never lowered (a price change does not forget what requests have cost).
	stored, err := o.ledger.Model(ctx, m.Name)
	if err != nil {
		return err
	}
	if stored.MaxCost > 0 {
		if _, err := o.store.RaiseModelMax(ctx, m.Name, stored.MaxCost, stored.MaxCost, stored.MaxCost); err != nil {
			return fmt.Errorf("%w: learned max of %q: %w", ErrHotBalance, m.Name, err)
		}
	}
	return o.modelChanged(ctx, existed, m.Name)
}

// modelChanged gives the models a new version in Redis and, when existed (some process may hold
// their old prices), waits until no process can take a hold priced under the old version.
func (o *Ops) modelChanged(ctx context.Context, existed bool, names ...string) error {
	for _, name := range names {
		if err := o.store.TouchModel(ctx, name); err != nil {
			return fmt.Errorf("%w: version of model %q: %w", ErrHotBalance, name, err)
		}
	}
	if !existed {
		return nil
	}
	if err := o.store.WaitModelChange(ctx); err != nil {
		return fmt.Errorf("%w: %w", ErrHotBalance, err)
	}
	return nil
}

// Models lists every model, each with its prices' defaults filled in (Model.Effective).
func (o *Ops) Models(ctx context.Context) ([]ledger.Model, error) {
	ms, err := o.ledger.Models(ctx)
	for i := range ms {
		ms[i] = ms[i].Effective()
	}
	return ms, err
}

// SyncEpoch reads the ledger's epoch and hands it to the store (at start: a ledger that does
// not answer, or has no schema, is an error).
func (o *Ops) SyncEpoch(ctx context.Context) (balance.Epoch, error) {
	e, err := o.ledger.Epoch(ctx)
	if err != nil {
		return e, err
	}
	o.store.ObserveEpoch(e)
	return e, nil
}

// RaiseEpoch starts a new ledger epoch (after restoring the ledger from a backup); the store
// sees it at once, so every hot balance of the old timeline is dropped and reseeded on its next
// use.
func (o *Ops) RaiseEpoch(ctx context.Context) (balance.Epoch, error) {
	e, err := o.ledger.RaiseEpoch(ctx)
	if err != nil {
		return e, err
	}
	o.store.ObserveEpoch(e)
	return e, nil
}
