package middleware

import (
	"context"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
)

// maxRaiser is the part of the hot balance that learns a model's max cost (*balance.Store).
type maxRaiser interface {
	RaiseModelMax(ctx context.Context, model string, cost, ceiling int64) (int64, error)
}

// maxCostLedger is the part of the ledger that keeps the learned max cost durably
// (accounting.Ledger).
type maxCostLedger interface {
	RaiseMaxCost(ctx context.Context, model string, cost int64) error
}

// raiseMax raises the model's learned max cost after a real (not estimated) cost beat it, in
// Redis (which later holds read) and in the ledger (which survives Redis), capped at the
// model's bound: max input × input price + max output × output price. It runs in the
// background and never delays the response; raising is monotonic, so races are harmless.
func (m *middleware) raiseMax(model accounting.Model, cost int64) {
	ceiling, ok, err := model.CostBound()
	if err != nil || !ok {
		ceiling = balance.MaxAmount
	}
	cost = min(cost, ceiling)
	if cost <= 0 {
		return
	}
	if prev, ok := m.raised.Load(model.Name); ok && prev.(int64) >= cost {
		return // this process already raised it this far
	}
	m.raised.Store(model.Name, cost)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if r, ok := m.cfg.Store.(maxRaiser); ok {
			if _, err := r.RaiseModelMax(ctx, model.Name, cost, ceiling); err != nil {
				m.cfg.Logger.Warn("escrow: learned max cost not raised in redis", "model", model.Name, "cost", cost, "err", err)
			}
		}
		if l, ok := m.cfg.Ledger.(maxCostLedger); ok {
			if err := l.RaiseMaxCost(ctx, model.Name, cost); err != nil {
				m.cfg.Logger.Warn("escrow: learned max cost not raised in the ledger", "model", model.Name, "cost", cost, "err", err)
			}
		}
	}()
}

// learnFrom raises the model's learned max after a real cost. The learned max is the cost of
// one choice (HoldAmount multiplies it by n), so a request of n choices teaches ⌈cost / n⌉:
// held again with the same n, that covers the cost; learning the whole cost would hold n times
// too much for every later request of n choices.
func (cl *call) learnFrom(cost int64) {
	n := max(cl.req.N, 1)
	perChoice := cost / n
	if cost%n != 0 {
		perChoice++
	}
	if perChoice > cl.learned {
		cl.m.raiseMax(cl.model, perChoice)
	}
}
