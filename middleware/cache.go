package middleware

import (
	"context"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"golang.org/x/sync/singleflight"
)

// ttlCache is a small bounded cache for ledger look-ups (API keys, models). Concurrent misses of
// one key share one look-up. A fresh entry (younger than ttl) answers directly; after that the
// ledger is asked again, and when the ledger is unreachable a successful entry younger than
// maxStale still answers (warm orgs keep working while Postgres is down), once stale() allows
// it (for keys: not revoked in Redis). Definitive answers ("unknown key") are cached too, but
// apart, in a second, smaller map: a flood of random keys churns only that one and never
// evicts the entries of valid keys.
type ttlCache[V any] struct {
	ttl, maxStale time.Duration
	size, negSize int
	definitive    func(error) bool // errors worth caching (e.g. ErrUnknownKey)
	timeout       time.Duration    // bound on one look-up
	// stale, when set, decides whether a stale entry may answer while the ledger cannot: nil
	// to serve it, a definitive error to drop it (a key revoked meanwhile), any other error
	// when nobody can tell.
	stale func(ctx context.Context, v V) error

	mu  sync.Mutex
	m   map[string]cacheEntry[V] // successes
	neg map[string]negEntry      // definitive failures
	sf  singleflight.Group
}

type cacheEntry[V any] struct {
	v  V
	at time.Time
}

type negEntry struct {
	err error
	at  time.Time
}

func newTTLCache[V any](ttl, maxStale time.Duration, size, negSize int, timeout time.Duration, definitive func(error) bool) *ttlCache[V] {
	return &ttlCache[V]{ttl: ttl, maxStale: maxStale, size: size, negSize: negSize, timeout: timeout, definitive: definitive,
		m: make(map[string]cacheEntry[V]), neg: make(map[string]negEntry)}
}

func (c *ttlCache[V]) get(ctx context.Context, key string, load func(context.Context, string) (V, error)) (V, error) {
	now := time.Now()
	c.mu.Lock()
	e, ok := c.m[key]
	n, negOK := c.neg[key]
	c.mu.Unlock()
	if ok && now.Sub(e.at) < c.ttl {
		return e.v, nil
	}
	if negOK && now.Sub(n.at) < c.ttl {
		var zero V
		return zero, n.err
	}
	type result struct {
		v   V
		err error
	}
	ch := c.sf.DoChan(key, func() (any, error) {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.timeout)
		defer cancel()
		v, err := load(lctx, key)
		switch {
		case err == nil:
			c.put(key, v)
		case c.definitive(err):
			c.putNeg(key, err)
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
	if r.err != nil && !c.definitive(r.err) && ok && time.Since(e.at) < c.maxStale {
		// The ledger cannot answer: a stale entry may, if nothing says it went bad meanwhile.
		if c.stale == nil {
			return e.v, nil
		}
		err := c.stale(ctx, e.v)
		if err == nil {
			return e.v, nil
		}
		if c.definitive(err) {
			c.putNeg(key, err)
			return r.v, err
		}
	}
	return r.v, r.err
}

func (c *ttlCache[V]) put(key string, v V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.neg, key)
	if _, ok := c.m[key]; !ok {
		// Full: drop what is too old to serve even stale, then arbitrary entries.
		makeRoom(c.m, c.size, func(x cacheEntry[V]) bool { return time.Since(x.at) >= c.maxStale })
	}
	c.m[key] = cacheEntry[V]{v: v, at: time.Now()}
}

// putNeg caches a definitive failure, and forgets any success of the same key (a revoked key
// must not come back as a stale entry).
func (c *ttlCache[V]) putNeg(key string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, key)
	if _, ok := c.neg[key]; !ok {
		makeRoom(c.neg, c.negSize, func(x negEntry) bool { return time.Since(x.at) >= c.ttl })
	}
	c.neg[key] = negEntry{err: err, at: time.Now()}
}

