package pgledger

import (
	"cmp"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/ledger"
)

// The pending queue (migration 016): one usage_pending row per RecordUsage call, holding the ids
// of the events it inserted and each one's org. An event is written once and never updated: it
// is pending while its id is in the queue, accounted once it has a charge entry, and the account
// pass (or a seed's snapshot) moves it from the one to the other in one transaction — it claims
// queue rows FOR UPDATE, writes the charges, and deletes the rows it emptied or rewrites the ids
// it left (an update of no indexed column, so HOT).

// sqlClaimSelect reads the events of the queue rows p (a CTE that claimed them), in queue order,
// with what the entries, the learned max and the handed-over entries need; an event is read from
// usage_events only when its org is one of $2 (locked by the caller). usage_events is also
// filtered by "= ANY" of those events' ids (on the primary key: see sqlWriteCharges), so that no
// plan, a generic one cached while the table was small included, reads the whole table.
const sqlClaimSelect = `, x AS MATERIALIZED (
	SELECT p.id AS row, x.id, x.org, x.ord FROM p CROSS JOIN LATERAL unnest(p.ids, p.orgs) WITH ORDINALITY AS x(id, org, ord)
)
SELECT x.row, x.id::text, x.org, u.id IS NOT NULL, coalesce(u.cost, 0), coalesce(u.key_id, ''), coalesce(u.project, ''),
	coalesce(u.end_user, ''), coalesce(u.reserved_at, u.created_at, 'epoch'), coalesce(u.prompt_tokens + u.completion_tokens, 0),
	coalesce(u.model, ''), coalesce(u.estimated, false), coalesce(u.choices, 1), coalesce(u.created_at, 'epoch')
FROM x LEFT JOIN usage_events u ON u.id = x.id AND x.org = ANY ($2::text[])
	AND u.id = ANY (ARRAY(SELECT id FROM x WHERE org = ANY ($2::text[])))
ORDER BY x.row, x.ord`

// sqlClaimPass claims the queue rows $1 that no one else holds (an account pass).
const sqlClaimPass = `
WITH p AS MATERIALIZED (
	SELECT id, ids, orgs FROM usage_pending WHERE id = ANY ($1::bigint[]) ORDER BY id FOR UPDATE SKIP LOCKED
)` + sqlClaimSelect

// sqlClaimOrg claims every queue row that has an event of the org $1 (a one-element array),
// waiting for a worker's claim (a snapshot: never SKIP LOCKED). A row a worker rewrote while
// this waited is read in its new version (and skipped when the worker deleted it: it had none of
// the org's events left). $2 is $1 again (sqlClaimSelect's orgs).
const sqlClaimOrg = `
WITH p AS MATERIALIZED (
	SELECT id, ids, orgs FROM usage_pending WHERE orgs && $1::text[] ORDER BY id FOR UPDATE
)` + sqlClaimSelect

// sqlPendingRows finds the oldest queue rows that hold the next $1 pending events (the first
// row past them excluded), and their orgs.
const sqlPendingRows = `
WITH r AS (
	SELECT id, orgs FROM (
		SELECT id, orgs, sum(n) OVER (ORDER BY id) - n AS before FROM usage_pending ORDER BY id LIMIT $1
	) r WHERE before < $1
)
SELECT coalesce(array(SELECT id FROM r ORDER BY id), '{}'), coalesce(array(SELECT DISTINCT o FROM r, unnest(r.orgs) AS o ORDER BY o), '{}')`

// sqlPendingOf counts an org's pending events.
const sqlPendingOf = `(SELECT count(*) FROM usage_pending p, unnest(p.orgs) AS o WHERE o = $1)`

// queuedEvent is one event of a claimed queue row.
type queuedEvent struct {
	row      int64  // its queue row
	id, org  string // the event's id and org
	found    bool   // its usage_events row was read (its org is locked and the row exists)
	attr     ledger.ChargeAttr
	model    string
	est      bool
	choices  int64
	recorded time.Time
}

