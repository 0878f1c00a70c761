package accounting

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// OrgView is an org with its hot balance: Available is what its next request meets (nil when
// the org is cold in Redis: it is seeded on its next request), Held what its requests in flight
// hold.
type OrgView struct {
	ledger.OrgInfo
	Available *int64 `json:"available"`
	Held      int64  `json:"held"`
	// LowBalanceThreshold is the org's low-balance webhook threshold (set in Org, not in lists).
	LowBalanceThreshold *int64 `json:"low_balance_threshold,omitempty"`
}

func (o *Ops) view(ctx context.Context, info ledger.OrgInfo) (OrgView, error) {
	v := OrgView{OrgInfo: info}
	st, err := o.store.State(ctx, info.ID)
	if errors.Is(err, balance.ErrInvalidOrg) {
		// An id the hot balance refuses (older than the org-id rule) is listed without one.
		return v, nil
	}
	if err != nil {
		return v, fmt.Errorf("%w: %w", ErrHotBalance, err)
	}
	if st.Exists {
		v.Available = &st.Balance
	}
	v.Held = st.Held
	return v, nil
}

// ListOrgs lists orgs by id with their hot balances (one Redis read per org; a cold org is not
// seeded by being listed).
func (o *Ops) ListOrgs(ctx context.Context, q ledger.ListQuery) (ledger.Page[OrgView], error) {
	p, err := o.ledger.ListOrgs(ctx, q)
	if err != nil {
		return ledger.Page[OrgView]{}, err
	}
	out := ledger.Page[OrgView]{Next: p.Next, Data: make([]OrgView, 0, len(p.Data))}
	for _, info := range p.Data {
		v, err := o.view(ctx, info)
		if err != nil {
			return ledger.Page[OrgView]{}, err
		}
		out.Data = append(out.Data, v)
	}
	return out, nil
}

// Org returns one org with its hot balance.
func (o *Ops) Org(ctx context.Context, org string) (OrgView, error) {
	info, err := o.ledger.Org(ctx, org)
	if err != nil {
		return OrgView{}, err
	}
	v, err := o.view(ctx, info)
	if err != nil {
		return v, err
	}
	v.LowBalanceThreshold, err = o.lowBalanceThreshold(ctx, org)
	return v, err
}

// CreateNamedOrg creates an org with a display name ("" for none).
func (o *Ops) CreateNamedOrg(ctx context.Context, org, name string) error {
	if err := ledger.CheckName(name); err != nil {
		return err
	}
	if err := o.ledger.CreateOrg(ctx, org); err != nil {
		return err
	}
	if name == "" {
		return nil
	}
	return o.ledger.SetOrgName(ctx, org, name)
}

// CreateNamedKey makes a new API key for org with a display name; the secret is returned once.
func (o *Ops) CreateNamedKey(ctx context.Context, org, name string) (ledger.KeyInfo, string, error) {
	if err := ledger.CheckName(name); err != nil {
		return ledger.KeyInfo{}, "", err
	}
	k, secret, err := o.ledger.CreateKey(ctx, org)
	if err != nil {
		return ledger.KeyInfo{}, "", err
	}
	if name != "" {
		if err := o.ledger.SetKeyName(ctx, k.ID, name); err != nil {
			return ledger.KeyInfo{}, "", fmt.Errorf("key %s made, name not set: %w", k.ID, err)
		}
	}
	return ledger.KeyInfo{ID: k.ID, Org: k.Org, Name: name}, secret, nil
}

// Model returns one model, its prices' defaults filled in (Model.Effective): the prices its
// requests are billed at.
func (o *Ops) Model(ctx context.Context, name string) (ledger.Model, error) {
	m, err := o.ledger.Model(ctx, name)
	return m.Effective(), err
}

// ModelPatch changes some fields of a model; nil fields keep their value. Prices sets the
// price of each class it has (micro-units per the class's unit, pricing.ClassInfo), Clear
// removes the classes it names (they then take their default rule); the other classes keep
// theirs.
type ModelPatch struct {
	Prices                          pricing.Prices
	Clear                           []pricing.Class
	MaxInputTokens, MaxOutputTokens *int64
	MaxCost, DefaultHold            *int64
}

