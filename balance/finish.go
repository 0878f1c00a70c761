package balance

import (
	"context"
	"fmt"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Finish is one request whose usage is durable: its hold and its real cost.
type Finish struct {
	Org    string
	HoldID string
	Cost   int64 // micro-units, 0 ≤ Cost ≤ MaxAmount
	// Tokens is the request's real input + output tokens (≥ 0): what its tokens limits count
	// instead of its token hold.
	Tokens int64
}

// finishChunk bounds the holds of one finish script call (a script blocks Redis while it runs).
const finishChunk = 256

// Finished is what finishing one hold did.
type Finished struct {
	// Done: this call finished the hold (false: no such hold — settled, released, reaped,
	// lost —, already finished, or the call failed).
	Done bool
	// Balance is the org's available hot balance right after this call, valid when
	// HaveBalance: the org's hot balance exists and already reflects the request's cost — this
	// call finished the hold, an earlier finish did, or the hold is already settled (its id
	// tombstoned: the worker may settle a durable event before its finish runs). A hold missing
	// for another reason (lost with Redis data) gives none. Other requests of the org may move
	// the balance at any time.
	Balance     int64
	HaveBalance bool
}

// Finish finishes one hold (see FinishBatch). finished is false when there was nothing to do:
// no such hold (settled, released, reaped, lost) or already finished.
func (s *Store) Finish(ctx context.Context, org, holdID string, cost int64) (bool, error) {
	n, err := s.FinishBatch(ctx, []Finish{{Org: org, HoldID: holdID, Cost: cost}})
	return n == 1, err
}

// FinishShard names the Redis node that has org's holds: on a Cluster, the address of the
// master that the client's slot map names for them; "" for one server (or when the slot map
// cannot be read). The recorder (accounting.FinishSharder) finishes each node's holds apart, so
// that a dead master holds up only its own orgs' requests.
func (s *Store) FinishShard(org string) string {
	if s.topo.cc == nil {
		return ""
	}
	addr, _, err := s.nodeOf(context.Background(), s.keys(org).Holds)
	if err != nil {
		return ""
	}
	return addr
}

// FinishBatch is FinishEach counting the holds this call finished.
func (s *Store) FinishBatch(ctx context.Context, fs []Finish) (int, error) {
	res, err := s.FinishEach(ctx, fs)
	n := 0
	for _, r := range res {
		if r.Done {
			n++
		}
	}
	return n, err
}

// FinishEach is called right after the usage of the requests is durable (in the ledger or the
// local journal). For each existing, unfinished hold it gives the unused part back to the
// available balance at once (bal += hold − cost; with no hot balance, none is touched), makes
// the hold the request's cost, marks it finished — out of the in-flight count MaxInFlight caps —
// and sets its expiry to max(current, now+SettleDeadline). bal + Σ holds does not change; the
// settle later gives the hold back and applies the ledger entry as for any hold. A hold that is
// missing or already finished is left alone, so re-sending a finish is safe.
//
// All calls go in one pipeline (one script call per org): one round trip, one per master on a
// Cluster. It returns one Finished per element of fs, in order: whether this call finished the
// hold and the org's available balance right after it, when it reflects the request's cost
// (read by the same script call: no extra round trip). On an error (ErrInvalidOrg, ErrInvalidHoldID, ErrInvalidAmount before anything
// is sent, and nil results; else the first Redis error) some orgs' holds may be finished and
// others not, which is safe: settle works the same on both; the holds of a failed call are
// reported not Done.
func (s *Store) FinishEach(ctx context.Context, fs []Finish) ([]Finished, error) {
	if len(fs) == 0 {
		return nil, nil
	}
	// Group by org, keeping each org's first position: one script call per org and chunk.
	index := make(map[string]int, 4)
	var keys [][]string
	var args [][]any
	var pos [][]int // pos[i][j]: the index in fs of call i's j-th hold
	for n, f := range fs {
		if err := checkOrg(f.Org); err != nil {
			return nil, err
		}
		if err := checkHold(f.HoldID); err != nil {
			return nil, err
		}
		if f.Cost < 0 || f.Cost > MaxAmount || f.Tokens < 0 || f.Tokens > MaxAmount {
			return nil, fmt.Errorf("%w: cost %d, tokens %d of hold %s", ErrInvalidAmount, f.Cost, f.Tokens, f.HoldID)
		}
		i, ok := index[f.Org]
		if !ok || len(args[i]) >= 1+3*finishChunk {
			i = len(keys)
			index[f.Org] = i
			keys = append(keys, s.keys(f.Org).finishKeys())
			args = append(args, []any{s.settleDL})
			pos = append(pos, nil)
		}
		args[i] = append(args[i], f.HoldID, strconv.FormatInt(f.Cost, 10), strconv.FormatInt(f.Tokens, 10))
		pos[i] = append(pos[i], n)
	}
	var cmds []*redis.Cmd
	if len(keys) == 1 {
		cmds = []*redis.Cmd{s.run(ctx, scFinish, keys[0], args[0]...)} // no pipeline for one call
	} else {
		cmds = s.pipelined(ctx, scFinish, keys, args)
	}
	out := make([]Finished, len(fs))
	var first error
	for i, c := range cmds {
		res, err := c.Slice()
		if err == nil && len(res) != 2*len(pos[i]) {
			err = fmt.Errorf("%d items for %d holds", len(res), len(pos[i]))
		}
		if err != nil {
			if first == nil {
				first = fmt.Errorf("balance: finish: %w", err)
			}
			continue
		}
		for j, n := range pos[i] {
			r := &out[n]
			r.Done = toInt(res[2*j]) == 1
			if b, ok := res[2*j+1].(string); ok {
				v, err := strconv.ParseInt(b, 10, 64)
				r.Balance, r.HaveBalance = v, err == nil
			}
		}
	}
	return out, first
}
