package ledger

import "github.com/llmescrow/escrow/balance"

// AccountResult is what one accounting pass (Ledger.AccountPass) did.
type AccountResult struct {
	Accounted int      // usage events turned into charge entries
	Orgs      []string // the orgs that got entries, each once
	// MaxCost is, per model, the highest cost of one choice, ⌈cost / choices⌉, among the
	// accounted events whose usage was reported (estimated costs teach nothing).
	MaxCost map[string]int64
	// Settle holds, for each org of Orgs whose entries were all settled when the pass locked
	// its account (settled_seq = ledger_seq), the entries the pass wrote for it, in Seq order.
	// They are then exactly the org's unsettled entries, as UnsettledEntries would read them
	// back (Recorded included), so the worker settles them without that read. Orgs that were
	// behind are not in it: their older entries must be settled first.
	Settle map[string][]balance.Entry
	// Epoch is the ledger's epoch, read in the pass's transaction, to settle Settle with (set
	// when Settle is not empty).
	Epoch balance.Epoch
}

// Learn folds one accounted event into MaxCost.
func (r *AccountResult) Learn(model string, cost, choices int64, estimated bool) {
	if estimated || cost <= 0 {
		return
	}
	per := perChoice(cost, choices)
	if per > r.MaxCost[model] {
		if r.MaxCost == nil {
			r.MaxCost = map[string]int64{}
		}
		r.MaxCost[model] = per
	}
}

// Merge adds a later pass's result to r. An org that o charged again keeps only o's entries in
// Settle: when o has them, its earlier ones were settled before o (by another worker); when it
// has none, the org is behind and is read back whole.
func (r *AccountResult) Merge(o AccountResult) {
	r.Accounted += o.Accounted
	r.Orgs = append(r.Orgs, o.Orgs...)
	for _, org := range o.Orgs {
		if es, ok := o.Settle[org]; ok {
			if r.Settle == nil {
				r.Settle = map[string][]balance.Entry{}
			}
			r.Settle[org] = es
		} else {
			delete(r.Settle, org)
		}
	}
	if !o.Epoch.IsZero() {
		r.Epoch = o.Epoch // read later: settling r's earlier entries with it is what a read-back would do
	}
	for m, c := range o.MaxCost {
		r.Learn(m, c, 1, false)
	}
}

// perChoice is the cost of one of choices choices, rounded up: held again for the same number
// of choices (HoldAmount multiplies the learned max by it), it covers the cost; learning the
// whole cost would hold choices times too much for every later request of that many choices.
func perChoice(cost, choices int64) int64 {
	n := max(choices, 1)
	per := cost / n
	if cost%n != 0 {
		per++
	}
	return per
}