// makeRoom makes room for one more entry in m, which holds at most size: when it is full, it
// drops the entries past use (old), then arbitrary ones until one fits.
func makeRoom[E any](m map[string]E, size int, old func(E) bool) {
	if len(m) < size {
		return
	}
	for k, x := range m {
		if old(x) {
			delete(m, k)
		}
	}
	for k := range m {
		if len(m) < size {
			break
		}
		delete(m, k)
	}
}

// failureLimiter counts unknown keys per client IP in fixed one-minute windows. It never keeps
// a key that exists from being served: a key that is not cached is always looked up, so the
// customers behind an address some client filled with random keys (a proxy, a NAT) keep working.
// Past the limit, the address's unknown keys get 429 instead of 401, and its look-ups go to the
// ledger one at a time (gate): a client trying random keys holds at most one ledger connection,
// whatever rate it sends at. It keeps at most size IPs (a flood of addresses forgets the oldest
// windows).
type failureLimiter struct {
	limit, size int
	window      time.Duration

	mu    sync.Mutex
	m     map[string]failureWindow
	gates map[string]*ipGate // addresses past the limit with look-ups waiting or running
}

type failureWindow struct {
	start time.Time
	n     int
}

// ipGate lets one look-up of an address run at a time; users counts those holding or waiting
// for it, so that the last one removes it.
type ipGate struct {
	slot  chan struct{}
	users int
}

func newFailureLimiter(limit, size int, window time.Duration) *failureLimiter {
	return &failureLimiter{limit: limit, size: size, window: window, m: make(map[string]failureWindow), gates: make(map[string]*ipGate)}
}

// allowLocked reports whether ip is within its limit, and if not, when it will be again.
func (f *failureLimiter) allowLocked(ip string, now time.Time) (bool, time.Duration) {
	w, found := f.m[ip]
	if !found || now.Sub(w.start) >= f.window || w.n < f.limit {
		return true, 0
	}
	return false, f.window - now.Sub(w.start)
}

// fail counts one unknown key from ip and reports whether it was past the limit (then the
// client gets a 429, to retry in retryIn).
func (f *failureLimiter) fail(ip string) (over bool, retryIn time.Duration) {
	if f.limit <= 0 {
		return false, 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	now := time.Now()
	ok, retryIn := f.allowLocked(ip, now)
	w, found := f.m[ip]
	if !found || now.Sub(w.start) >= f.window {
		if !found && len(f.m) >= f.size {
			for k, x := range f.m {
				if now.Sub(x.start) >= f.window {
					delete(f.m, k)
				}
			}
			for k := range f.m {
				if len(f.m) < f.size {
					break
				}
				delete(f.m, k)
			}
		}
		w = failureWindow{start: now}
	}
	w.n++
	f.m[ip] = w
	return !ok, retryIn
}

// gate waits until ip may start a ledger look-up: at once while ip is within its limit, else
// when no other look-up of ip runs. The caller calls release when its look-up is over.
func (f *failureLimiter) gate(ctx context.Context, ip string) (release func(), err error) {
	f.mu.Lock()
	if ok, _ := f.allowLocked(ip, time.Now()); ok || f.limit <= 0 {
		f.mu.Unlock()
		return func() {}, nil
	}
	g := f.gates[ip]
	if g == nil {
		g = &ipGate{slot: make(chan struct{}, 1)}
		f.gates[ip] = g
	}
	g.users++
	f.mu.Unlock()
	leave := func() {
		f.mu.Lock()
		if g.users--; g.users == 0 {
			delete(f.gates, ip)
		}
		f.mu.Unlock()
	}
	select {
	case g.slot <- struct{}{}:
		return func() { <-g.slot; leave() }, nil
	case <-ctx.Done():
		leave()
		return nil, ctx.Err()
	}
}

// clientIP is the address failed look-ups are counted against: echo's IPExtractor when one is
// configured (behind a trusted proxy), else the connection's remote address. Headers such as
// X-Forwarded-For are not trusted by default: a client could change them at will.
func clientIP(c echo.Context) string {
	if c.Echo() != nil && c.Echo().IPExtractor != nil {
		return c.RealIP()
	}
	return remoteHost(c.Request())
}

func remoteHost(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}
