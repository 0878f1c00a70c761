package balance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"
)

// ModelState is what Redis says of a model for the request path (Store.ModelState).
type ModelState struct {
	// Max is the learned max cost of one choice (0: none; the ledger's max cost stands in).
	Max int64
	// Version names the model's last change made through TouchModel ("" before the first): a
	// price or model cached under another version is stale.
	Version string
	// Deleting: a delete of the model is under way (MarkModelDeleting): no new request may use
	// it.
	Deleting bool
	// Read is when the read that gave this state was sent: the state is at least that recent.
	Read time.Time
}

// deletingMark prefixes the version of a model being deleted.
const deletingMark = "deleting:"

// ModelChangeWait is how long after a model's new version is written no process can still take
// a hold priced under the old one: ModelMaxCacheTTL (how long a state is served from memory)
// and a quarter more, room for a request that read the state just before the change to take
// its hold. A request whose hold is taken later than this after its model's state was read
// must read the state again before it goes on (the middleware does). Every process sharing a
// Redis must share ModelMaxCacheTTL.
func (s *Store) ModelChangeWait() time.Duration {
	return max(s.cfg.ModelMaxCacheTTL+s.cfg.ModelMaxCacheTTL/4, time.Millisecond)
}

// TouchModel gives the model a new version, after a change of it in the ledger (prices, limits,
// the model created or created again): every process reads it within ModelMaxCacheTTL and
// stops using what it cached of the model. It also ends a delete under way
// (MarkModelDeleting). WaitModelChange then waits until no process can take a new hold priced
// under the old version.
func (s *Store) TouchModel(ctx context.Context, model string) error {
	return s.setModelVersion(ctx, model, "")
}

// MarkModelDeleting marks the model as being deleted: requests for it are refused as for an
// unknown model, by every process within WaitModelChange. TouchModel ends the mark (a delete
// that did not happen, or the model created again).
func (s *Store) MarkModelDeleting(ctx context.Context, model string) error {
	return s.setModelVersion(ctx, model, deletingMark)
}

// WaitModelChange returns ModelChangeWait after it is called (or when ctx ends): called after
// TouchModel or MarkModelDeleting, it returns once no process can take a new hold priced
// under, or for, what the model was before.
func (s *Store) WaitModelChange(ctx context.Context) error {
	t := time.NewTimer(s.ModelChangeWait())
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("balance: wait for a model change: %w", ctx.Err())
	}
}

func (s *Store) setModelVersion(ctx context.Context, model, mark string) error {
	if err := checkModel(model); err != nil {
		return err
	}
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return fmt.Errorf("balance: model version: %w", err)
	}
	// A random version, never a counter: after a Redis data loss a counter would start again
	// at a value some process may still have cached.
	v := mark + hex.EncodeToString(b[:])
	if s.adm == nil {
		return fmt.Errorf("balance: model version: %w", errDataPlane)
	}
	if err := s.adm.Set(ctx, s.modelVerKey(model), v, 0).Err(); err != nil {
		s.noteErr(err)
		return fmt.Errorf("balance: model version: %w: %w", ErrRedis, err)
	}
	s.maxCache.Delete(model) // this process reads the new version at once
	return nil
}
