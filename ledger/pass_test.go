package ledger

import (
	"maps"
	"slices"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

// TestAccountResultMerge: the worker merges the passes of one account run; an org charged by a
// later pass keeps only that pass's handed-over entries, or none when it was behind then, and
// the epoch is the latest read.
func TestAccountResultMerge(t *testing.T) {
	e1, e2 := balance.Epoch{Gen: 1, ID: "a"}, balance.Epoch{Gen: 2, ID: "b"}
	es := func(seqs ...int64) []balance.Entry {
		var out []balance.Entry
		for _, s := range seqs {
			out = append(out, balance.Entry{Seq: s, Delta: -1})
		}
		return out
	}
	var r AccountResult
	r.Merge(AccountResult{Accounted: 4, Orgs: []string{"a", "b", "c"}, Epoch: e1,
		Settle: map[string][]balance.Entry{"a": es(1, 2), "b": es(5)}})
	// b charged again while behind (its first entries not settled yet); c handed over now that
	// another worker settled it; d new; a untouched.
	r.Merge(AccountResult{Accounted: 3, Orgs: []string{"b", "c", "d"}, Epoch: e2,
		Settle: map[string][]balance.Entry{"c": es(8), "d": es(1)}})
	r.Merge(AccountResult{}) // an empty pass changes nothing
	if r.Accounted != 7 || len(r.Orgs) != 6 || r.Epoch != e2 {
		t.Fatalf("merged %+v", r)
	}
	if keys := slices.Sorted(maps.Keys(r.Settle)); !slices.Equal(keys, []string{"a", "c", "d"}) {
		t.Fatalf("handed over %v, want a c d", keys)
	}
	if got := r.Settle["c"]; len(got) != 1 || got[0].Seq != 8 {
		t.Fatalf("c: %+v, want the later pass's entry only", got)
	}
}
