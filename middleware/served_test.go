package middleware

import (
	"context"
	"strings"
	"testing"
)

// TestServedStreamBilledWhileLedgerStalls (issue 34, served ⇒ billed): a stream's content
// reaches the client while the ledger stalls past the record timeout, with no journal. Before
// the fix the event was voided and the client got an error in place of [DONE]: served, never
// billed. Now the event is never voided and its hold never released: the client gets its end,
// the hold stays while the ledger stalls, and once the ledger answers the event is charged
// exactly once (the stalled write and the retries are one event by id).
func TestServedStreamBilledWhileLedgerStalls(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, pg bool) {
		e := newLedgerEnv(t, pg, stallRecordTimeout)
		ctx := context.Background()
		e.ledger.stallRecords(stallBefore)
		status, body, err := e.do(e.key, jsonBody(testModel, `"stream":true`))
		must(t, err)
		if status != 200 || !strings.Contains(body, "[DONE]") || strings.Contains(body, CodeBillingFailed) {
			t.Fatalf("status %d: %s", status, body)
		}
		o := e.outcome()
		if o.Kind != OutcomeRecordLater || !o.Usage.Equal(chatUsage) || o.Cost != cost(t, chatUsage) {
			t.Fatalf("outcome %+v", o)
		}
		// The ledger still stalls: the hold is kept (never released), nothing is charged yet.
		st, err := e.store.State(ctx, e.org)
		must(t, err)
		if st.Holds != 1 || st.Held == 0 {
			t.Fatalf("hot balance %+v: the served request's hold must stay until its usage is stored", st)
		}
		e.ledger.unstall()
		e.ledger.waitCommitted(t)
		// The retries land too (no-ops by id); wait until the event is accounted and settled.
		waitFor(t, func() bool {
			must(t, e.worker.Drain(ctx))
			a, err := e.ledger.Account(ctx, e.org)
			must(t, err)
			st, err := e.store.State(ctx, e.org)
			must(t, err)
			return a.Balance == ledgerEnvCredit-o.Cost && st.Holds == 0
		}, "the served request billed once and its hold settled")
		e.ledger.stalls.Wait()
		e.settle(o.Cost, 1)
	})
}
