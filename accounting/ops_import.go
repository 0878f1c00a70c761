package accounting

import (
	"context"
	"errors"
	"fmt"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"maps"
)

// PriceChange is a model whose prices or token limits an import changes.
type PriceChange struct {
	Old ledger.Model `json:"old"`
	New ledger.Model `json:"new"`
}

// ImportReport says what an import of a price table did (or, in a dry run, would do).
type ImportReport struct {
	DryRun    bool                   `json:"dry_run"`
	New       []ledger.Model         `json:"new"`
	Changed   []PriceChange          `json:"changed"`
	Unchanged []string               `json:"unchanged"`
	Skipped   []pricing.SkippedPrice `json:"skipped"`
	// RoundedUp lists "model: field" for every price that was not a whole number of
	// micro-units per 1M tokens and was rounded up.
	RoundedUp []string `json:"rounded_up"`
}

// ImportPrices applies a parsed price table to the ledger: each row's prices (input, cached
// input, output, and every other class the table gives: pricing.PriceRow) and the token limits it
// gives replace the model's; a new model is created with them (a cache-write price the table
// does not give is then 0: its default, Prices.WithDefaults). A model whose prices and limits
// would bill the same (Model.Effective) is unchanged. The report shows models with their
// defaults filled in. Everything else of an existing model stays: its default hold and its learned max
// cost, in the ledger and in Redis (an import never lowers or resets what requests taught the
// store; the ledger's copy is raised back to Redis' value should a request have raised it
// while the import wrote). With dryRun, nothing is written and the report says what would be.
// An error stops the import: the report then lists what was written before it.
func (o *Ops) ImportPrices(ctx context.Context, t pricing.PriceTable, dryRun bool) (ImportReport, error) {
	r := ImportReport{DryRun: dryRun, New: []ledger.Model{}, Changed: []PriceChange{}, Unchanged: []string{}, Skipped: t.Skipped,
		RoundedUp: []string{}}
	if r.Skipped == nil {
		r.Skipped = []pricing.SkippedPrice{}
	}
	changed := false
	for _, row := range t.Rows {
		for _, f := range row.RoundedUp {
			r.RoundedUp = append(r.RoundedUp, row.Model+": "+f)
		}
		old, err := o.ledger.Model(ctx, row.Model)
		isNew := errors.Is(err, ledger.ErrUnknownModel)
		if err != nil && !isNew {
			return r, err
		}
		m := old
		if isNew {
			m = ledger.Model{Name: row.Model}
		}
		// The classes the table gives replace the model's; one it does not give keeps the
		// model's own price (none for a new model: its default, pricing.Prices.Price).
		m.Prices = maps.Clone(old.Prices)
		if m.Prices == nil {
			m.Prices = pricing.Prices{}
		}
		maps.Copy(m.Prices, row.Prices)
		if row.MaxInputTokens != nil {
			m.MaxInputTokens = *row.MaxInputTokens
		}
		if row.MaxOutputTokens != nil {
			m.MaxOutputTokens = *row.MaxOutputTokens
		}
		switch {
		case !isNew && m.Effective().Equal(old.Effective()):
			r.Unchanged = append(r.Unchanged, row.Model)
			continue
		case isNew:
			r.New = append(r.New, m.Effective())
		default:
			r.Changed = append(r.Changed, PriceChange{Old: old.Effective(), New: m.Effective()})
		}
		if dryRun {
			continue
		}
		if err := o.importModel(ctx, m); err != nil {
			return r, err
		}
		// A new version for each model written; one wait at the end for all that changed.
		if err := o.modelChanged(ctx, false, m.Name); err != nil {
			return r, err
		}
		changed = changed || !isNew
	}
	if changed {
		return r, o.modelChanged(ctx, true)
	}
	return r, nil
}

// importModel writes m without touching the learned max in Redis, then raises the ledger's max
// cost to Redis' (a request may have raised both between the read and the write).
func (o *Ops) importModel(ctx context.Context, m ledger.Model) error {
	if err := o.ledger.PutModel(ctx, m); err != nil {
		return fmt.Errorf("import %q: %w", m.Name, err)
	}
	learned, err := o.store.ModelMax(ctx, m.Name)
	if err != nil {
		return fmt.Errorf("%w: import %q: learned max not read back: %w", ErrHotBalance, m.Name, err)
	}
	if learned > m.MaxCost {
		if err := o.ledger.RaiseMaxCost(ctx, m.Name, learned); err != nil {
			return fmt.Errorf("import %q: %w", m.Name, err)
		}
	}
	return nil
}
