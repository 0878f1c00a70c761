package accounting_test

import (
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/pricing"
)

// ---- jobs (fourth wave, DESIGN.md "Async work"): the simulation's job draws ----
//
// A job is a request whose hold is owned by the job: reserved like a request, recorded in the
// ledger (job.Store.CreateJob) and pinned; then, at random, a lease holder renews the pin, a
// holder crashes and the pin lapses (its hold gets a normal expiry: the reaper looks at it, and
// only the ledger's live-job check keeps it — the reaper step's "never the hold of unsettled
// usage" check covers it, UnsettledUsage reporting live jobs), or some path settles the job
// (job.Store.SettleJob), sometimes two paths at once: billed exactly once. Every check of the
// simulation holds after each of these steps; at rest every job is settled and billed once.

// jobStep draws one job operation on org o.
func (s *simulator) jobStep(o string) {
	js, ok := s.ledger.(job.Store)
	if !ok {
		return
	}
	if s.jobs == nil {
		s.jobs = map[string]simReq{}
	}
	live := slices.Sorted(maps.Keys(s.jobs))
	switch d := s.rnd.Float64(); {
	case d < 0.4 || len(live) == 0: // a background job starts
		s.counts["job"]++
		id := uuid.Must(uuid.NewV7()).String()
		amt, tok := s.rnd.Int64N(60)+1, s.rnd.Int64N(120)
		key, eu := s.keys[o][s.rnd.IntN(len(s.keys[o]))], s.drawEndUser()
		res, err := s.store.Reserve(s.ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: amt, KeyID: key, Tokens: tok, EndUser: eu})
		switch {
		case err == nil:
		case errors.Is(err, balance.ErrInsufficient), errors.Is(err, balance.ErrLimit), errors.Is(err, balance.ErrFrozen),
			errors.Is(err, balance.ErrCold):
			return
		default:
			s.must(err)
		}
		r := simReq{org: o, id: id, amount: amt, bound: amt, tokens: tok, endUser: eu, key: key, project: res.Project, at: res.ReservedAt}
		_, _, err = js.CreateJob(s.ctx, job.Job{ID: id, Kind: job.BackgroundResponse, Org: o, KeyID: key, Project: res.Project,
			EndUser: eu, Model: "m", UpstreamID: "resp_" + id, Hold: amt, ReservedAt: res.ReservedAt, Estimate: 1,
			Prices: pricing.Prices{pricing.Input: 1, pricing.Output: 1}})
		s.must(err)
		s.jobs[id] = r
		s.servedOrg[id] = o // the client got the job's id: it must be billed
		if s.rnd.Float64() < 0.9 {
			_, err = s.store.Pin(s.ctx, o, id)
			s.must(err)
		}
	case d < 0.55: // the lease holder renews the pin
		s.counts["job-pin"]++
		r := s.jobs[live[s.rnd.IntN(len(live))]]
		_, err := s.store.Pin(s.ctx, r.org, r.id)
		s.must(err)
	case d < 0.7: // the lease holder crashed: nobody renews the pin, which lapses
		s.counts["job-lapse"]++
		r := s.jobs[live[s.rnd.IntN(len(live))]]
		_, err := s.store.Unpin(s.ctx, r.org, r.id)
		s.must(err)
	default: // a path sees the job's end and settles it (now and then two paths at once)
		r := s.jobs[live[s.rnd.IntN(len(live))]]
		s.settleJob(js, r)
	}
}

// settleJob settles one live job with a drawn cost: the poller, the client's GET or a stream,
// maybe two of them; exactly one is first.
func (s *simulator) settleJob(js job.Store, r simReq) {
	s.counts["job-settle"]++
	u := s.drawCost(r)
	hold := s.holds(r.org)[r.id]
	firsts := 0
	for range 1 + s.rnd.IntN(2) {
		_, first, err := js.SettleJob(s.ctx, r.id, job.Settlement{Status: job.Completed,
			Lines: []job.Line{{Usage: pricing.Usage{Completion: u.tokens}, Cost: u.cost}}})
		s.must(err)
		if first {
			firsts++
		}
	}
	if firsts != 1 {
		s.t.Fatalf("seed %d: job %s settled by %d paths", s.seed, r.id, firsts)
	}
	s.holdAtRecord[r.id] = hold
	s.costOf[r.id] = u.cost
	delete(s.jobs, r.id)
	s.ended = append(s.ended, r)
}

// settleJobs settles every live job (at rest: the pollers finish them all).
func (s *simulator) settleJobs() {
	js, ok := s.ledger.(job.Store)
	if !ok {
		return
	}
	for _, id := range slices.Sorted(maps.Keys(s.jobs)) {
		s.settleJob(js, s.jobs[id])
	}
	n, err := js.LiveJobs(s.ctx)
	s.must(err)
	if n[job.BackgroundResponse] != 0 {
		s.t.Fatalf("seed %d: %s jobs live at rest", s.seed, fmt.Sprint(n))
	}
}
