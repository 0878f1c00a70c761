package middleware

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
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
	deadline := time.Now().Add(hangLimit)
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

// TestLearnedMaxSurvivesRedisLoss: the ledger knows a model's max cost (65, set by an admin);
// Redis loses the learned max key (a flush, a restart without persistence); a cheap request
// (cost 21) is served and accounted. The worker's raise must rebuild the key at the ledger's
// 65, never create it at 21, and the holds of requests that cannot be bounded stay at 65. On
// miniredis and on the real Redis.
func TestLearnedMaxSurvivesRedisLoss(t *testing.T) {
	t.Parallel()
	for _, mini := range []bool{true, false} {
		name := map[bool]string{true: "miniredis", false: "redis"}[mini]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envOpt{mini: mini, storeCfg: func(c *balance.Config) { c.ModelMaxCacheTTL = time.Nanosecond }})
			ctx := context.Background()
			const ledgerMax = 65
			cheap := cost(t, chatUsage)
			if cheap >= ledgerMax {
				t.Fatalf("the cheap request costs %d, not below %d", cheap, ledgerMax)
			}
			must(t, e.ledger.PutModel(ctx, ledger.Model{Name: testModel, Prices: testPrices, MaxInputTokens: 100_000,
				MaxOutputTokens: 1000, DefaultHold: 5000, MaxCost: ledgerMax}))
			must(t, e.store.SetModelMax(ctx, testModel, ledgerMax)) // what the admin call does
			must(t, e.store.SetModelMax(ctx, testModel, 0))         // lost with Redis
			// An image makes the request unboundable: its hold is the learned max.
			unbounded := `{"model":"` + testModel + `","messages":[{"role":"user","content":[{"type":"text","text":"hi"},` +
				`{"type":"image_url","image_url":{"url":"https://example.com/a.png"}}]}]}`
			post := func(body string) Outcome {
				t.Helper()
				resp := e.post(ctx, EndpointChat, e.key, body)
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("status %d", resp.StatusCode)
				}
				return e.outcome()
			}
			if o := post(unbounded); o.HoldAmount < ledgerMax || o.Cost != cheap {
				t.Fatalf("first request: hold %d cost %d, want hold ≥ %d (the ledger's max) and cost %d", o.HoldAmount, o.Cost, ledgerMax, cheap)
			}
			e.drainWorker()
			if v, err := e.store.ModelMax(ctx, testModel); err != nil || v < ledgerMax {
				t.Fatalf("learned max in Redis after the cheap request: %d (%v), want ≥ the ledger's %d", v, err, ledgerMax)
			}
			if m, err := e.ledger.Model(ctx, testModel); err != nil || m.MaxCost != ledgerMax {
				t.Fatalf("ledger max cost: %d (%v), want %d kept", m.MaxCost, err, ledgerMax)
			}
			if o := post(unbounded); o.HoldAmount < ledgerMax {
				t.Fatalf("hold after the cheap request: %d, want ≥ the ledger's max %d", o.HoldAmount, ledgerMax)
			}
		})
	}
}
