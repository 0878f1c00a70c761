package balance

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
)

// OrgSettle is what SettleMany did for one org: like Settle's answer, the statuses of its
// entries (applied or confirmed up to the first that was not) and an error — ErrCold, a
// *GapError, ErrInvalidEntry or a Redis error — when it stopped before the end.
type OrgSettle struct {
	Statuses []SettleStatus
	Err      error
}

// SettleMany settles several orgs' entries (org → its entries in Seq order) at once: every
// org's script calls go in one pipeline (one round trip; on a Cluster the client splits it,
// one per master). Each org is settled exactly as Settle does it, in sequence order, and stops
// at its first entry that is not applied or already there: a later call of the same org that
// was sent meanwhile is refused by the script in turn (the watermark only moves one step at a
// time), and its statuses are not reported. A cold org or a gap is not healed here: the caller
// seeds or catches up and settles that org again (Settle does the same on its own).
func (s *Store) SettleMany(ctx context.Context, epoch Epoch, orgs map[string][]Entry) map[string]OrgSettle {
	out := make(map[string]OrgSettle, len(orgs))
	if epoch.IsZero() {
		for org := range orgs {
			out[org] = OrgSettle{Err: fmt.Errorf("%w: zero epoch", ErrInvalidEntry)}
		}
		return out
	}
	s.ObserveEpoch(epoch)
	ep := epoch.String()
	type call struct {
		org   string
		start int // the chunk's first entry in the org's entries
	}
	var calls []call
	var keys [][]string
	var args [][]any
	for org, entries := range orgs {
		if len(entries) == 0 {
			continue
		}
		if err := checkSettle(org, entries); err != nil {
			out[org] = OrgSettle{Err: err}
			continue
		}
		out[org] = OrgSettle{Statuses: make([]SettleStatus, len(entries))}
		k := s.keys(org).settleKeys()
		for start := 0; start < len(entries); start += settleChunk {
			calls = append(calls, call{org, start})
			keys = append(keys, k)
			args = append(args, s.settleArgs(ep, entries[start:min(start+settleChunk, len(entries))]))
		}
	}
	if len(calls) == 0 {
		return out
	}
	cmds := s.pipelined(ctx, scSettle, keys, args)
	stopped := map[string]bool{}
	for i, c := range calls {
		if stopped[c.org] {
			continue
		}
		r := out[c.org]
		chunk := orgs[c.org][c.start:min(c.start+settleChunk, len(orgs[c.org]))]
		res, err := cmds[i].Slice()
		if err == nil && len(res) == 0 {
			err = errors.New("empty settle reply")
		}
		if err != nil {
			r.Err = fmt.Errorf("balance: settle: %w: %w", ErrRedis, err)
		} else {
			r.Err = settleReply(res, chunk, r.Statuses[c.start:])
		}
		if r.Err != nil {
			stopped[c.org] = true // its later chunks' answers are not reported
		}
		out[c.org] = r
	}
	return out
}

// checkSettle checks one org's entries as Settle does before sending anything.
func checkSettle(org string, entries []Entry) error {
	if err := checkOrg(org); err != nil {
		return err
	}
	var prev int64
	for i, e := range entries {
		switch {
		case e.Seq <= 0 || (i > 0 && e.Seq <= prev):
			return fmt.Errorf("%w: seq %d out of order", ErrInvalidEntry, e.Seq)
		case e.Delta < -MaxAmount || e.Delta > MaxAmount:
			return fmt.Errorf("%w: delta %d outside ±MaxAmount", ErrInvalidEntry, e.Delta)
		case e.HoldID != "" && !validHoldID(e.HoldID):
			return fmt.Errorf("%w: hold id %q", ErrInvalidEntry, e.HoldID)
		case e.HoldID != "" && (!e.GrantExpiry.IsZero() || !e.Expired.IsZero()):
			return fmt.Errorf("%w: seq %d: a grant's credit or expire entry has no hold", ErrInvalidEntry, e.Seq)
		case e.Expiries != nil && !validExpiries(*e.Expiries):
			return fmt.Errorf("%w: seq %d: expiries %v", ErrInvalidEntry, e.Seq, *e.Expiries)
		case (e.KeyID != "" && !validLimitID(e.KeyID)) || (e.Project != "" && !validLimitID(e.Project)) ||
			(e.EndUser != "" && checkScope(Scope{Kind: ScopeEndUser, ID: e.EndUser}) != nil):
			return fmt.Errorf("%w: key %q project %q end user %q", ErrInvalidEntry, e.KeyID, e.Project, e.EndUser)
		}
		prev = e.Seq
	}
	return nil
}

