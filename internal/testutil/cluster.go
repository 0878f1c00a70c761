package testutil

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a private three-master Redis Cluster (no replicas) on loopback ports, built
// from redis-server processes with their own directories. Each node is a RedisServer, so a test
// may stop, kill or restart one; its nodes.conf survives, so a restarted node rejoins.
type RedisCluster struct {
	// Nodes are the masters, in slot order: Nodes[0] serves slots 0-5460, Nodes[1] 5461-10922,
	// Nodes[2] 10923-16383.
	Nodes []*RedisServer

	tb     testing.TB
	mu     sync.Mutex
	client *redis.ClusterClient
}

// clusterSlotRanges is how the 16384 slots are split among the three masters.
var clusterSlotRanges = [3][2]int{{0, 5460}, {5461, 10922}, {10923, 16383}}

// clusterBusOffset is the distance between a node's port and its cluster bus port.
const clusterBusOffset = 10000

// clusterReadyTimeout bounds the wait for cluster_state:ok on every node.
const clusterReadyTimeout = 20 * time.Second

// StartRedisCluster starts three cluster-enabled redis-server processes, assigns the slots and
// introduces the nodes to each other by hand (CLUSTER ADDSLOTSRANGE, SET-CONFIG-EPOCH, MEET:
// faster than redis-cli --cluster create), and returns once every node reports
// cluster_state:ok and agrees on the slot map. Without redis-server the test fails (or is
// skipped when ESCROW_REQUIRE_SERVICES is not 1). Everything is killed when the test ends.
func StartRedisCluster(tb testing.TB) *RedisCluster {
	tb.Helper()
	c := &RedisCluster{tb: tb}
	for range clusterSlotRanges {
		c.Nodes = append(c.Nodes, newRedisServer(tb, RedisArgs(
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000",
			"--cluster-require-full-coverage", "yes",
		)))
	}
	tb.Cleanup(c.closeClient)

	errs := make([]error, len(c.Nodes))
	var wg sync.WaitGroup
	for i, n := range c.Nodes {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = n.startFresh(clusterBusOffset) }()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			tb.Fatalf("start cluster node %d: %v", i, err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterReadyTimeout)
	defer cancel()
	if err := c.create(ctx); err != nil {
		tb.Fatalf("create redis cluster: %v", err)
	}
	if err := c.WaitReady(ctx); err != nil {
		tb.Fatalf("redis cluster: %v", err)
	}
	return c
}

// create assigns slots, sets distinct config epochs and makes node 0 meet the others.
func (c *RedisCluster) create(ctx context.Context) error {
	for i, n := range c.Nodes {
		nc := n.Client()
		r := clusterSlotRanges[i]
		if err := nc.ClusterAddSlotsRange(ctx, r[0], r[1]).Err(); err != nil {
			return fmt.Errorf("node %d: CLUSTER ADDSLOTSRANGE %d %d: %w", i, r[0], r[1], err)
		}
		if err := nc.Do(ctx, "CLUSTER", "SET-CONFIG-EPOCH", i+1).Err(); err != nil {
			return fmt.Errorf("node %d: CLUSTER SET-CONFIG-EPOCH: %w", i, err)
		}
	}
	for i, n := range c.Nodes[1:] {
		if err := c.Nodes[0].Client().ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(n.Port())).Err(); err != nil {
			return fmt.Errorf("CLUSTER MEET node %d: %w", i+1, err)
		}
	}
	return nil
}

// WaitReady waits until every node answers, reports cluster_state:ok, knows all three nodes and
// sees all 16384 slots assigned — e.g. after restarting a node.
func (c *RedisCluster) WaitReady(ctx context.Context) error {
	var last string
	for {
		ok := true
		for i, n := range c.Nodes {
			info, err := n.Client().ClusterInfo(ctx).Result()
			if err != nil {
				ok, last = false, fmt.Sprintf("node %d: %v", i, err)
				break
			}
			if !strings.Contains(info, "cluster_state:ok") ||
				!strings.Contains(info, "cluster_known_nodes:3\r") ||
				!strings.Contains(info, "cluster_slots_assigned:16384\r") {
				ok, last = false, fmt.Sprintf("node %d: %s", i, strings.ReplaceAll(info, "\r\n", " "))
				break
			}
			// Each node must route every range to the right owner before clients rely on it.
			slots, err := n.Client().ClusterSlots(ctx).Result()
			if err != nil || len(slots) != len(c.Nodes) {
				ok, last = false, fmt.Sprintf("node %d: CLUSTER SLOTS %v %v", i, slots, err)
				break
			}
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster not ready: %w (last: %s)", ctx.Err(), last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Addrs are the nodes' host:port addresses.
func (c *RedisCluster) Addrs() []string {
	a := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		a[i] = n.Addr()
	}
	return a
}

// Client is a go-redis cluster client to the cluster, created on first use and closed when the
// test ends.
func (c *RedisCluster) Client() *redis.ClusterClient {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.client == nil {
		c.client = redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	}
	return c.client
}

// NodeFor returns the master that serves key's slot.
func (c *RedisCluster) NodeFor(key string) *RedisServer {
	slot := clusterKeySlot(key)
	for i, r := range clusterSlotRanges {
		if slot >= r[0] && slot <= r[1] {
			return c.Nodes[i]
		}
	}
	return nil
}

func (c *RedisCluster) closeClient() {
	c.mu.Lock()
	cl := c.client
	c.client = nil
	c.mu.Unlock()
	if cl != nil {
		_ = cl.Close()
	}
}

// clusterKeySlot is Redis Cluster's HASH_SLOT: CRC16 (XMODEM) of the key, or of the first
// non-empty {hash tag} in it, modulo 16384.
func clusterKeySlot(key string) int {
	if s := strings.IndexByte(key, '{'); s >= 0 {
		if e := strings.IndexByte(key[s+1:], '}'); e > 0 {
			key = key[s+1 : s+1+e]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for b := 0; b < 8; b++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}
