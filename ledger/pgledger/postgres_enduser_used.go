package pgledger

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// sqlEndUserUsed is one end user's ($2) spend of the org's ($1) lifetime limits of each end user
// apart $3 (ids) in units $4, counting the charges with seq ≤ $5, in one statement (one
// snapshot). A limit's limit_windows row (epoch, end user), kept by the account pass in the
// transaction that writes the charges, is the end user's charges up to the org's ledger_seq:
// less the end user's charges after $5 (the short tail the hot balance has not settled; index
// ledger_entries_org_end_user_seq), it is the sum up to $5 at a cost that does not grow with the
// end user's history. The row is trusted only while its limit is live, of this org, lifetime, of
// each end user apart and of the unit asked (ids are never reused; a deleted limit's row stops
// moving). Without one (the end user's charges all predate the limit, no pass charged the end
// user since the limit was made, or the limit is gone) the end user's charges up to $5 are
// summed. The CTEs run only when a row reads them (CTE scans are on demand). No row at all: the
// org has no account.
const sqlEndUserUsed = `
WITH x AS (
	SELECT * FROM unnest($3::bigint[], $4::text[]) WITH ORDINALITY AS x(id, unit, i)
), tail AS MATERIALIZED (
	SELECT coalesce(sum(-delta), 0)::bigint AS cost, count(*) AS n, coalesce(sum(tokens), 0)::bigint AS tokens FROM ledger_entries
	WHERE org_id = $1 AND kind = 'charge' AND end_user = $2 AND seq > $5
), upto AS MATERIALIZED (
	SELECT coalesce(sum(-delta), 0)::bigint AS cost, count(*) AS n, coalesce(sum(tokens), 0)::bigint AS tokens FROM ledger_entries
	WHERE org_id = $1 AND kind = 'charge' AND end_user = $2 AND seq <= $5
)
SELECT x.i, coalesce((
	SELECT w.used - CASE x.unit WHEN 'requests' THEN t.n WHEN 'tokens' THEN t.tokens ELSE t.cost END
	FROM limit_windows w JOIN limits l ON l.id = w.limit_id CROSS JOIN tail t
	WHERE w.limit_id = x.id AND w.window_start = 'epoch' AND w.end_user = $2
	  AND l.org_id = $1 AND l.deleted_at IS NULL AND l.period = 'lifetime' AND l.scope = 'end_user' AND l.scope_id = '' AND l.unit = x.unit
), (
	SELECT CASE x.unit WHEN 'requests' THEN u.n WHEN 'tokens' THEN u.tokens ELSE u.cost END FROM upto u
))
FROM x WHERE EXISTS (SELECT 1 FROM accounts WHERE org_id = $1)
ORDER BY x.i`

// EndUserUsed is endUser's spend of each of limits (the org's lifetime limits of each end user
// apart, ledger.CheckEndUserUsed) as of the org's entry upto: Σ of the end user's charges with
// seq ≤ upto in each limit's unit, what a seed at seq upto would have given that end user's
// field. The hot balance loads a field the seed left out with it. It reads the account pass's
// window row less the charges after upto (sqlEndUserUsed): the cost does not grow with the end
// user's charges. An org without an account is ErrUnknownOrg (as Snapshot); an end user no limit
// can name, or a limit of another kind, is ErrInvalidLimit; no limit is nil (nothing read). It
// writes nothing.
func (p *Ledger) EndUserUsed(ctx context.Context, org, endUser string, limits []balance.Limit, upto int64) ([]balance.WindowUsed, error) {
	if err := ledger.CheckEndUserUsed(org, endUser, limits); err != nil {
		return nil, err
	}
	if len(limits) == 0 {
		return nil, nil
	}
	ids, units := make([]int64, len(limits)), make([]string, len(limits))
	for i, l := range limits {
		id, ok := parseLimitID(l.ID)
		if !ok {
			return nil, fmt.Errorf("%w: limit id %q", ledger.ErrInvalidLimit, l.ID)
		}
		ids[i], units[i] = id, l.Unit.String()
	}
	out := make([]balance.WindowUsed, 0, len(limits))
	rows, _ := p.pool.Query(ctx, sqlEndUserUsed, org, endUser, ids, units, upto)
	var i, used int64
	_, err := pgx.ForEachRow(rows, []any{&i, &used}, func() error {
		out = append(out, balance.WindowUsed{LimitID: limits[i-1].ID, EndUser: endUser, Used: used})
		return nil
	})
	if err != nil {
		return nil, wrapPg("end user used", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return out, nil
}
