package testutil

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// echoServer answers every chunk it reads with the same bytes and counts what it received.
type echoServer struct {
	ln       net.Listener
	received atomic.Int64
}

func startEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &echoServer{ln: ln}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						e.received.Add(int64(n))
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return e
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, hangLimit)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// roundTrip writes msg and reads len(msg) bytes back within timeout.
func roundTrip(c net.Conn, msg string, timeout time.Duration) (string, error) {
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// hangLimit bounds a wait for something that must happen (a reply, an error, a condition): it
// only ends a test that would hang, so it is far above what a loaded machine takes. The reads
// that must time out keep deadlines of their own, shorter than any delay they are up against.
const hangLimit = time.Minute

// waitFor polls cond every 5 ms until it holds, for up to hangLimit.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestFaultProxyForwards(t *testing.T) {
	t.Parallel()
	e, p := echoProxy(t)
	c := dial(t, p.Addr())
	for _, msg := range []string{"hello", "world"} {
		got, err := roundTrip(c, msg, hangLimit)
		if err != nil || got != msg {
			t.Fatalf("round trip %q: got %q, %v", msg, got, err)
		}
	}
	s := p.Stats()
	if s.Accepted != 1 || s.Active != 1 || s.BytesToServer != 10 || s.BytesToClient != 10 {
		t.Fatalf("stats = %+v", s)
	}
	if e.received.Load() != 10 {
		t.Fatalf("server received %d bytes, want 10", e.received.Load())
	}
}

func TestFaultProxyRejectsNonLoopback(t *testing.T) {
	t.Parallel()
	r := runRecorded(t, func(tb testing.TB) { StartFaultProxy(tb, "10.1.2.3:6379") })
	if !r.failed {
		t.Fatal("StartFaultProxy accepted a non-loopback target")
	}
}

func TestFaultProxyDelay(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	c := dial(t, p.Addr())
	p.SetDelay(150 * time.Millisecond)
	start := time.Now()
	if got, err := roundTrip(c, "slow", hangLimit); err != nil || got != "slow" {
		t.Fatalf("got %q, %v", got, err)
	}
	if el := time.Since(start); el < 150*time.Millisecond {
		t.Fatalf("reply came after %v, before the 150ms delay", el)
	}
	// A read deadline shorter than the delay times out.
	if _, err := roundTrip(c, "late", 50*time.Millisecond); !isTimeout(err) {
		t.Fatalf("want a timeout under delay, got %v", err)
	}
	p.SetDelay(0)
	// The delayed "late" reply still arrives, in order, then the next one.
	_ = c.SetReadDeadline(time.Now().Add(hangLimit))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "late" {
		t.Fatalf("delayed reply: %q, %v", buf, err)
	}
	if got, err := roundTrip(c, "fast", hangLimit); err != nil || got != "fast" {
		t.Fatalf("got %q, %v", got, err)
	}
}

func TestFaultProxyDropReply(t *testing.T) {
	t.Parallel()
	e, p := echoProxy(t)
	c := dial(t, p.Addr())
	p.DropNextReply()
	if _, err := roundTrip(c, "lost", 200*time.Millisecond); !isTimeout(err) {
		t.Fatalf("want a timeout for the dropped reply, got %v", err)
	}
	if got := e.received.Load(); got != 4 {
		t.Fatalf("server received %d bytes, want the 4 of the request whose reply was dropped", got)
	}
	mustEcho(t, c, "next", "the reply after the dropped one")
	if s := p.Stats(); s.DroppedReplies != 1 || p.PendingDrops() != 0 {
		t.Fatalf("stats = %+v, pending %d", s, p.PendingDrops())
	}
}

// chunkyServer answers each read with a reply in three chunks written 20 ms apart.
func chunkyServer(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 64)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
					for _, part := range []string{"aa", "bb", "cc"} {
						time.Sleep(20 * time.Millisecond)
						if _, err := c.Write([]byte(part)); err != nil {
							return
						}
					}
				}
			}()
		}
	}()
	return ln
}

func TestFaultProxyDropsAMultiChunkReplyWhole(t *testing.T) {
	t.Parallel()
	ln := chunkyServer(t)
	p := StartFaultProxy(t, ln.Addr().String())
	c := dial(t, p.Addr())
	p.DropNextReply()
	if _, err := c.Write([]byte("q1")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 16)); !isTimeout(err) {
		t.Fatalf("read %d bytes of a dropped reply (err %v)", n, err)
	}
	// The next request gets its whole reply, with no leftover of the dropped one.
	if _, err := c.Write([]byte("q2")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(hangLimit))
	buf := make([]byte, 6)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "aabbcc" {
		t.Fatalf("reply after a dropped one: %q, %v", buf, err)
	}
	if s := p.Stats(); s.DroppedReplies != 1 || s.DroppedBytes != 6 {
		t.Fatalf("stats = %+v", s)
	}
}

