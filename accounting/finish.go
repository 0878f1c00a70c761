package accounting

import (
	"context"
	"sync"

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

// FinishSharder is a Finisher whose holds live on several servers (*balance.Store on a Redis
// Cluster): FinishShard names the server of an org's holds ("" when unknown or when there is
// one). The recorder finishes each server's holds of a batch in a call of its own, and answers
// each caller as soon as its own server has answered, so that a dead or slow server holds up
// only the requests whose holds it has.
type FinishSharder interface {
	FinishShard(org string) string
}

// maxFinishing is how many finish calls may be in flight on one shard, and maxFinishPending
// how many holds may wait for one of them. Holds that find every call busy (the server is slow,
// or a burst outran it) wait together and go in the next call as one batch: a hold that is not
// finished stays in the in-flight count until the worker settles it, and a busy but healthy
// server must not turn into false 429s at the per-org cap (issue 12). Holds that find the queue
// full too (the server is dead: each call waits up to FinishTimeout) are not finished: their
// callers are answered at once and their holds wait for the settle.
const (
	maxFinishing     = 4
	maxFinishPending = 4096
)

// finishShard is the finish state of one shard: its calls in flight and the holds waiting.
type finishShard struct {
	mu      sync.Mutex
	busy    int
	pending []*recordReq
}

// answer tells the callers of a batch that is now durable (in the ledger or the journal),
// after finishing their holds (with a Finisher). The finish is best effort: one that fails or is
// skipped changes nothing (the worker's settle gives the hold back all the same, and the hold
// is counted in flight until then), so its error is only counted and logged. It never holds up
// the flusher: each shard's finish calls run on goroutines of their own (waited for by Stop),
// and answer their callers when they return.
func (r *Recorder) answer(batch []*recordReq) {
	fin := r.cfg.Finisher
	if fin == nil {
		for _, req := range batch {
			req.done <- recordDone{}
		}
		return
	}
	sharder, _ := fin.(FinishSharder)
	var shards []string
	groups := map[string][]*recordReq{}
	for _, req := range batch {
		if req.ev.HoldAmount <= 0 { // fail-open requests have no hold
			req.done <- recordDone{}
			continue
		}
		sh := ""
		if sharder != nil {
			sh = sharder.FinishShard(req.ev.Org)
		}
		if _, ok := groups[sh]; !ok {
			shards = append(shards, sh)
		}
		groups[sh] = append(groups[sh], req)
	}
	for _, sh := range shards {
		reqs := groups[sh]
		s := r.finishShard(sh)
		s.mu.Lock()
		switch {
		case s.busy < maxFinishing:
			s.busy++
			s.mu.Unlock()
			r.finishing.Add(1)
			go r.finishOn(fin, s, reqs)
		case len(s.pending)+len(reqs) <= maxFinishPending:
			s.pending = append(s.pending, reqs...)
			s.mu.Unlock()
		default:
			s.mu.Unlock()
			r.finishSkipped.Add(int64(len(reqs)))
			for _, req := range reqs {
				req.done <- recordDone{}
			}
		}
	}
}

// finishOn finishes reqs on shard s, then the holds that queued meanwhile, until none wait.
func (r *Recorder) finishOn(fin Finisher, s *finishShard, reqs []*recordReq) {
	defer r.finishing.Done()
	for {
		r.finish(fin, reqs)
		s.mu.Lock()
		if len(s.pending) == 0 {
			s.busy--
			s.mu.Unlock()
			return
		}
		reqs, s.pending = s.pending, nil
		s.mu.Unlock()
	}
}

// finishShard is the finish state of one shard.
func (r *Recorder) finishShard(shard string) *finishShard {
	if v, ok := r.finishShards.Load(shard); ok {
		return v.(*finishShard)
	}
	v, _ := r.finishShards.LoadOrStore(shard, &finishShard{})
	return v.(*finishShard)
}

// finish finishes the holds of reqs (durable events, each with a hold) in one pipelined call
// and answers each caller with its Receipt.
func (r *Recorder) finish(fin Finisher, reqs []*recordReq) {
	fs := make([]balance.Finish, len(reqs))
	for i, req := range reqs {
		fs[i] = balance.Finish{Org: req.ev.Org, HoldID: req.ev.ID, Cost: req.ev.Cost, Tokens: req.ev.Usage.Tokens()}
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.cfg.FinishTimeout)
	defer cancel()
	res, err := fin.FinishEach(ctx, fs)
	if err != nil {
		r.finishErrs.Add(1)
		r.cfg.Logger.Warn("escrow: finishing holds failed; they are given back when the worker settles them", "holds", len(fs), "err", err)
	}
	// Counted before the callers are answered: a caller that reads Stats once its Record
	// returned sees its hold counted.
	ds := make([]recordDone, len(reqs))
	n := 0
	for i := range reqs {
		if i < len(res) {
			if res[i].Done {
				n++
			}
			if res[i].HaveBalance {
				ds[i].receipt = Receipt{Balance: res[i].Balance, HaveBalance: true}
			}
		}
	}
	r.finished.Add(int64(n))
	for i, req := range reqs {
		req.done <- ds[i]
	}
}
