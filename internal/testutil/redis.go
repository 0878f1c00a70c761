package testutil

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// RedisEnv is an isolated Redis for one test: a client and a key prefix that no other test uses.
type RedisEnv struct {
	Client redis.UniversalClient
	Prefix string               // key namespace for this test (pass it as the store's prefix)
	Mini   *miniredis.Miniredis // nil on a real Redis
	URL    string               // the server's URL
}

// Real reports whether the environment is a real Redis server.
func (e *RedisEnv) Real() bool { return e.Mini == nil }

// RealRedisURL returns the configured real Redis URL, or "" when none is configured.
func RealRedisURL() string { return os.Getenv("ESCROW_TEST_REDIS_URL") }

// Redis returns the real Redis when ESCROW_TEST_REDIS_URL is set, miniredis otherwise.
func Redis(tb testing.TB) *RedisEnv {
	tb.Helper()
	if RealRedisURL() != "" {
		return RealRedis(tb)
	}
	return MiniRedis(tb)
}

// loadedTimeout is the read, write and pool timeout of the environments' clients: a bound on a
// server that is not answering, not a measure. go-redis's 3 s default is a measure on a loaded
// machine: miniredis runs one command at a time (a 2,000-way burst's script holds the rest), and
// the race detector slows it tenfold.
const loadedTimeout = time.Minute

// roomy gives a client's options loadedTimeout where they keep go-redis's defaults.
func roomy(o *redis.Options) *redis.Options {
	for _, d := range []*time.Duration{&o.ReadTimeout, &o.WriteTimeout, &o.PoolTimeout} {
		if *d == 0 {
			*d = loadedTimeout
		}
	}
	return o
}

// MiniRedis returns a fresh miniredis server and a client to it.
func MiniRedis(tb testing.TB) *RedisEnv {
	tb.Helper()
	m := miniredis.RunT(tb)
	c := redis.NewClient(roomy(&redis.Options{Addr: m.Addr()}))
	tb.Cleanup(func() { _ = c.Close() })
	return &RedisEnv{Client: c, Prefix: RandomName("t"), Mini: m, URL: "redis://" + m.Addr()}
}

// RealRedis returns a client to the configured real Redis with a random key prefix whose keys are
// deleted when the test ends. It skips (or fails, under ESCROW_REQUIRE_SERVICES=1) without one.
func RealRedis(tb testing.TB) *RedisEnv {
	tb.Helper()
	url := RealRedisURL()
	if url == "" {
		unavailable(tb, "ESCROW_TEST_REDIS_URL is not set")
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		tb.Fatalf("ESCROW_TEST_REDIS_URL: %v", err)
	}
	c := redis.NewClient(roomy(opt))
	// A bound on a Redis that is not there, not a measure: a loaded machine (tests running
	// while others compile, under the race detector) can take seconds to answer.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		_ = c.Close()
		unavailable(tb, "redis at %s: %v", url, err)
	}
	env := &RedisEnv{Client: c, Prefix: RandomName("t"), URL: url}
	tb.Cleanup(func() {
		DeletePrefix(context.Background(), c, env.Prefix)
		_ = c.Close()
	})
	return env
}

// DeletePrefix deletes every key under prefix+":" with SCAN (never KEYS).
func DeletePrefix(ctx context.Context, c redis.UniversalClient, prefix string) {
	del := func(ctx context.Context, n redis.Cmdable) error {
		iter := n.Scan(ctx, 0, prefix+":*", 500).Iterator()
		var batch []string
		for iter.Next(ctx) {
			batch = append(batch, iter.Val())
			if len(batch) == 500 {
				n.Unlink(ctx, batch...)
				batch = batch[:0]
			}
		}
		if len(batch) > 0 {
			n.Unlink(ctx, batch...)
		}
		return iter.Err()
	}
	if cc, ok := c.(*redis.ClusterClient); ok {
		_ = cc.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error { return del(ctx, n) })
		return
	}
	_ = del(ctx, c)
}

// EachRedis runs fn as subtests on miniredis and on the real Redis (the real one is skipped, or
// fails under ESCROW_REQUIRE_SERVICES=1, when none is configured). This is how one conformance
// suite covers every backend.
func EachRedis(t *testing.T, fn func(t *testing.T, env *RedisEnv)) {
	t.Helper()
	t.Run("miniredis", func(t *testing.T) { fn(t, MiniRedis(t)) })
	t.Run("redis", func(t *testing.T) { fn(t, RealRedis(t)) })
}
