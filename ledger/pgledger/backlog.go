package pgledger

import "context"

// Backlog is the ledger's work not yet done by the workers.
type Backlog struct {
	PendingEvents    int64 // usage events recorded and not yet accounted
	UnsettledEntries int64 // ledger entries not yet applied to the hot balance
}

// Backlog reads the ledger's backlog in one query, from the partial indexes that hold only such
// rows (cheap enough for a metrics scrape).
func (p *Ledger) Backlog(ctx context.Context) (Backlog, error) {
	var b Backlog
	err := p.pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM usage_events WHERE status = 'pending'),
		(SELECT COALESCE(sum(ledger_seq - settled_seq), 0)::bigint FROM accounts WHERE settled_seq < ledger_seq)`).
		Scan(&b.PendingEvents, &b.UnsettledEntries)
	if err != nil {
		return Backlog{}, wrapPg("backlog", err)
	}
	return b, nil
}