// PatchModel applies p to the model (creating it from zero values when it does not exist) and
// saves it like PutModel. A price never given stays 0 and so keeps following the input price
// (Prices.WithDefaults). It returns the model as saved, its defaults filled in (Model.Effective).
func (o *Ops) PatchModel(ctx context.Context, name string, p ModelPatch) (ledger.Model, error) {
	m, err := o.ledger.Model(ctx, name)
	if errors.Is(err, ledger.ErrUnknownModel) {
		m, err = ledger.Model{Name: name}, nil
	}
	if err != nil {
		return ledger.Model{}, err
	}
	for _, f := range []struct {
		dst *int64
		src *int64
	}{
		{&m.MaxInputTokens, p.MaxInputTokens}, {&m.MaxOutputTokens, p.MaxOutputTokens},
		{&m.MaxCost, p.MaxCost}, {&m.DefaultHold, p.DefaultHold},
	} {
		if f.src != nil {
			*f.dst = *f.src
		}
	}
	m.Prices = maps.Clone(m.Prices)
	for _, c := range p.Clear {
		delete(m.Prices, c)
	}
	if len(p.Prices) > 0 && m.Prices == nil {
		m.Prices = pricing.Prices{}
	}
	maps.Copy(m.Prices, p.Prices)
	return m.Effective(), o.PutModel(ctx, m)
}

// DeleteModel deletes a model no request has used (ErrModelInUse) and none has in flight on any
// process (ErrModelInFlight: balance.Store.ModelInFlight, whose marks outlive a process's last
// request of the model by a few seconds), and forgets its learned max in Redis. Once it returns
// no process takes a new hold for the model: the model is deleted in the ledger, marked as
// being deleted in Redis (balance.Store.MarkModelDeleting), and after the wait of a model change
// checked again for requests in flight (one priced just before the delete); when one is, or
// Redis cannot tell (ErrHotBalance), the model is put back as it was and the delete refused.
func (o *Ops) DeleteModel(ctx context.Context, name string) error {
	// The ledger answers first: a model any request used is never deleted (ErrModelInUse), and
	// that answer must not wait for the in-flight marks of its last requests to end (they
	// outlive them by seconds). A model with requests in flight but none recorded yet is deleted,
	// then found busy below and put back.
	old, err := o.ledger.Model(ctx, name)
	if err != nil {
		return err
	}
	// A model with requests in flight is refused before anything changes: a refused DELETE
	// never makes the model invisible (issue 34). The ledger's answer still comes first where
	// it can be read without deleting (a used model: ErrModelInUse, whatever is in flight). The
	// check below, after the wait, still catches a request priced just before the delete.
	if err := o.modelIdle(ctx, name); errors.Is(err, ledger.ErrModelInFlight) {
		if u, ok := o.ledger.(modelUsed); ok {
			if used, uerr := u.ModelUsed(ctx, name); uerr == nil && used {
				return fmt.Errorf("%w: %q", ledger.ErrModelInUse, name)
			}
		}
		return err
	}
	if err := o.ledger.DeleteModel(ctx, name); err != nil {
		return err
	}
	err = o.store.MarkModelDeleting(ctx, name)
	if err != nil {
		err = fmt.Errorf("%w: model %q not marked deleted: %w", ErrHotBalance, name, err)
	}
	if err == nil {
		if err = o.store.WaitModelChange(ctx); err != nil {
			err = fmt.Errorf("%w: %w", ErrHotBalance, err)
		}
	}
	if err == nil {
		err = o.modelIdle(ctx, name)
	}
	if err != nil {
		bg := context.WithoutCancel(ctx)
		if perr := o.ledger.PutModel(bg, old); perr != nil {
			return errors.Join(err, fmt.Errorf("accounting: model %q deleted all the same, not put back: %w", name, perr))
		}
		if terr := o.store.TouchModel(bg, name); terr != nil {
			// Requests for it are refused until the model is changed (PUT) again.
			return errors.Join(err, fmt.Errorf("%w: model %q put back but still marked deleted in redis: %w", ErrHotBalance, name, terr))
		}
		return err
	}
	if err := o.store.SetModelMax(ctx, name, 0); err != nil {
		return fmt.Errorf("%w: learned max of %q: %w", ErrHotBalance, name, err)
	}
	return nil
}

// modelUsed is what a ledger that can tell whether a model has usage, without deleting it,
// implements (pgledger and memledger do).
type modelUsed interface {
	ModelUsed(ctx context.Context, name string) (bool, error)
}

// modelIdle refuses (ErrModelInFlight) a model with requests in flight on some process.
func (o *Ops) modelIdle(ctx context.Context, name string) error {
	busy, err := o.store.ModelInFlight(ctx, name)
	switch {
	case err != nil:
		return fmt.Errorf("%w: requests in flight of model %q unknown: %w", ErrHotBalance, name, err)
	case busy:
		return fmt.Errorf("%w: %q", ledger.ErrModelInFlight, name)
	}
	return nil
}

// lowBalanceThreshold is the org's threshold, nil for none or without webhooks.
func (o *Ops) lowBalanceThreshold(ctx context.Context, org string) (*int64, error) {
	h, ok := o.ledger.(ledger.Webhooks)
	if !ok {
		return nil, nil
	}
	return h.LowBalanceThreshold(ctx, org)
}
