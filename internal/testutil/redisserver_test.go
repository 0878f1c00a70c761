package testutil

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestRedisServerLifecycleWithoutAOF(t *testing.T) {
	t.Parallel()
	s := StartRedisServer(t)
	ctx := context.Background()
	if s.Port() == sharedRedisPort || !strings.HasPrefix(s.Addr(), "127.0.0.1:") {
		t.Fatalf("private server on %s", s.Addr())
	}
	c := s.Client()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx, "persistence").Result()
	if err != nil || !strings.Contains(info, "aof_enabled:0") {
		t.Fatalf("INFO persistence: %v\n%s", err, info)
	}

	s.Stop()
	if s.Running() {
		t.Fatal("running after Stop")
	}
	probe := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer probe.Close()
	if err := probe.Ping(ctx).Err(); err == nil {
		t.Fatal("PING answered after Stop")
	}
	s.Start()
	// Without AOF and without RDB snapshots, a restart loses everything.
	if n, err := c.Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Fatalf("EXISTS k after restart without AOF: %d, %v (want 0: data lost)", n, err)
	}
}

func TestRedisServerAOFSurvivesStopAndKill(t *testing.T) {
	t.Parallel()
	s := StartRedisServer(t, RedisAppendOnly(true), RedisArgs("--appendfsync", "always"))
	ctx := context.Background()
	c := s.Client()
	if err := c.Set(ctx, "a", "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	s.Restart()
	if v, err := c.Get(ctx, "a").Result(); err != nil || v != "1" {
		t.Fatalf("after Restart with AOF: %q, %v", v, err)
	}
	if err := c.Set(ctx, "b", "2", 0).Err(); err != nil {
		t.Fatal(err)
	}
	s.Kill()
	if s.Running() {
		t.Fatal("running after Kill")
	}
	s.Start()
	if v, err := c.Get(ctx, "b").Result(); err != nil || v != "2" {
		t.Fatalf("after Kill with appendfsync always: %q, %v", v, err)
	}
	// RedisArgs reached the server.
	if cfg, err := c.ConfigGet(ctx, "appendfsync").Result(); err != nil || cfg["appendfsync"] != "always" {
		t.Fatalf("CONFIG GET appendfsync: %v, %v", cfg, err)
	}
}

func TestRedisServerFlushAndURL(t *testing.T) {
	t.Parallel()
	s := StartRedisServer(t)
	ctx := context.Background()
	opt, err := redis.ParseURL(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	defer c.Close()
	if err := c.MSet(ctx, "x", 1, "y", 2).Err(); err != nil {
		t.Fatal(err)
	}
	s.Flush()
	if n, err := c.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Fatalf("DBSIZE after Flush: %d, %v", n, err)
	}
	if p, err := c.ConfigGet(ctx, "maxmemory-policy").Result(); err != nil || p["maxmemory-policy"] != "noeviction" {
		t.Fatalf("maxmemory-policy: %v, %v", p, err)
	}
}

func TestRedisServerStartIsIdempotentAndStopKillNoops(t *testing.T) {
	t.Parallel()
	s := StartRedisServer(t)
	s.Start() // already running: nothing happens
	if s.started != 1 {
		t.Fatalf("started %d times, want 1", s.started)
	}
	s.Kill()
	s.Kill() // not running: nothing happens
	s.Stop()
	s.Start()
	if err := s.Client().Ping(context.Background()).Err(); err != nil {
		t.Fatalf("PING after Kill/Start: %v", err)
	}
}

func TestRedisServerThroughFaultProxy(t *testing.T) {
	t.Parallel()
	s := StartRedisServer(t)
	p := StartFaultProxy(t, s.Addr())
	c := redis.NewClient(&redis.Options{
		Addr: p.Addr(), ReadTimeout: time.Second, PoolSize: 1,
		MinRetryBackoff: time.Millisecond, MaxRetryBackoff: 5 * time.Millisecond,
	})
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p.DropRepliesIf(1, RequestContains("incrby"))
	n, err := c.IncrBy(ctx, "n", 5).Result()
	// Applied twice (or more, if a loaded machine also timed out a re-send): the hazard a
	// re-sent script must be safe against.
	if err != nil || n < 10 || n%5 != 0 {
		t.Fatalf("INCRBY with its first reply dropped: %d, %v (want ≥ 10: applied at least twice)", n, err)
	}
}

// outcomeRecorder records Skipf/Fatalf instead of acting on them (it panics to stop the caller).
type outcomeRecorder struct {
	testing.TB
	skipped, failed bool
	msg             string
}

func (r *outcomeRecorder) Helper() {}
func (r *outcomeRecorder) Fatalf(f string, a ...any) {
	r.failed, r.msg = true, fmt.Sprintf(f, a...)
	panic(r)
}
func (r *outcomeRecorder) Skipf(f string, a ...any) {
	r.skipped, r.msg = true, fmt.Sprintf(f, a...)
	panic(r)
}

func runRecorded(t *testing.T, fn func(tb testing.TB)) *outcomeRecorder {
	r := &outcomeRecorder{TB: t}
	func() {
		defer func() {
			if v := recover(); v != nil && v != r {
				panic(v)
			}
		}()
		fn(r)
	}()
	return r
}

func TestRedisServerMissingBinary(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	t.Setenv("ESCROW_REQUIRE_SERVICES", "1")
	r := runRecorded(t, func(tb testing.TB) { StartRedisServer(tb) })
	if !r.failed || !strings.Contains(r.msg, "redis-server") {
		t.Fatalf("under ESCROW_REQUIRE_SERVICES=1 a missing redis-server must fail the test: %+v", r)
	}
	t.Setenv("ESCROW_REQUIRE_SERVICES", "")
	r = runRecorded(t, func(tb testing.TB) { StartRedisServer(tb) })
	if !r.skipped || r.failed {
		t.Fatalf("without ESCROW_REQUIRE_SERVICES a missing redis-server skips: %+v", r)
	}
}