// settleArgs are the settle script's arguments for one chunk of entries.
func (s *Store) settleArgs(ep string, chunk []Entry) []any {
	args := make([]any, 0, 3+8*len(chunk))
	args = append(args, ep, s.tombTTL, s.clockArg)
	for _, e := range chunk {
		rt := ""
		if !e.ReservedAt.IsZero() {
			rt = strconv.FormatInt(e.ReservedAt.UnixMilli(), 10)
		}
		args = append(args, strconv.FormatInt(e.Seq, 10), strconv.FormatInt(e.Delta, 10), grantMarker(e), e.KeyID, e.Project, rt,
			strconv.FormatInt(max(e.Tokens, 0), 10), e.EndUser)
	}
	if n := len(chunk); n > 0 && chunk[n-1].Expiries != nil {
		args = append(args, expiryBlock(*chunk[n-1].Expiries, &chunk[n-1].Seq)...)
	}
	return args
}

// grantMarker is what settle gets in an entry's hold slot: the hold id, or for a grant's credit
// or expire entry its marker (lua/settle.lua), which starts with a space no hold id has.
func grantMarker(e Entry) string {
	switch {
	case !e.Expired.IsZero():
		last := "0"
		if e.LastOfExpiry {
			last = "1"
		}
		return " e:" + strconv.FormatInt(e.Expired.UnixMilli(), 10) + ":" + last
	case !e.GrantExpiry.IsZero() && e.Delta > 0:
		return " g:" + strconv.FormatInt(e.GrantExpiry.UnixMilli(), 10)
	}
	return e.HoldID
}

// expiryBlock is the scripts' block of rests per expiry: 'X', [as-of seq,] n, pairs in time
// order.
func expiryBlock(x map[int64]int64, asOf *int64) []any {
	out := []any{"X"}
	if asOf != nil {
		out = append(out, strconv.FormatInt(*asOf, 10))
	}
	out = append(out, strconv.Itoa(len(x)))
	for _, at := range slices.Sorted(maps.Keys(x)) {
		out = append(out, strconv.FormatInt(at, 10), strconv.FormatInt(x[at], 10))
	}
	return out
}

// validExpiries: rests within [0, MaxAmount], times (ms) that a script compares exactly.
func validExpiries(x map[int64]int64) bool {
	for at, rest := range x {
		if rest < 0 || rest > MaxAmount || at <= 0 || at >= 1e14 {
			return false
		}
	}
	return true
}

// settleReply reads one settle call's reply into statuses (those of chunk and of the entries
// after it): nil when every entry was applied or already there, else ErrCold (every status
// from the chunk on is Cold) or a *GapError.
func settleReply(res []any, chunk []Entry, statuses []SettleStatus) error {
	if st, _ := res[0].(string); st == "COLD" {
		for i := range statuses {
			statuses[i] = Cold
		}
		return ErrCold
	}
	if len(res) < 2 {
		return fmt.Errorf("balance: settle: %w: short reply %v", ErrRedis, res)
	}
	wm := toInt(res[1])
	for j, code := range res[2:] {
		switch toInt(code) {
		case 1:
			statuses[j] = Applied
		case 2:
			statuses[j] = Already
		case 3:
			statuses[j] = Gap
			return &GapError{Watermark: wm, Seq: chunk[j].Seq}
		}
	}
	return nil
}