func TestFaultProxyDropRepliesCountsWritesAcrossConnections(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	c1, c2 := dial(t, p.Addr()), dial(t, p.Addr())
	p.DropReplies(2)
	for i, c := range []net.Conn{c1, c2} {
		if _, err := roundTrip(c, "x", 150*time.Millisecond); !isTimeout(err) {
			t.Fatalf("conn %d: want a timeout, got %v", i, err)
		}
	}
	c3 := dial(t, p.Addr())
	mustEcho(t, c3, "ok", "third write")
	if s := p.Stats(); s.DroppedReplies != 2 {
		t.Fatalf("dropped %d, want 2", s.DroppedReplies)
	}
}

func TestFaultProxyDropRepliesIf(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	c := dial(t, p.Addr())
	p.DropRepliesIf(1, func(req []byte) bool { return bytes.Contains(req, []byte("EVAL")) })
	mustEcho(t, c, "PING", "unmatched write")
	wantTimeout(t, c, "EVAL", "matched write")
	mustEcho(t, c, "EVAL", "second matched write")
}

func TestFaultProxyCut(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	c := dial(t, p.Addr())
	if _, err := roundTrip(c, "a", hangLimit); err != nil {
		t.Fatal(err)
	}
	p.Cut()
	_ = c.SetReadDeadline(time.Now().Add(hangLimit))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("read on a cut connection: want EOF/reset, got %v", err)
	}
	waitFor(t, "no active connections", func() bool { return p.Stats().Active == 0 })
	c2 := dial(t, p.Addr())
	mustEcho(t, c2, "b", "after cut")
	if s := p.Stats(); s.Cuts != 1 || s.Accepted != 2 {
		t.Fatalf("stats = %+v", s)
	}
}

func TestFaultProxyBlock(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	open := dial(t, p.Addr())
	if _, err := roundTrip(open, "0", hangLimit); err != nil { // accepted before Block
		t.Fatal(err)
	}
	p.Block()
	// The reset may already fail the dial, or the first read.
	if c, err := net.DialTimeout("tcp", p.Addr(), hangLimit); err == nil {
		defer c.Close()
		if _, err := roundTrip(c, "x", hangLimit); err == nil || isTimeout(err) {
			t.Fatalf("blocked: want a reset/EOF, got %v", err)
		}
	}
	mustEcho(t, open, "still", "a connection opened before Block")
	p.Unblock()
	c2 := dial(t, p.Addr())
	mustEcho(t, c2, "y", "after Unblock")
	if s := p.Stats(); s.Refused != 1 {
		t.Fatalf("refused = %d, want 1", s.Refused)
	}
}

func TestFaultProxyHang(t *testing.T) {
	t.Parallel()
	e, p := echoProxy(t)
	old := dial(t, p.Addr())
	if _, err := roundTrip(old, "0", hangLimit); err != nil {
		t.Fatal(err)
	}
	p.Hang()
	c := dial(t, p.Addr())
	wantTimeout(t, c, "new", "new connection while hung")
	wantTimeout(t, old, "old", "open connection while hung")
	if got := e.received.Load(); got != 1 {
		t.Fatalf("server received %d bytes while hung, want only the 1 before", got)
	}
	p.Unblock()
	for _, tc := range []struct {
		c    net.Conn
		want string
	}{{c, "new"}, {old, "old"}} {
		_ = tc.c.SetReadDeadline(time.Now().Add(hangLimit))
		buf := make([]byte, len(tc.want))
		if _, err := io.ReadFull(tc.c, buf); err != nil || string(buf) != tc.want {
			t.Fatalf("held data after Unblock: %q, %v", buf, err)
		}
	}
}

func TestFaultProxyCloseEndsEverything(t *testing.T) {
	t.Parallel()
	_, p := echoProxy(t)
	c := dial(t, p.Addr())
	p.Hang()
	_, _ = c.Write([]byte("x"))
	done := make(chan struct{})
	go func() { p.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(hangLimit):
		t.Fatal("Close did not return while connections were hung")
	}
	// The listener is closed and the hung connection cut. (A dial to the old address is no
	// proof: a parallel test may have been given the same port since.)
	if _, err := p.ln.Accept(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("accept after Close: %v, want net.ErrClosed", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(hangLimit))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read on a connection of the closed proxy: %v, want it cut", err)
	}
	p.Close() // idempotent
}

