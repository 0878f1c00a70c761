package testutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServer is a private redis-server started by a test from the installed binary, on a free
// loopback port and in its own temporary directory, so that the test may flush, stop, kill and
// restart it. The machine's shared Redis (127.0.0.1:6379) is never touched.
//
// Stop, Kill, Start and Restart may be called from any goroutine, but Start (and Restart) fail
// the test with tb.Fatalf, so call those from the test goroutine.
type RedisServer struct {
	tb   testing.TB
	bin  string
	dir  string
	port int
	cfg  redisServerConfig

	daemon
	client  *redis.Client // under daemon.mu, like started
	started int           // how many times the process was started
}

type redisServerConfig struct {
	appendOnly bool
	args       []string
}

// RedisServerOption configures StartRedisServer.
type RedisServerOption func(*redisServerConfig)

// RedisAppendOnly turns the append-only file on or off (default off). With it off nothing
// survives a Stop, Kill or Restart, because no RDB snapshot is ever taken ("save" is empty);
// with it on, writes survive Stop (and Kill up to the last fsync: appendfsync everysec unless
// RedisArgs says otherwise).
func RedisAppendOnly(on bool) RedisServerOption {
	return func(c *redisServerConfig) { c.appendOnly = on }
}

// RedisArgs adds command-line arguments for redis-server, after the helper's own, e.g.
// RedisArgs("--maxmemory-policy", "allkeys-lru"). The port, bind address and dir are the
// helper's and must not be overridden.
func RedisArgs(args ...string) RedisServerOption {
	return func(c *redisServerConfig) { c.args = append(c.args, args...) }
}

// sharedRedisPort is the machine's shared Redis, which a private server must never be.
const sharedRedisPort = 6379

// redisStartTimeout bounds how long a start waits for the server to answer PING.
const redisStartTimeout = 60 * time.Second

// StartRedisServer starts a private redis-server and returns once it answers PING. The binary
// is "redis-server" on PATH; without it the test fails (or is skipped when
// ESCROW_REQUIRE_SERVICES is not 1). The server is killed and its directory removed when the
// test ends.
func StartRedisServer(tb testing.TB, opts ...RedisServerOption) *RedisServer {
	tb.Helper()
	s := newRedisServer(tb, opts...)
	if err := s.startFresh(0); err != nil {
		tb.Fatalf("start private redis-server: %v", err)
	}
	return s
}

// newRedisServer prepares a server (binary, directory, cleanup) without starting it.
func newRedisServer(tb testing.TB, opts ...RedisServerOption) *RedisServer {
	tb.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		unavailable(tb, "redis-server is not installed or not on PATH (apt-get install redis-server): %v", err)
	}
	s := &RedisServer{tb: tb, bin: bin, dir: tb.TempDir()}
	for _, o := range opts {
		o(&s.cfg)
	}
	tb.Cleanup(s.cleanup)
	return s
}

// startFresh picks a free port (and port+busOffset free too, when > 0) and starts the server.
// The port is found free and then handed to redis-server; another process may take it in
// between, so a start that loses that race tries another port. Safe to call concurrently on
// different servers.
func (s *RedisServer) startFresh(busOffset int) error {
	return onFreePort(busOffset, func(port int) error {
		s.mu.Lock()
		s.port = port
		s.mu.Unlock()
		return s.start()
	})
}

// Addr is the server's host:port on 127.0.0.1.
func (s *RedisServer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port is the server's TCP port.
func (s *RedisServer) Port() int { return s.port }

// URL is redis://127.0.0.1:port/0.
func (s *RedisServer) URL() string { return "redis://" + s.Addr() + "/0" }

// Dir is the server's working directory (AOF, logs in redis.log).
func (s *RedisServer) Dir() string { return s.dir }

// Client is a go-redis client to the server, created on first use and closed when the test
// ends. It reconnects by itself after a restart.
func (s *RedisServer) Client() *redis.Client {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client == nil {
		s.client = redis.NewClient(&redis.Options{Addr: s.Addr()})
	}
	return s.client
}

// Start starts the server again after Stop or Kill, on the same port and in the same
// directory. It does nothing when the server is running.
func (s *RedisServer) Start() {
	s.tb.Helper()
	if err := s.start(); err != nil {
		s.tb.Fatalf("restart private redis-server on %s: %v", s.Addr(), err)
	}
}

// Stop shuts the server down cleanly (SIGTERM: the AOF, when on, is flushed; no RDB is
// written) and waits for it to exit. It does nothing when the server is not running.
func (s *RedisServer) Stop() { s.signal(syscall.SIGTERM, 10*time.Second) }

// Kill ends the server with SIGKILL, like a crash, and waits for it to exit. It does nothing
// when the server is not running.
func (s *RedisServer) Kill() { s.signal(syscall.SIGKILL, 0) }

// Pause stops the server's process (SIGSTOP) without ending it, like a hung or partitioned
// node: its connections stay open and every call on them waits, until Resume (SIGCONT). It
// does nothing when the server is not running.
func (s *RedisServer) Pause() { s.sendSignal(syscall.SIGSTOP) }

// Resume continues a paused server (SIGCONT).
func (s *RedisServer) Resume() { s.sendSignal(syscall.SIGCONT) }

func (s *RedisServer) sendSignal(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runningLocked() {
		_ = syscall.Kill(-s.cmd.Process.Pid, sig)
	}
}

// Restart is Stop followed by Start.
func (s *RedisServer) Restart() {
	s.tb.Helper()
	s.Stop()
	s.Start()
}

// Flush deletes every key on this private server (FLUSHALL), failing the test on error.
func (s *RedisServer) Flush() {
	s.tb.Helper()
	if s.port == sharedRedisPort {
		s.tb.Fatalf("refusing to flush the shared Redis on port %d", sharedRedisPort)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Client().FlushAll(ctx).Err(); err != nil {
		s.tb.Fatalf("FLUSHALL on private redis %s: %v", s.Addr(), err)
	}
}

func (s *RedisServer) args() []string {
	aof := "no"
	if s.cfg.appendOnly {
		aof = "yes"
	}
	a := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--dir", s.dir,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", aof,
		"--logfile", filepath.Join(s.dir, "redis.log"),
		"--maxmemory-policy", "noeviction",
	}
	return append(a, s.cfg.args...)
}

// start launches the process (unless running) and waits until it answers PING.
func (s *RedisServer) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runningLocked() {
		return nil
	}
	if s.port == sharedRedisPort || s.port <= 0 {
		return fmt.Errorf("refusing to run a private redis-server on port %d", s.port)
	}
	cmd := exec.Command(s.bin, s.args()...)
	cmd.Dir = s.dir
	cmd.SysProcAttr = childProcAttr()
	ready := func(exited <-chan struct{}) error {
		s.started++
		return waitRedisReady(s.Addr(), exited, redisStartTimeout)
	}
	kill := func(cmd *exec.Cmd, exited <-chan struct{}) { stopProcess(cmd, exited, syscall.SIGKILL, 0) }
	return s.launchLocked(cmd, filepath.Join(s.dir, "redis.log"), ready, kill)
}

