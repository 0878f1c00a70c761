package accounting

import "context"

// Pass runs one pass of the settle loop (account, then settle the orgs it charged, the dirty
// ones and, with sweep, those the ledger says are behind), for the tests that count its
// statements.
func (w *Worker) Pass(ctx context.Context, sweep bool) error { return w.pass(ctx, sweep) }
