package accounting

import (
	"context"
	"time"
)

// ExpireDue is ExpireGrants with the grants due by upTo (the simulation's clock, not the wall's).
func (w *Worker) ExpireDue(ctx context.Context, upTo time.Time) (int, error) {
	g, ok := w.grants()
	if !ok {
		return 0, nil
	}
	return w.expireDue(ctx, g, upTo)
}
