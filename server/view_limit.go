package server

import (
	"math"
	"sync"
	"time"
)

// viewLimiter is the customer views' rate limit (issue 34): a token bucket per API key (the org
// for an identity without one), rate tokens a second up to burst, in this process. A view costs
// a few rows by key in Postgres, on its own small pool; the limit keeps one poller from taking
// that pool from the org's other keys and from other orgs. Buckets that are full are dropped
// when the map grows past maxViewBuckets, so its size stays bounded by the keys polling now.
type viewLimiter struct {
	rate, burst float64
	now         func() time.Time

	mu      sync.Mutex
	buckets map[string]*viewBucket
}

type viewBucket struct {
	tokens float64
	at     time.Time
}

// maxViewBuckets is the map size past which full (idle) buckets are dropped.
const maxViewBuckets = 10_000

// newViewLimiter returns a limiter of rate a second, burst at most; rate ≤ 0 turns it off (nil).
func newViewLimiter(rate int64, burst int, now func() time.Time) *viewLimiter {
	if rate <= 0 {
		return nil
	}
	return &viewLimiter{rate: float64(rate), burst: float64(max(burst, 1)), now: now, buckets: map[string]*viewBucket{}}
}

// allow takes a token of key's bucket; when there is none it answers false and how long until
// one is back.
func (l *viewLimiter) allow(key string) (bool, time.Duration) {
	if l == nil {
		return true, 0
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[key]
	if b == nil {
		if len(l.buckets) >= maxViewBuckets {
			l.dropFull(now)
		}
		b = &viewBucket{tokens: l.burst, at: now}
		l.buckets[key] = b
	}
	if d := now.Sub(b.at); d > 0 {
		b.tokens = math.Min(l.burst, b.tokens+d.Seconds()*l.rate)
		b.at = now
	}
	if b.tokens >= 1 {
		b.tokens--
		return true, 0
	}
	wait := time.Duration((1 - b.tokens) / l.rate * float64(time.Second))
	return false, wait
}

// dropFull removes the buckets that have refilled (the caller holds l.mu).
func (l *viewLimiter) dropFull(now time.Time) {
	for k, b := range l.buckets {
		if b.tokens+now.Sub(b.at).Seconds()*l.rate >= l.burst {
			delete(l.buckets, k)
		}
	}
}
