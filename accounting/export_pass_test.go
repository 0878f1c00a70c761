package accounting

import "context"

// The worker's batched statements, for the plan test.
const (
	SQLUnsettledOf  = sqlUnsettledOf
	SQLLockAccounts = sqlLockAccounts
	SQLClaim        = sqlClaim
	SQLWriteCharges = sqlWriteCharges
	SQLChargeLimits = sqlChargeLimits
	SQLMarkSettled  = sqlMarkSettledMany
)

// SQLLowBalance is the balance.low outbox statement, for the plan test.
var SQLLowBalance = sqlOutboxLowBalance

// Pass runs one pass of the settle loop (account, then settle the orgs it charged, the dirty
// ones and, with sweep, those the ledger says are behind), for the tests that count its
// statements.
func (w *Worker) Pass(ctx context.Context, sweep bool) error { return w.pass(ctx, sweep) }
