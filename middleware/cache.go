package middleware

import (
	"context"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
)

// ttlCache is a small bounded cache for ledger look-ups (API keys, models). Concurrent misses of
// one key share one look-up. A fresh entry (younger than ttl) answers directly; after that the
// ledger is asked again, and when the ledger is unreachable a successful entry younger than
// maxStale still answers (warm orgs keep working while Postgres is down). Definitive answers
// ("unknown key") are cached like values.
type ttlCache[V any] struct {
	ttl, maxStale time.Duration
	size          int
	definitive    func(error) bool // errors worth caching (e.g. ErrUnknownKey)
	timeout       time.Duration    // bound on one look-up

	mu sync.Mutex
	m  map[string]cacheEntry[V]
	sf singleflight.Group
}

type cacheEntry[V any] struct {
	v   V
	err error
	at  time.Time
}

func newTTLCache[V any](ttl, maxStale time.Duration, size int, timeout time.Duration, definitive func(error) bool) *ttlCache[V] {
	return &ttlCache[V]{ttl: ttl, maxStale: maxStale, size: size, timeout: timeout, definitive: definitive, m: make(map[string]cacheEntry[V])}
}

func (c *ttlCache[V]) get(ctx context.Context, key string, load func(context.Context, string) (V, error)) (V, error) {
	now := time.Now()
	c.mu.Lock()
	e, ok := c.m[key]
	c.mu.Unlock()
	if ok && now.Sub(e.at) < c.ttl {
		return e.v, e.err
	}
	type result struct {
		v   V
		err error
	}
	ch := c.sf.DoChan(key, func() (any, error) {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.timeout)
		defer cancel()
		v, err := load(lctx, key)
		if err == nil || c.definitive(err) {
			c.put(key, cacheEntry[V]{v: v, err: err, at: time.Now()})
		}
		return result{v, err}, nil
	})
	var r result
	select {
	case res := <-ch:
		r = res.Val.(result)
	case <-ctx.Done():
		r.err = ctx.Err()
	}
	if r.err != nil && !c.definitive(r.err) && ok && e.err == nil && time.Since(e.at) < c.maxStale {
		return e.v, nil // stale, but the ledger cannot answer
	}
	return r.v, r.err
}

func (c *ttlCache[V]) put(key string, e cacheEntry[V]) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[key]; !ok && len(c.m) >= c.size {
		// Full: drop what is too old to serve even stale, then arbitrary entries.
		for k, x := range c.m {
			if time.Since(x.at) >= c.maxStale {
				delete(c.m, k)
			}
		}
		for k := range c.m {
			if len(c.m) < c.size {
				break
			}
			delete(c.m, k)
		}
	}
	c.m[key] = e
}