// scanQueued reads sqlClaimSelect's rows.
func scanQueued(rows pgx.Rows) ([]queuedEvent, error) {
	var out []queuedEvent
	var q queuedEvent
	_, err := pgx.ForEachRow(rows, []any{&q.row, &q.id, &q.org, &q.found, &q.attr.Cost, &q.attr.Key, &q.attr.Project,
		&q.attr.EndUser, &q.attr.At, &q.attr.Tokens, &q.model, &q.est, &q.choices, &q.recorded}, func() error {
		out = append(out, q)
		return nil
	})
	return out, err
}

// queueRow is a queue row rewritten with the events left in it.
type queueRow struct {
	id        int64
	ids, orgs []string
}

// queueWrites are what a transaction does to the queue rows it claimed (qs, their events in
// queue order): take the events of taken out of them, deleting the rows it empties and rewriting
// the others.
type queueWrites struct {
	qs    []queuedEvent
	taken map[int]bool // indexes into qs
}

// take picks, among the claimed events qs, those of the orgs locked says yes to: up to limit
// (≤ 0: all) of the found ones, oldest first (created_at, then id), and every one whose event row
// is gone (a ledger restored without it: nothing to charge, it leaves the queue). It returns the
// picked events in that order and the writes that take them out of their queue rows.
func take(qs []queuedEvent, locked func(org string) bool, limit int) ([]queuedEvent, queueWrites) {
	var cand []int
	w := queueWrites{qs: qs, taken: map[int]bool{}}
	for i, q := range qs {
		if !locked(q.org) {
			continue
		}
		if !q.found {
			w.taken[i] = true
			continue
		}
		cand = append(cand, i)
	}
	slices.SortStableFunc(cand, func(a, b int) int {
		return cmp.Or(qs[a].recorded.Compare(qs[b].recorded), cmp.Compare(qs[a].id, qs[b].id))
	})
	if limit > 0 && len(cand) > limit {
		cand = cand[:limit]
	}
	picked := make([]queuedEvent, 0, len(cand))
	for _, i := range cand {
		w.taken[i] = true
		picked = append(picked, qs[i])
	}
	return picked, w
}

// keep leaves the found events of org in the queue after all (their charges were refused).
func (w queueWrites) keep(org string) {
	for i, q := range w.qs {
		if q.org == org && q.found {
			delete(w.taken, i)
		}
	}
}

// rows returns the queue rows to delete and the ones to rewrite.
func (w queueWrites) rows() (del []int64, rewrite []queueRow) {
	qs := w.qs
	for i := 0; i < len(qs); {
		j := i
		left := queueRow{id: qs[i].row}
		for ; j < len(qs) && qs[j].row == qs[i].row; j++ {
			if !w.taken[j] {
				left.ids = append(left.ids, qs[j].id)
				left.orgs = append(left.orgs, qs[j].org)
			}
		}
		switch {
		case len(left.ids) == 0:
			del = append(del, left.id)
		case len(left.ids) < j-i:
			rewrite = append(rewrite, left)
		}
		i = j
	}
	return del, rewrite
}

// empty reports whether there is nothing to write.
func (w queueWrites) empty() bool { return len(w.taken) == 0 }

// queue queues the queue writes on b (in the caller's transaction).
func (w queueWrites) queue(b *pgx.Batch) {
	del, rewrite := w.rows()
	if len(del) > 0 {
		b.Queue(`DELETE FROM usage_pending WHERE id = ANY ($1::bigint[])`, del)
	}
	for _, r := range rewrite {
		b.Queue(`UPDATE usage_pending SET n = $2, ids = $3::text[]::uuid[], orgs = $4 WHERE id = $1`, r.id, len(r.ids), r.ids, r.orgs)
	}
}

// addTo appends the picked event q to its org's charges c.
func (q *queuedEvent) addTo(c *orgCharges) {
	c.ids = append(c.ids, q.id)
	c.costs = append(c.costs, q.attr.Cost)
	c.attrs = append(c.attrs, q.attr)
	c.recorded = append(c.recorded, q.recorded)
}
