package balance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"time"
)

// Models in flight: a model may be deleted only while no request of it is in flight on any
// process. Each process counts its requests per model (UseModel) and keeps a mark in Redis,
// under the model's own key, while it has any: written when the first request of the model
// starts (the only Redis call on the request path, and only when the mark is not fresh), renewed
// by one goroutine every third of its lifetime while requests run and for a short while after
// the last one ended (so that a process serving one request after another does not write it
// each time), then left to end by itself, as the mark of a process that died does.

// modelUseLife is how long a mark lives without renewal.
const modelUseLife = 6 * time.Second

// modelUses is a Store's per-model counts of requests in flight and its marks in Redis.
type modelUses struct {
	mu      sync.Mutex
	proc    string // this Store's id in the marks
	m       map[string]*modelUse
	running bool // the renewing goroutine is alive
}

type modelUse struct {
	n      int       // requests in flight
	last   time.Time // when the last request started or ended
	marked time.Time // when the last mark write that succeeded was sent (zero: none)
}

// UseModel counts a request of the model as in flight until done is called (once; later calls
// do nothing), for ModelInFlight on every process. Call it once the request's hold is taken.
// The mark in Redis is written before UseModel returns when this process has none fresh; an
// error (Redis trouble) leaves the request counted here, with no mark until the renewal
// manages one.
func (s *Store) UseModel(ctx context.Context, model string) (done func(), err error) {
	if err := checkModel(model); err != nil {
		return func() {}, err
	}
	u := &s.uses
	u.mu.Lock()
	if u.m == nil {
		u.m = map[string]*modelUse{}
		var b [8]byte
		_, _ = rand.Read(b[:])
		u.proc = hex.EncodeToString(b[:])
	}
	mu := u.m[model]
	if mu == nil {
		mu = &modelUse{}
		u.m[model] = mu
	}
	mu.n++
	now := time.Now()
	mu.last = now
	fresh := !mu.marked.IsZero() && now.Sub(mu.marked) < modelUseLife/3
	if !u.running {
		u.running = true
		go s.renewModelUses()
	}
	u.mu.Unlock()
	var once sync.Once
	done = func() {
		once.Do(func() {
			u.mu.Lock()
			mu.n--
			mu.last = time.Now()
			u.mu.Unlock()
		})
	}
	if fresh {
		return done, nil
	}
	if err := s.markModelUse(ctx, model, now); err != nil {
		return done, err
	}
	return done, nil
}

// markModelUse writes this process's mark of the model, sent at sent.
func (s *Store) markModelUse(ctx context.Context, model string, sent time.Time) error {
	if err := s.run(ctx, scModelUse, []string{s.modelUseKey(model)}, s.uses.proc, strconv.FormatInt(modelUseLife.Milliseconds(), 10)).Err(); err != nil {
		return fmt.Errorf("balance: model use: %w: %w", ErrRedis, err)
	}
	u := &s.uses
	u.mu.Lock()
	if mu := u.m[model]; mu != nil && sent.After(mu.marked) {
		mu.marked = sent
	}
	u.mu.Unlock()
	return nil
}

// renewModelUses renews, every third of a mark's life, the marks of the models with requests in
// flight (or ended within that third) and forgets the others (their marks end by themselves: a
// mark is never deleted, so that no delete can land after a newer mark); it ends when no model
// is left.
func (s *Store) renewModelUses() {
	u := &s.uses
	tick := time.NewTicker(modelUseLife / 3)
	defer tick.Stop()
	for range tick.C {
		now := time.Now()
		var renew []string
		u.mu.Lock()
		for model, mu := range u.m {
			switch {
			case mu.n > 0 || now.Sub(mu.last) < modelUseLife/3:
				if now.Sub(mu.marked) >= modelUseLife/4 {
					renew = append(renew, model)
				}
			default:
				delete(u.m, model)
			}
		}
		last := len(u.m) == 0
		if last {
			u.running = false
		}
		u.mu.Unlock()
		if len(renew) > 0 {
			ctx, cancel := context.WithTimeout(context.Background(), modelUseLife/6)
			for _, model := range renew {
				_ = s.markModelUse(ctx, model, now) // a mark not renewed ends by itself
			}
			cancel()
		}
		if last {
			return
		}
	}
}

// ModelInFlight reports whether any process has a request of the model in flight (a live mark;
// a process's mark outlives its last request by up to a few seconds).
func (s *Store) ModelInFlight(ctx context.Context, model string) (bool, error) {
	if err := checkModel(model); err != nil {
		return false, err
	}
	n, err := s.run(ctx, scModelUse, []string{s.modelUseKey(model)}, "", "").Int64()
	if err != nil {
		return false, fmt.Errorf("balance: model in flight: %w: %w", ErrRedis, err)
	}
	return n > 0, nil
}
