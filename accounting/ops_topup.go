package accounting

import (
	"context"
	"errors"

	"github.com/llmescrow/escrow/ledger/topup"
)

// ErrNoPayments: the ledger has no payments role (topup.Store), so it keeps no top-up
// settings. Both of escrow's ledgers have it.
var ErrNoPayments = errors.New("accounting: the ledger has no payments role")

// Payments is the ledger's payments role (top-up settings and attempts), or ErrNoPayments.
func (o *Ops) Payments() (topup.Store, error) {
	p, ok := o.ledger.(topup.Store)
	if !ok {
		return nil, ErrNoPayments
	}
	return p, nil
}

// PutTopUp creates or replaces the org's auto top-up settings; a top-up stopped by a declined
// charge may run again from then on.
func (o *Ops) PutTopUp(ctx context.Context, s topup.Settings) (topup.Settings, error) {
	p, err := o.Payments()
	if err != nil {
		return s, err
	}
	return p.PutTopUp(ctx, s)
}

// TopUp is the org's auto top-up: its settings and its latest attempts (newest first).
type TopUp struct {
	topup.Settings
	Attempts []topup.Attempt `json:"attempts"`
}

// TopUp reads the org's settings (ErrNoTopUp) and its last 20 attempts.
func (o *Ops) TopUp(ctx context.Context, org string) (TopUp, error) {
	p, err := o.Payments()
	if err != nil {
		return TopUp{}, err
	}
	s, err := p.TopUp(ctx, org)
	if err != nil {
		return TopUp{}, err
	}
	as, err := p.TopUpAttempts(ctx, org, 20)
	if as == nil {
		as = []topup.Attempt{}
	}
	return TopUp{Settings: s, Attempts: as}, err
}

// DeleteTopUp turns the org's auto top-up off (ErrNoTopUp); an attempt in flight is still
// credited by its webhook.
func (o *Ops) DeleteTopUp(ctx context.Context, org string) error {
	p, err := o.Payments()
	if err != nil {
		return err
	}
	return p.DeleteTopUp(ctx, org)
}
