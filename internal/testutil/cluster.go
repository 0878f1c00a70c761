package testutil

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a private three-master Redis Cluster on loopback ports (no replicas unless
// ClusterReplicas says so), built from redis-server processes with their own directories. Each
// node is a RedisServer, so a test may stop, kill or restart one; its nodes.conf survives, so a
// restarted node rejoins.
type RedisCluster struct {
	// Nodes are the masters the cluster was created with, in slot order: Nodes[0] serves slots
	// 0-5460, Nodes[1] 5461-10922, Nodes[2] 10923-16383 (until a failover promotes a replica).
	Nodes []*RedisServer
	// Replicas[i] are the replicas of Nodes[i] (empty without ClusterReplicas).
	Replicas [][]*RedisServer

	tb     testing.TB
	mu     sync.Mutex
	client *redis.ClusterClient
}

// ClusterOption configures StartRedisCluster.
type ClusterOption func(*clusterConfig)

type clusterConfig struct {
	replicas int
	server   []RedisServerOption
}

// ClusterReplicas gives every master n replicas (default 0), so that a failed master fails over
// to one of them (after cluster-node-timeout, 2 s unless ClusterServer says otherwise).
func ClusterReplicas(n int) ClusterOption {
	return func(c *clusterConfig) { c.replicas = n }
}

// ClusterServer applies opts to every node's redis-server after the cluster's own arguments
// (a later argument wins), e.g. RedisAppendOnly(true) or
// RedisArgs("--cluster-require-full-coverage", "no").
func ClusterServer(opts ...RedisServerOption) ClusterOption {
	return func(c *clusterConfig) { c.server = append(c.server, opts...) }
}

// clusterSlotRanges is how the 16384 slots are split among the three masters.
var clusterSlotRanges = [3][2]int{{0, 5460}, {5461, 10922}, {10923, 16383}}

// clusterBusOffset is the distance between a node's port and its cluster bus port.
const clusterBusOffset = 10000

// clusterReadyTimeout bounds the wait for cluster_state:ok on every node: only a hang, as the
// wait ends when the state is ok (a loaded machine takes what it takes).
const clusterReadyTimeout = 60 * time.Second

// StartRedisCluster starts three cluster-enabled redis-server processes (and their replicas,
// with ClusterReplicas), assigns the slots and introduces the nodes to each other by hand
// (CLUSTER ADDSLOTSRANGE, SET-CONFIG-EPOCH, MEET, REPLICATE: faster than redis-cli --cluster
// create), and returns once every node reports cluster_state:ok and agrees on the slot map and
// every replica is in sync with its master. Without redis-server the test fails (or is skipped
// when ESCROW_REQUIRE_SERVICES is not 1). Everything is killed when the test ends.
func StartRedisCluster(tb testing.TB, opts ...ClusterOption) *RedisCluster {
	tb.Helper()
	var cfg clusterConfig
	for _, o := range opts {
		o(&cfg)
	}
	c := &RedisCluster{tb: tb}
	node := func() *RedisServer {
		return newRedisServer(tb, append([]RedisServerOption{RedisArgs(
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000",
			"--cluster-require-full-coverage", "yes",
			// A replica's first sync starts at once (the default waits 5 s for more replicas).
			"--repl-diskless-sync-delay", "0",
		)}, cfg.server...)...)
	}
	for range clusterSlotRanges {
		c.Nodes = append(c.Nodes, node())
		var rs []*RedisServer
		for range cfg.replicas {
			rs = append(rs, node())
		}
		c.Replicas = append(c.Replicas, rs)
	}
	tb.Cleanup(c.closeClient)

	all := c.all()
	errs := make([]error, len(all))
	var wg sync.WaitGroup
	for i, n := range all {
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

// all is every node: the masters, then the replicas.
func (c *RedisCluster) all() []*RedisServer {
	all := append([]*RedisServer(nil), c.Nodes...)
	for _, rs := range c.Replicas {
		all = append(all, rs...)
	}
	return all
}

// create assigns slots, sets distinct config epochs, makes node 0 meet the others and each
// replica replicate its master.
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
	for i, n := range c.all()[1:] {
		if err := c.Nodes[0].Client().ClusterMeet(ctx, "127.0.0.1", strconv.Itoa(n.Port())).Err(); err != nil {
			return fmt.Errorf("CLUSTER MEET node %d: %w", i+1, err)
		}
	}
	for i, rs := range c.Replicas {
		if len(rs) == 0 {
			continue
		}
		id, err := c.Nodes[i].Client().Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			return fmt.Errorf("node %d: CLUSTER MYID: %w", i, err)
		}
		for _, r := range rs {
			// The replica must have heard of its master (gossip) before it may replicate it.
			for {
				err := r.Client().Do(ctx, "CLUSTER", "REPLICATE", id).Err()
				if err == nil {
					break
				}
				select {
				case <-ctx.Done():
					return fmt.Errorf("replica %s: CLUSTER REPLICATE %s: %w (last: %v)", r.Addr(), id, ctx.Err(), err)
				case <-time.After(20 * time.Millisecond):
				}
			}
		}
	}
	return nil
}

// WaitReady waits until every node answers, reports cluster_state:ok, knows every node and sees
// all 16384 slots assigned, each range served by a master and its replicas, every replica in
// sync — e.g. after restarting a node.
func (c *RedisCluster) WaitReady(ctx context.Context) error {
	var last string
	all := c.all()
	known := fmt.Sprintf("cluster_known_nodes:%d\r", len(all))
	replicas := len(all) - len(c.Nodes)
	for {
		ok := true
		for i, n := range all {
			info, err := n.Client().ClusterInfo(ctx).Result()
			if err != nil {
				ok, last = false, fmt.Sprintf("node %d: %v", i, err)
				break
			}
			if !strings.Contains(info, "cluster_state:ok") ||
				!strings.Contains(info, known) ||
				!strings.Contains(info, "cluster_slots_assigned:16384\r") {
				ok, last = false, fmt.Sprintf("node %d: %s", i, strings.ReplaceAll(info, "\r\n", " "))
				break
			}
			// Each node must route every range to the right owner before clients rely on it,
			// and know which nodes are replicas (the masters vote in a failover only for a
			// replica they know to be the failed master's).
			slots, err := n.Client().ClusterSlots(ctx).Result()
			if err != nil || len(slots) != len(c.Nodes) {
				ok, last = false, fmt.Sprintf("node %d: CLUSTER SLOTS %v %v", i, slots, err)
				break
			}
			if replicas > 0 {
				nodes, err := n.Client().ClusterNodes(ctx).Result()
				if err != nil || countReplicas(nodes) != replicas {
					ok, last = false, fmt.Sprintf("node %d: CLUSTER NODES %q %v", i, nodes, err)
					break
				}
			}
		}
		for _, rs := range c.Replicas {
			for _, r := range rs {
				if !ok {
					break
				}
				info, err := r.Client().Info(ctx, "replication").Result()
				if err != nil || !strings.Contains(info, "master_link_status:up") || strings.Contains(info, "master_sync_in_progress:1") {
					ok, last = false, fmt.Sprintf("replica %s: not in sync: %v", r.Addr(), err)
				}
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

// countReplicas counts the nodes whose flags (CLUSTER NODES, third field) say replica.
func countReplicas(nodes string) int {
	n := 0
	for _, line := range strings.Split(nodes, "\n") {
		if f := strings.Fields(line); len(f) > 2 && slices.Contains(strings.Split(f[2], ","), "slave") {
			n++
		}
	}
	return n
}

// WaitMaster waits until n reports the master role (ROLE), e.g. a replica after its master was
// killed, and returns when it saw it; the promotion happened at most one poll (10 ms) earlier.
func (c *RedisCluster) WaitMaster(ctx context.Context, n *RedisServer) (time.Time, error) {
	var last error
	for {
		role, err := n.Client().Do(ctx, "ROLE").Slice()
		if err == nil && len(role) > 0 && role[0] == "master" {
			return time.Now(), nil
		}
		last = err
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("%s never became a master: %w (last: %v %v)", n.Addr(), ctx.Err(), role, last)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Addrs are the masters' host:port addresses (those of Nodes).
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

// NodeFor returns the master (of Nodes) that serves key's slot; ReplicaFor, its first replica.
func (c *RedisCluster) NodeFor(key string) *RedisServer {
	slot := clusterKeySlot(key)
	for i, r := range clusterSlotRanges {
		if slot >= r[0] && slot <= r[1] {
			return c.Nodes[i]
		}
	}
	return nil
}

// ReplicaFor returns the first replica of the master that serves key's slot (nil without
// replicas).
func (c *RedisCluster) ReplicaFor(key string) *RedisServer {
	n := c.NodeFor(key)
	for i, m := range c.Nodes {
		if m == n && len(c.Replicas[i]) > 0 {
			return c.Replicas[i][0]
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
