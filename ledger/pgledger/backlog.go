package pgledger

import "context"

// Backlog is the ledger's work not yet done by the workers.
type Backlog struct {
	PendingEvents    int64 // usage events recorded and not yet accounted
	UnsettledEntries int64 // ledger entries not yet applied to the hot balance
}

// Backlog reads the ledger's backlog in one query: the queue of pending usage and the accounts
// table (one row per org; cheap enough for a metrics scrape).
func (p *Ledger) Backlog(ctx context.Context) (Backlog, error) {
	var b Backlog
	err := p.pool.QueryRow(ctx, `SELECT
		(SELECT coalesce(sum(n), 0)::bigint FROM usage_pending),
		(SELECT COALESCE(sum(ledger_seq - settled_seq), 0)::bigint FROM accounts WHERE settled_seq < ledger_seq)`).
		Scan(&b.PendingEvents, &b.UnsettledEntries)
	if err != nil {
		return Backlog{}, wrapPg("backlog", err)
	}
	return b, nil
}
