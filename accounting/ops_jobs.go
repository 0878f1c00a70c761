package accounting

import (
	"context"
	"errors"

	"github.com/llmescrow/escrow/ledger/job"
)

// ErrNoJobs: the ledger has no jobs role (job.Store). Both of escrow's ledgers have it.
var ErrNoJobs = errors.New("accounting: the ledger has no jobs role")

// Jobs lists jobs (background responses, batches), newest first: status, hold, cost.
func (o *Ops) Jobs(ctx context.Context, q job.Query) ([]job.Job, error) {
	js, ok := o.ledger.(job.Store)
	if !ok {
		return nil, ErrNoJobs
	}
	out, err := js.Jobs(ctx, q)
	if out == nil {
		out = []job.Job{}
	}
	return out, err
}
