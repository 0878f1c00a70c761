package middleware

import (
	"context"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// modelVersions is what a Holds that versions model changes offers (*balance.Store): the
// model's state in Redis, read with the learned max (no extra round trip), and how long after a
// change no process may still take a hold priced under the old version. With it, a change made
// through the admin operations applies to every hold taken after the change returned; without
// it, a model is trusted for KeyCacheTTL.
type modelVersions interface {
	ModelState(ctx context.Context, model string) (balance.ModelState, error)
	ModelChangeWait() time.Duration
	// UseModel counts a request of the model in flight until done (a delete of the model is
	// refused meanwhile).
	UseModel(ctx context.Context, model string) (done func(), err error)
}

// modelStamp is the model state a request was priced under (ok is false when none was read).
type modelStamp struct {
	st balance.ModelState
	ok bool
}

// lookupModel finds the model's prices: from the ledger through the model cache, keyed by the
// model's version in Redis, so that a new version is a cache miss on every process. A model
// being deleted is unknown. When Redis cannot say, the cache answers as it would without
// versions (the reserve meets the same trouble).
func (m *middleware) lookupModel(ctx context.Context, name string) (ledger.Model, modelStamp, error) {
	mv, ok := m.cfg.Store.(modelVersions)
	if !ok {
		model, err := m.models.get(ctx, name, m.cfg.Ledger.Model)
		return model, modelStamp{}, err
	}
	st, err := mv.ModelState(ctx, name)
	if err != nil {
		model, err := m.models.get(ctx, name, m.cfg.Ledger.Model)
		return model, modelStamp{}, err
	}
	stamp := modelStamp{st: st, ok: true}
	if st.Deleting {
		return ledger.Model{}, stamp, fmt.Errorf("%w: %q is being deleted", ledger.ErrUnknownModel, name)
	}
	// The version is read before the ledger: a model read under version v is at least as new
	// as v's change.
	model, err := m.models.get(ctx, name+"\x00"+st.Version, func(ctx context.Context, _ string) (ledger.Model, error) {
		return m.cfg.Ledger.Model(ctx, name)
	})
	return model, stamp, err
}

// modelChanged reports, right after a hold was taken, whether the model may have changed
// since the state it was priced under: only when that state is older than the wait of a change
// (balance.Store.ModelChangeWait; a hold taken sooner is covered by the change's own wait) is
// it read again, and it answers true only when a newer read shows another version. A state
// Redis cannot refresh leaves the hold as priced.
func (m *middleware) modelChanged(ctx context.Context, name string, stamp modelStamp) bool {
	mv, ok := m.cfg.Store.(modelVersions)
	if !ok || !stamp.ok || time.Since(stamp.st.Read) < mv.ModelChangeWait() {
		return false
	}
	st, err := mv.ModelState(ctx, name)
	if err != nil || !st.Read.After(stamp.st.Read) {
		return false
	}
	return st.Version != stamp.st.Version || st.Deleting != stamp.st.Deleting
}

// useModel counts the request as one of its model's in flight (modelVersions.UseModel) until
// the returned func is called: once its hold is taken, and before modelChanged, so that a
// delete that waited out the change sees it. Redis trouble is logged; the request goes on.
func (m *middleware) useModel(ctx context.Context, name string) func() {
	mv, ok := m.cfg.Store.(modelVersions)
	if !ok {
		return func() {}
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.ReserveTimeout)
	defer cancel()
	done, err := mv.UseModel(ctx, name)
	if err != nil {
		m.cfg.Logger.Warn("escrow: request of a model not marked in flight in redis", "model", name, "err", err)
	}
	return done
}
