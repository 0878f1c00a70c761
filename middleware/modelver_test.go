package middleware

import (
	"context"
	"io"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// lateReserve is a store whose first reserve waits until the test lets it go on.
type lateReserve struct {
	*balance.Store
	once             sync.Once
	started, proceed chan struct{}
}

func (l *lateReserve) Reserve(ctx context.Context, r balance.ReserveRequest) (balance.Reservation, error) {
	first := false
	l.once.Do(func() { first = true })
	if first {
		close(l.started)
		<-l.proceed
	}
	return l.Store.Reserve(ctx, r)
}

// TestModelChangeDuringLateReserve (issue 22 item 7): a request reads its model's prices, then
// its hold comes late — after the price was changed and the change's wait was over, as the
// admin call does before it returns. Its hold is a hold taken after the change: the request
// gives it back and is priced and held again under the new price.
func TestModelChangeDuringLateReserve(t *testing.T) {
	t.Parallel()
	late := &lateReserve{started: make(chan struct{}), proceed: make(chan struct{})}
	e := newEnv(t, envOpt{
		storeCfg: func(c *balance.Config) { c.ModelMaxCacheTTL = 100 * time.Millisecond },
		cfg: func(c *Config) {
			late.Store = c.Store.(*balance.Store)
			c.Store = late
		},
	})
	ctx := context.Background()
	type result struct {
		status int
	}
	done := make(chan result, 1)
	go func() {
		resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- result{resp.StatusCode}
	}()
	<-late.started
	newPrices := maps.Clone(testPrices)
	newPrices[pricing.Output] *= 10
	must(t, e.ledger.PutModel(ctx, ledger.Model{Name: testModel, Prices: newPrices, MaxInputTokens: 100_000, MaxOutputTokens: 1000, DefaultHold: 5000}))
	must(t, e.store.TouchModel(ctx, testModel))
	must(t, e.store.WaitModelChange(ctx))
	close(late.proceed)
	if r := <-done; r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	o := e.outcome()
	want, err := newPrices.Cost(chatUsage)
	must(t, err)
	if o.Kind != OutcomeRecorded || o.Cost != want {
		t.Fatalf("outcome %+v: want cost %d at the new price (old price: %d)", o, want, cost(t, chatUsage))
	}
	// The first hold was given back: only the second is left.
	if st := e.state(); st.Holds != 1 || st.Held != o.HoldAmount || st.Balance != testCredit-o.HoldAmount {
		t.Fatalf("hot state %+v: want one hold of %d left", st, o.HoldAmount)
	}
}
