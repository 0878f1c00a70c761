package accounting

import (
	"context"

	"github.com/llmescrow/escrow/balance"
)

// Finisher finishes holds right after their usage is durable (*balance.Store implements it):
// the unused part of each hold goes back to the available balance at once, and the hold leaves
// the in-flight count that the per-org cap limits (DESIGN.md "The invariant", finish).
// FinishEach answers per hold, in order, whether it was finished and the org's available
// balance right after (see balance.Store.FinishEach).
type Finisher interface {
	FinishEach(ctx context.Context, fs []balance.Finish) ([]balance.Finished, error)
}

// Receipt is what recording an event learned about its request's hold.
type Receipt struct {
	// Balance is the org's available hot balance right after the event's hold was finished
	// (the event's cost charged, the rest of its hold given back), valid when HaveBalance: the
	// recorder has a Finisher, and its finish of this batch found the org's hot balance
	// reflecting this event's cost (the hold finished, now or before, or already settled).
	// Unknown otherwise (no hold — fail-open —, the finish failed, the hold was lost, the org
	// was cold): then nothing is claimed.
	Balance     int64
	HaveBalance bool
}

// finish finishes the holds of a batch that is now durable, in one pipelined call. It is best
// effort: a finish that fails changes nothing (the worker's settle gives the hold back all the
// same, and the hold is counted in flight until then), so its error is only counted and logged.
// It returns one Receipt per event (nil without a Finisher or with nothing to finish).
func (r *Recorder) finish(events []UsageEvent) []Receipt {
	fin := r.cfg.Finisher
	if fin == nil {
		return nil
	}
	fs := make([]balance.Finish, 0, len(events))
	at := make([]int, 0, len(events)) // at[j]: the event of fs[j]
	for i, ev := range events {
		if ev.HoldAmount > 0 { // fail-open requests have no hold
			fs = append(fs, balance.Finish{Org: ev.Org, HoldID: ev.ID, Cost: ev.Cost})
			at = append(at, i)
		}
	}
	if len(fs) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.FinishTimeout)
	defer cancel()
	res, err := fin.FinishEach(ctx, fs)
	if err != nil {
		r.finishErrs.Add(1)
		r.cfg.Logger.Warn("escrow: finishing holds failed; they are given back when the worker settles them", "holds", len(fs), "err", err)
	}
	out := make([]Receipt, len(events))
	n := 0
	for j, f := range res {
		if j >= len(at) {
			break
		}
		if f.Done {
			n++
		}
		if f.HaveBalance {
			out[at[j]] = Receipt{Balance: f.Balance, HaveBalance: true}
		}
	}
	r.finished.Add(int64(n))
	return out
}