// waitRedisReady polls PING until it answers PONG (not LOADING), the process exits or timeout.
func waitRedisReady(addr string, exited <-chan struct{}, timeout time.Duration) error {
	c := redis.NewClient(&redis.Options{
		Addr: addr, DialTimeout: 200 * time.Millisecond, ReadTimeout: time.Second,
		MaxRetries: -1, PoolSize: 1, Protocol: 2, DisableIdentity: true,
	})
	defer c.Close()
	return pollReady("redis-server", "answer PING", exited, timeout, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return c.Ping(ctx).Err()
	})
}

// signal sends sig to the running server and waits for it to exit; after grace (0: no grace),
// it is killed.
func (s *RedisServer) signal(sig syscall.Signal, grace time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.runningLocked() {
		return
	}
	stopProcess(s.cmd, s.exited, sig, grace)
}

func (s *RedisServer) cleanup() {
	s.Kill()
	s.mu.Lock()
	c := s.client
	s.client = nil
	s.mu.Unlock()
	if c != nil {
		_ = c.Close()
	}
}

// stopProcess sends sig to cmd's process group, waits up to grace for exited, then kills the
// group and waits for good.
func stopProcess(cmd *exec.Cmd, exited <-chan struct{}, sig syscall.Signal, grace time.Duration) {
	if sig != syscall.SIGKILL {
		_ = cmd.Process.Signal(sig)
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-exited:
			killGroup(cmd) // leftover children, if any
			return
		case <-t.C:
		}
	}
	killGroup(cmd)
	<-exited
}

// childProcAttr puts a child server in its own process group (so that Kill reaches all its
// processes) and asks Linux to kill it if the test process dies first.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// killGroup sends SIGKILL to cmd's whole process group.
func killGroup(cmd *exec.Cmd) {
	if cmd.Process == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	_ = cmd.Process.Kill()
}

// freeLoopbackPort returns a TCP port that was free on 127.0.0.1 a moment ago, other than
// 6379 and 5432 (the shared servers). With busOffset > 0 the port+busOffset must be free too
// and ≤ 65535 (Redis Cluster's bus port).
func freeLoopbackPort(busOffset int) (int, error) {
	if busOffset > 0 {
		return nextClusterPort(busOffset)
	}
	for i := 0; i < 50; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("find a free port: %w", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if port == sharedRedisPort || port == 5432 || port+busOffset > 65535 {
			_ = ln.Close()
			continue
		}
		if busOffset > 0 {
			bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+busOffset)))
			if err != nil {
				_ = ln.Close()
				continue
			}
			_ = bus.Close()
		}
		_ = ln.Close()
		return port, nil
	}
	return 0, errors.New("find a free port: no luck after 50 tries")
}

// Cluster nodes take their ports from [clusterPortLo, clusterPortHi), their bus ports busOffset
// above, all below Linux's ephemeral range (32768 and up), one after another and never twice in
// a process: the peers of a node a test killed keep gossiping to its ports, and a new node of
// another test on a reused port would be pulled into that cluster (seen as "config epoch already
// non-zero" or "the node must be empty" at CLUSTER REPLICATE). Each process starts at its own
// place in the range, so parallel test binaries walk apart.
const clusterPortLo, clusterPortHi = 12000, 22000

var clusterPorts struct {
	sync.Mutex
	next int
}

func nextClusterPort(busOffset int) (int, error) {
	clusterPorts.Lock()
	defer clusterPorts.Unlock()
	if clusterPorts.next == 0 {
		clusterPorts.next = clusterPortLo + (os.Getpid()*211)%(clusterPortHi-clusterPortLo)
	}
	free := func(port int) bool {
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			return false
		}
		_ = ln.Close()
		return true
	}
	for range clusterPortHi - clusterPortLo {
		port := clusterPorts.next
		if clusterPorts.next++; clusterPorts.next >= clusterPortHi {
			clusterPorts.next = clusterPortLo
		}
		if port+busOffset <= 65535 && free(port) && free(port+busOffset) {
			return port, nil
		}
	}
	return 0, errors.New("find a free cluster port: none left in the range")
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// tailFrom returns at most max bytes of the file written after offset from.
func tailFrom(path string, from int64, max int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	if from < int64(len(b)) {
		b = b[from:]
	} else {
		b = nil
	}
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return strings.TrimSpace(string(b))
}