// newProxiedRedis returns a go-redis client to miniredis through a fault proxy, with a short read
// timeout and a single pooled connection.
func newProxiedRedis(t *testing.T) (*miniredis.Miniredis, *FaultProxy, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	p := StartFaultProxy(t, m.Addr())
	c := redis.NewClient(&redis.Options{
		Addr:            p.Addr(),
		ReadTimeout:     200 * time.Millisecond,
		WriteTimeout:    200 * time.Millisecond,
		DialTimeout:     500 * time.Millisecond,
		MaxRetries:      3,
		MinRetryBackoff: time.Millisecond,
		MaxRetryBackoff: 5 * time.Millisecond,
		PoolSize:        1,
	})
	t.Cleanup(func() { _ = c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("ping through proxy: %v", err)
	}
	return m, p, c
}

func TestFaultProxyGoRedisRetriesDroppedReply(t *testing.T) {
	t.Parallel()
	m, p, c := newProxiedRedis(t)
	ctx := context.Background()
	p.DropRepliesIf(1, RequestContains("INCR"))
	n, err := c.Incr(ctx, "counter").Result()
	if err != nil {
		t.Fatalf("INCR through a dropped reply: %v (go-redis should have retried)", err)
	}
	// The first INCR committed unseen; go-redis re-sent it on a new connection.
	if n != 2 {
		t.Fatalf("INCR returned %d, want 2 (the dropped call committed, the retry ran again)", n)
	}
	if v, _ := m.Get("counter"); v != "2" {
		t.Fatalf("server value %q, want 2", v)
	}
	if s := p.Stats(); s.DroppedReplies != 1 || s.Accepted < 2 {
		t.Fatalf("stats = %+v; want 1 dropped reply and a second connection for the retry", s)
	}
}

func TestFaultProxyGoRedisWithoutRetriesSeesTimeout(t *testing.T) {
	t.Parallel()
	m, p, _ := newProxiedRedis(t)
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 150 * time.Millisecond, MaxRetries: -1, PoolSize: 1})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p.DropRepliesIf(1, RequestContains("set"))
	err := c.Set(ctx, "k", "v", 0).Err()
	if !isTimeout(err) {
		t.Fatalf("SET with its reply dropped: want a timeout, got %v", err)
	}
	if v, _ := m.Get("k"); v != "v" {
		t.Fatalf("the server did not commit the SET whose reply was dropped: %q", v)
	}
}

func TestFaultProxyGoRedisBlockedAndCut(t *testing.T) {
	t.Parallel()
	_, p, c := newProxiedRedis(t)
	ctx := context.Background()
	p.Block()
	p.Cut()
	if err := c.Ping(ctx).Err(); err == nil {
		t.Fatal("PING succeeded while the server was blocked")
	}
	p.Unblock()
	// After failed dials go-redis's pool may answer with its last dial error until its own
	// background probe succeeds (about a second), so poll.
	var err error
	for deadline := time.Now().Add(hangLimit); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if err = c.Ping(ctx).Err(); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("PING after Unblock: %v", err)
	}
}

func TestFaultProxyGoRedisHangTimesOut(t *testing.T) {
	t.Parallel()
	_, p, c := newProxiedRedis(t)
	ctx := context.Background()
	p.Hang()
	err := c.Ping(ctx).Err()
	if err == nil || (!isTimeout(err) && !errors.Is(err, os.ErrDeadlineExceeded)) {
		t.Fatalf("PING while hung: want a timeout, got %v", err)
	}
	p.Reset()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after Reset: %v", err)
	}
}

// echoProxy starts an echo server and a fault proxy in front of it.
func echoProxy(t *testing.T) (*echoServer, *FaultProxy) {
	e := startEcho(t)
	return e, StartFaultProxy(t, e.ln.Addr().String())
}

// mustEcho sends msg on c and fails the test (saying what) unless msg comes back within 2s.
func mustEcho(t *testing.T, c net.Conn, msg, what string) {
	t.Helper()
	if got, err := roundTrip(c, msg, hangLimit); err != nil || got != msg {
		t.Fatalf("%s: %q, %v", what, got, err)
	}
}

// wantTimeout sends msg on c and fails the test (saying what) unless no answer comes within
// 150ms.
func wantTimeout(t *testing.T, c net.Conn, msg, what string) {
	t.Helper()
	if _, err := roundTrip(c, msg, 150*time.Millisecond); !isTimeout(err) {
		t.Fatalf("%s: want a timeout, got %v", what, err)
	}
}

// TestFaultProxySetTarget: connections accepted after SetTarget go to the new target; the ones
// already open stay with the old one.
func TestFaultProxySetTarget(t *testing.T) {
	t.Parallel()
	a, b := startEcho(t), startEcho(t)
	p := StartFaultProxy(t, a.ln.Addr().String())
	old := dial(t, p.Addr())
	if got, err := roundTrip(old, "one", 10*time.Second); err != nil || got != "one" {
		t.Fatalf("before SetTarget: %q %v", got, err)
	}
	p.SetTarget(b.ln.Addr().String())
	if p.Target() != b.ln.Addr().String() {
		t.Fatalf("Target() = %s after SetTarget(%s)", p.Target(), b.ln.Addr())
	}
	if got, err := roundTrip(dial(t, p.Addr()), "two", 10*time.Second); err != nil || got != "two" {
		t.Fatalf("new connection: %q %v", got, err)
	}
	if got, err := roundTrip(old, "old", 10*time.Second); err != nil || got != "old" {
		t.Fatalf("old connection: %q %v", got, err)
	}
	if a.received.Load() != int64(len("one")+len("old")) || b.received.Load() != int64(len("two")) {
		t.Fatalf("old target got %d bytes, new %d; want 6 and 3", a.received.Load(), b.received.Load())
	}
}
