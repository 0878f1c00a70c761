package testutil

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestRedisCluster(t *testing.T) {
	t.Parallel()
	start := time.Now()
	rc := StartRedisCluster(t)
	t.Logf("3-master cluster ready in %v", time.Since(start))
	ctx := context.Background()
	c := rc.Client()

	t.Run("CrossSlotScriptFails", func(t *testing.T) {
		if clusterKeySlot("a") == clusterKeySlot("b") {
			t.Fatal("test keys share a slot")
		}
		err := c.Eval(ctx, "return 1", []string{"a", "b"}).Err()
		if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
			t.Fatalf("EVAL on keys of two slots: want CROSSSLOT, got %v", err)
		}
	})

	t.Run("HashTaggedScriptWorks", func(t *testing.T) {
		keys := []string{"esc:{org1}:acct", "esc:{org1}:holds"}
		script := "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[1]); return redis.call('GET', KEYS[2])"
		v, err := c.Eval(ctx, script, keys, "42").Text()
		if err != nil || v != "42" {
			t.Fatalf("EVAL on one hash tag: %q, %v", v, err)
		}
		// The keys live on the node NodeFor names, and only there.
		owner := rc.NodeFor(keys[0])
		for _, n := range rc.Nodes {
			got, err := n.Client().Do(ctx, "EXISTS", keys[0]).Int()
			if n == owner && (err != nil || got != 1) {
				t.Fatalf("owner %s: EXISTS = %d, %v", n.Addr(), got, err)
			}
			if n != owner && got != 0 {
				t.Fatalf("non-owner %s holds the key", n.Addr())
			}
		}
	})

	t.Run("KeySlotMatchesServer", func(t *testing.T) {
		for _, k := range []string{"", "a", "foo", "{user1000}.following", "foo{}{bar}", "foo{{bar}}zap", "esc:{org-7}:hexp", "esc:model:gpt-4o:max"} {
			want, err := rc.Nodes[0].Client().ClusterKeySlot(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			if got := clusterKeySlot(k); int64(got) != want {
				t.Fatalf("slot(%q) = %d, server says %d", k, got, want)
			}
		}
	})

	t.Run("ThreeMastersShareTheKeys", func(t *testing.T) {
		for i := 0; i < 60; i++ {
			if err := c.Set(ctx, fmt.Sprintf("spread:%d", i), i, 0).Err(); err != nil {
				t.Fatal(err)
			}
		}
		var masters atomic.Int32
		err := c.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
			masters.Add(1)
			size, err := n.DBSize(ctx).Result()
			if err != nil {
				return err
			}
			if size == 0 {
				return fmt.Errorf("master %s has no keys", n.Options().Addr)
			}
			return nil
		})
		if err != nil || masters.Load() != 3 {
			t.Fatalf("ForEachMaster: %d masters, %v", masters.Load(), err)
		}
	})
}

func TestRedisClusterNodeRestartRejoins(t *testing.T) {
	t.Parallel()
	rc := StartRedisCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // bounds a hang
	defer cancel()
	c := rc.Client()
	key := "esc:{lost}:acct"
	if err := c.Set(ctx, key, "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	n := rc.NodeFor(key)
	n.Kill()
	n.Start()
	if err := rc.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	// Without AOF the restarted master lost its keys but kept its slots (nodes.conf).
	var err error
	for ctx.Err() == nil { // the client may need a moment to reconnect
		var v int64
		if v, err = c.Exists(ctx, key).Result(); err == nil {
			if v != 0 {
				t.Fatalf("key survived a kill without AOF")
			}
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("cluster client after node restart: %v", err)
	}
	if err := c.Set(ctx, key, "2", 0).Err(); err != nil {
		t.Fatalf("write after node restart: %v", err)
	}
}

// TestRedisClusterReplicaFailover: with replicas and AOF, a killed master's replica is promoted
// and, once the client has reloaded the slot map, serves the keys the master had.
func TestRedisClusterReplicaFailover(t *testing.T) {
	t.Parallel()
	start := time.Now()
	rc := StartRedisCluster(t, ClusterReplicas(1), ClusterServer(RedisAppendOnly(true)))
	t.Logf("3+3 cluster ready in %v", time.Since(start))
	if len(rc.Replicas) != 3 || len(rc.Replicas[0]) != 1 {
		t.Fatalf("replicas: %v", rc.Replicas)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // bounds a hang
	defer cancel()
	c := rc.Client()
	key := "esc:{kept}:acct"
	if err := c.Set(ctx, key, "1", 0).Err(); err != nil {
		t.Fatal(err)
	}
	// The write reached the replica before the kill (WAIT: acknowledged by one replica).
	m := rc.NodeFor(key)
	if n, err := m.Client().Do(ctx, "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d %v", n, err)
	}
	r := rc.ReplicaFor(key)
	kill := time.Now()
	m.Kill()
	at, err := rc.WaitMaster(ctx, r)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("replica promoted %v after the kill", at.Sub(kill))
	for {
		c.ReloadState(ctx)
		v, err := c.Get(ctx, key).Result()
		if err == nil {
			if v != "1" {
				t.Fatalf("after failover: %q", v)
			}
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("key never served after the failover: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
