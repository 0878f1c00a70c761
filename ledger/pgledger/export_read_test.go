package pgledger

import "github.com/jackc/pgx/v5/pgxpool"

// SQLListEntries is ListEntries' query, for the plan test.
const SQLListEntries = sqlListEntries

// Pool returns the ledger's connection pool, for tests that break it on purpose.
func (p *Ledger) Pool() *pgxpool.Pool { return p.pool }

// SQLTopSpenders is TopSpenders' query for a WHERE clause, for the plan test.
var SQLTopSpenders = sqlTopSpenders
