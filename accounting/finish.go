package accounting

import (
	"context"

	"github.com/llmescrow/escrow/balance"
)

// Finisher finishes holds right after their usage is durable (*balance.Store implements it):
// the unused part of each hold goes back to the available balance at once, and the hold leaves
// the in-flight count that the per-org cap limits (DESIGN.md "The invariant", finish).
type Finisher interface {
	FinishBatch(ctx context.Context, fs []balance.Finish) (int, error)
}

// finish finishes the holds of a batch that is now durable, in one pipelined call. It is best
// effort: a finish that fails changes nothing (the worker's settle gives the hold back all the
// same, and the hold is counted in flight until then), so its error is only counted and logged.
func (r *Recorder) finish(events []UsageEvent) {
	fin := r.cfg.Finisher
	if fin == nil {
		return
	}
	fs := make([]balance.Finish, 0, len(events))
	for _, ev := range events {
		if ev.HoldAmount > 0 { // fail-open requests have no hold
			fs = append(fs, balance.Finish{Org: ev.Org, HoldID: ev.ID, Cost: ev.Cost})
		}
	}
	if len(fs) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.FinishTimeout)
	defer cancel()
	n, err := fin.FinishBatch(ctx, fs)
	r.finished.Add(int64(n))
	if err != nil {
		r.finishErrs.Add(1)
		r.cfg.Logger.Warn("escrow: finishing holds failed; they are given back when the worker settles them", "holds", len(fs), "err", err)
	}
}
