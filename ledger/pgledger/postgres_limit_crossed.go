package pgledger

import (
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// The limits' windows in Postgres (limit_crossed.go, migration 009): the account pass reads the
// live limits of the orgs it charges with the claim (one more statement in the same round trip,
// after the accounts are locked, so no limit change lands in between), and queues the window
// statements with the charges' writes (no round trip of its own). An org without limits costs
// an index probe.

// sqlChargeLimits reads the live limits of the orgs $1, with the transaction's time (which
// window of each limit is the current one).
const sqlChargeLimits = `SELECT org_id, ` + sqlLimitColumns + `, now() FROM limits
WHERE org_id = ANY($1::text[]) AND deleted_at IS NULL ORDER BY org_id, id`

// scanChargeLimits reads sqlChargeLimits' answer: the limits by org and the transaction's time
// (zero with no limit).
func scanChargeLimits(rows pgx.Rows) (map[string][]balance.Limit, time.Time, error) {
	out := map[string][]balance.Limit{}
	var now time.Time
	var org, kind, w, u string
	var l balance.Limit
	_, err := pgx.ForEachRow(rows, []any{&org, &l.ID, &kind, &l.Scope.ID, &w, &l.Cap, &u, &l.RequireEndUser, &now}, func() error {
		l.Scope.Kind, l.Window, l.Unit = balance.ScopeKind(kind), balance.Window(w), unitOf(u)
		out[org] = append(out[org], l)
		return nil
	})
	return out, now, err
}

// sqlWindowsStart makes the missing rows of the windows $1 (limit ids), $2 (starts), $6 (end
// users: ” but for a limit of each end user apart): each one starts from the charges of its
// window [$2, $3) already in the ledger (seq ≤ $4, the org's sequence before the batch) that are
// attributed to the limit (and its end user); and drops the limits' rows of the windows before
// $5 (the current one). Existing rows are left as they are. An end-user limit sums its end
// user's charges alone (index ledger_entries_org_end_user), not the whole window's.
const sqlWindowsStart = `
WITH x AS (
	SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::timestamptz[], $4::bigint[], $5::timestamptz[], $6::text[])
		AS x(id, start, stop, base, cur, eu)
), gone AS (
	DELETE FROM limit_windows w USING x WHERE w.limit_id = x.id AND w.window_start < x.cur
)
INSERT INTO limit_windows (limit_id, window_start, end_user, used)
SELECT x.id, x.start, x.eu, coalesce(CASE WHEN l.scope = 'end_user' THEN (
	SELECT ` + sqlUnitSum + ` FROM ledger_entries e
	WHERE e.org_id = l.org_id AND e.kind = 'charge' AND e.end_user = coalesce(nullif(l.scope_id, ''), x.eu) AND e.seq <= x.base
	  AND coalesce(e.reserved_at, e.created_at) >= x.start AND coalesce(e.reserved_at, e.created_at) < x.stop
) ELSE (
	SELECT ` + sqlUnitSum + ` FROM ledger_entries e
	WHERE e.org_id = l.org_id AND e.kind = 'charge' AND e.seq <= x.base
	  AND coalesce(e.reserved_at, e.created_at) >= x.start AND coalesce(e.reserved_at, e.created_at) < x.stop
	  AND (l.scope = 'org' OR (l.scope = 'project' AND e.project = l.scope_id) OR (l.scope = 'key' AND e.key_id = l.scope_id))
) END, 0)
FROM x JOIN limits l ON l.id = x.id
WHERE NOT EXISTS (SELECT 1 FROM limit_windows w WHERE w.limit_id = x.id AND w.window_start = x.start AND w.end_user = x.eu)
ON CONFLICT DO NOTHING`

// sqlUnitSum is what the entries e count in limit l's unit (balance.Unit.Count).
const sqlUnitSum = `CASE l.unit WHEN 'requests' THEN count(*) WHEN 'tokens' THEN sum(e.tokens) ELSE sum(-e.delta) END`

// sqlWindowsAdd adds $3 to the windows $1 (limit ids), $2 (starts), $5 (end users) and writes
// a limit.crossed event for each threshold a window's spend crossed upwards, with the limit's
// cap now (naming the end user of a limit of each end user apart); a deleted limit never fires.
var sqlWindowsAdd = `
WITH x AS (
	SELECT * FROM unnest($1::bigint[], $2::timestamptz[], $3::bigint[], $5::text[]) AS x(id, start, inc, eu)
), up AS (
	UPDATE limit_windows w SET used = w.used + x.inc FROM x
	WHERE w.limit_id = x.id AND w.window_start = x.start AND w.end_user = x.eu
	RETURNING w.limit_id, w.window_start, w.end_user, w.used - x.inc AS before, w.used AS after
), ` + sqlOutbox(ledger.EventLimitCrossed, `
	SELECT l.org_id AS org, jsonb_build_object('limit_id', l.id::text, 'scope', l.scope, 'scope_id', l.scope_id,
		'window', l.period, 'window_start', CASE WHEN l.period <> 'lifetime'
			THEN to_char(up.window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"') END,
		'cap', l.cap, 'used', up.after, 'threshold', t.pct)
		|| CASE WHEN l.unit <> 'money' THEN jsonb_build_object('unit', l.unit) ELSE '{}'::jsonb END
		|| CASE WHEN up.end_user <> '' THEN jsonb_build_object('end_user', up.end_user) ELSE '{}'::jsonb END AS data
	FROM up JOIN limits l ON l.id = up.limit_id AND l.deleted_at IS NULL
	CROSS JOIN unnest($4::bigint[]) AS t(pct)
	WHERE up.before < (l.cap * t.pct + 99) / 100 AND up.after >= (l.cap * t.pct + 99) / 100
	ORDER BY l.id, up.window_start, up.end_user COLLATE "C", t.pct`) + ` SELECT 1`

// queueLimitWindows queues, for the orgs of cs with limits, the statements that move their
// windows by the charges (windowIncs at now) and write the limit.crossed events, to run in the
// charges' transaction after they are written; nothing for orgs without limits.
func queueLimitWindows(b *pgx.Batch, cs []orgCharges, now time.Time) {
	var ids, bases, incs []int64
	var starts, stops, curs []time.Time
	var endUsers []string
	for _, c := range cs {
		if len(c.limits) == 0 {
			continue
		}
		for _, w := range ledger.WindowIncs(c.limits, c.attrs, now) {
			id, _ := parseLimitID(w.Limit.ID)
			ids, bases, incs = append(ids, id), append(bases, c.base), append(incs, w.Inc)
			starts, stops, curs = append(starts, w.Start), append(stops, w.Next), append(curs, w.Current)
			endUsers = append(endUsers, w.EndUser)
		}
	}
	if len(ids) == 0 {
		return
	}
	b.Queue(sqlWindowsStart, ids, starts, stops, bases, curs, endUsers)
	b.Queue(sqlWindowsAdd, ids, starts, incs, ledger.LimitThresholds, endUsers)
}
