package middleware

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
)

// drainWorker runs an accounting worker's pass over what was recorded so far: it accounts the
// usage, settles it and raises the learned max costs (DESIGN.md flow step 6).
func (e *testEnv) drainWorker() {
	e.t.Helper()
	w, err := accounting.NewWorker(e.ledger, e.store, &accounting.WorkerConfig{Logger: quiet})
	must(e.t, err)
	must(e.t, w.Drain(context.Background()))
}

// TestLearnedMaxRaised: a real cost above the model's learned max raises it in Redis and in the
// ledger (by the accounting worker, from the usage event), so later holds cover such requests;
// an estimated cost never does.
func TestLearnedMaxRaised(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{storeCfg: func(c *balance.Config) { c.ModelMaxCacheTTL = time.Nanosecond }})
	ctx := context.Background()
	if m, _ := e.store.ModelMax(ctx, testModel); m != 0 {
		t.Fatalf("learned max before: %d", m)
	}
	resp := e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	want := cost(t, chatUsage)
	e.drainWorker()
	deadline := time.Now().Add(5 * time.Second)
	for {
		redisMax, err := e.store.ModelMax(ctx, testModel)
		m, lerr := e.ledger.Model(ctx, testModel)
		if err == nil && lerr == nil && redisMax == want && m.MaxCost == want {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("learned max: redis %d (%v), ledger %d (%v); want %d", redisMax, err, m.MaxCost, lerr, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The next hold is at least the learned max.
	resp = e.post(ctx, EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	e.outcome()
	if o := e.outcome(); o.HoldAmount < want {
		t.Fatalf("hold after learning: %d, want ≥ %d", o.HoldAmount, want)
	}
}
