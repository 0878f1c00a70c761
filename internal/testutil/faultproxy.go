package testutil

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FaultProxy is a TCP proxy on 127.0.0.1 in front of one target address, with faults that a
// test switches on and off while traffic flows: slow replies, replies lost after the server
// acted on the request, cut connections, and a server that refuses or ignores new connections.
//
// It works on chunks, not on a protocol: a "request" is one chunk read from the client, a
// "reply" is one chunk read from the server. That is exact for request/response protocols whose
// messages are small (Redis commands, short Postgres queries) and good enough for the rest.
//
// The zero value is not usable; use StartFaultProxy. All methods are safe for concurrent use.
type FaultProxy struct {
	target string
	ln     net.Listener

	mu        sync.Mutex
	conns     map[*proxyConn]struct{}
	delay     time.Duration
	dropLeft  int
	dropMatch func(request []byte) bool
	refuse    bool
	hung      chan struct{} // non-nil while Hang is on; closed by Unblock
	closed    bool

	wg sync.WaitGroup

	accepted, refused, dropped, cuts atomic.Int64
	droppedBytes                     atomic.Int64
	toServer, toClient               atomic.Int64
}

// FaultStats counts what a FaultProxy has done since it started.
type FaultStats struct {
	Accepted       int64 // client connections accepted and served (or parked by Hang)
	Refused        int64 // client connections reset at once because of Block
	Active         int   // client connections open now
	DroppedReplies int64 // replies swallowed by DropReplies
	DroppedBytes   int64 // server bytes swallowed by DropReplies
	Cuts           int64 // connections closed by Cut
	BytesToServer  int64 // bytes forwarded client → server (counted just before each write)
	BytesToClient  int64 // bytes forwarded server → client (counted just before each write)
}

// proxyConn is one client connection and its server side.
type proxyConn struct {
	client net.Conn
	server net.Conn     // set once dialled; guarded by FaultProxy.mu
	armed  atomic.Int32 // replies to drop: one per armed client write
	// swallow is set when a reply is dropped and cleared by the next client write that arms
	// nothing, so that a reply longer than one chunk is dropped whole.
	swallow atomic.Bool
	done    chan struct{}
	once    sync.Once
}

func (pc *proxyConn) close() {
	pc.once.Do(func() {
		close(pc.done)
		_ = pc.client.Close()
	})
}

// faultDialTimeout bounds the proxy's own connection attempt to the target.
const faultDialTimeout = 5 * time.Second

// StartFaultProxy listens on 127.0.0.1:0 and forwards every connection to target, which must be a
// loopback address. The proxy is closed when the test ends.
func StartFaultProxy(tb testing.TB, target string) *FaultProxy {
	tb.Helper()
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		tb.Fatalf("fault proxy target %q: %v", target, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		tb.Fatalf("fault proxy target %q is not a loopback address", target)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("fault proxy listen: %v", err)
	}
	p := &FaultProxy{target: target, ln: ln, conns: make(map[*proxyConn]struct{})}
	p.wg.Add(1)
	go p.acceptLoop()
	tb.Cleanup(p.Close)
	return p
}

// Addr is the proxy's listening address, host:port; point the client here instead of at the
// target.
func (p *FaultProxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *FaultProxy) Target() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.target
}

// SetTarget makes the connections accepted from now on go to target (a loopback address), like
// a service address or DNS name moved to another server after a failover; connections already
// open stay with the old target (Cut them to move every client).
func (p *FaultProxy) SetTarget(target string) {
	p.mu.Lock()
	p.target = target
	p.mu.Unlock()
}

// SetDelay holds every reply chunk d before passing it to the client (0 turns it off). It acts
// on chunks read after the call.
func (p *FaultProxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// DropNextReply is DropReplies(1).
func (p *FaultProxy) DropNextReply() { p.DropReplies(1) }

// DropReplies makes the next n client writes (on any connection, handshakes included) reach the
// server as usual while what the server sends back on that connection after each of them —
// the next chunk, and any further chunks until the client writes again — is swallowed: the
// server has acted, and the client waits for a reply that never comes (it times out, and a
// client like go-redis retries on a new connection). Calls add up.
func (p *FaultProxy) DropReplies(n int) { p.DropRepliesIf(n, nil) }

// DropRepliesIf is DropReplies counting only client writes for which match returns true (match
// nil matches every write), e.g. RequestContains("evalsha") to lose only script replies and not
// the connection handshake. match sees the raw chunk and must not keep it. A
// later call replaces the earlier count and matcher.
func (p *FaultProxy) DropRepliesIf(n int, match func(request []byte) bool) {
	p.mu.Lock()
	if match == nil {
		p.dropLeft += n
	} else {
		p.dropLeft = n
	}
	p.dropMatch = match
	p.mu.Unlock()
}

// RequestContains returns a matcher for DropRepliesIf: true when the request chunk contains s,
// ignoring ASCII case (go-redis sends command names in lower case).
func RequestContains(s string) func(request []byte) bool {
	needle := bytes.ToLower([]byte(s))
	return func(req []byte) bool { return bytes.Contains(bytes.ToLower(req), needle) }
}

// PendingDrops is how many of the requested dropped replies have not been armed yet.
func (p *FaultProxy) PendingDrops() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropLeft
}

// Cut closes every connection open now, on both sides, like a network failure or a server
// crash. New connections are served normally (combine with Block for a server that stays down).
func (p *FaultProxy) Cut() {
	p.mu.Lock()
	conns := make([]*proxyConn, 0, len(p.conns))
	for pc := range p.conns {
		conns = append(conns, pc)
	}
	p.mu.Unlock()
	for _, pc := range conns {
		p.cuts.Add(1)
		pc.close()
	}
}

// Block makes the proxy reset each new connection as soon as it is accepted, like a server that
// is down (clients see a connection reset or EOF at once). Connections already open are left
// alone; call Cut as well to drop them. Unblock ends it.
func (p *FaultProxy) Block() {
	p.mu.Lock()
	p.refuse = true
	p.mu.Unlock()
}

// Hang makes the proxy a black hole, like a server that stopped answering: new connections are
// accepted but not served, and no byte moves on the open ones, in either direction, until
// Unblock (then everything held goes through). Clients see timeouts, not errors.
func (p *FaultProxy) Hang() {
	p.mu.Lock()
	if p.hung == nil {
		p.hung = make(chan struct{})
	}
	p.mu.Unlock()
}

// Unblock ends Block and Hang.
func (p *FaultProxy) Unblock() {
	p.mu.Lock()
	p.refuse = false
	if p.hung != nil {
		close(p.hung)
		p.hung = nil
	}
	p.mu.Unlock()
}

// Reset turns every fault off: no delay, no pending drops, not blocked or hung.
func (p *FaultProxy) Reset() {
	p.mu.Lock()
	p.delay = 0
	p.dropLeft = 0
	p.dropMatch = nil
	p.mu.Unlock()
	p.Unblock()
}

// Stats returns the proxy's counters.
func (p *FaultProxy) Stats() FaultStats {
	p.mu.Lock()
	active := len(p.conns)
	p.mu.Unlock()
	return FaultStats{
		Accepted:       p.accepted.Load(),
		Refused:        p.refused.Load(),
		Active:         active,
		DroppedReplies: p.dropped.Load(),
		DroppedBytes:   p.droppedBytes.Load(),
		Cuts:           p.cuts.Load(),
		BytesToServer:  p.toServer.Load(),
		BytesToClient:  p.toClient.Load(),
	}
}

// Close stops listening, closes every connection and waits for the proxy's goroutines. It is
// called automatically when the test ends; calling it again does nothing.
func (p *FaultProxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	p.Unblock()
	p.Cut()
	p.wg.Wait()
}

func (p *FaultProxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(5 * time.Millisecond) // e.g. too many open files: back off, go on
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = c.Close()
			return
		}
		if p.refuse {
			p.mu.Unlock()
			p.refused.Add(1)
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // RST rather than FIN: as close to "refused" as an open port gets
			}
			_ = c.Close()
			continue
		}
		pc := &proxyConn{client: c, done: make(chan struct{})}
		p.conns[pc] = struct{}{}
		p.mu.Unlock()
		p.accepted.Add(1)
		p.wg.Add(1)
		go p.serve(pc)
	}
}

// gate blocks while Hang is on; it reports false when pc was closed meanwhile.
func (p *FaultProxy) gate(pc *proxyConn) bool {
	for {
		p.mu.Lock()
		h := p.hung
		p.mu.Unlock()
		if h == nil {
			return true
		}
		select {
		case <-h:
		case <-pc.done:
			return false
		}
	}
}

func (p *FaultProxy) serve(pc *proxyConn) {
	defer p.wg.Done()
	defer func() {
		pc.close()
		p.mu.Lock()
		delete(p.conns, pc)
		server := pc.server
		p.mu.Unlock()
		if server != nil {
			_ = server.Close()
		}
	}()
	if !p.gate(pc) {
		return
	}
	p.mu.Lock()
	target := p.target
	p.mu.Unlock()
	server, err := net.DialTimeout("tcp", target, faultDialTimeout)
	if err != nil {
		return
	}
	p.mu.Lock()
	pc.server = server
	p.mu.Unlock()
	go func() { // a Cut must also close the server side, which the pumps may be blocked on
		<-pc.done
		_ = server.Close()
	}()

	var pumps sync.WaitGroup
	pumps.Add(2)
	go func() { defer pumps.Done(); defer pc.close(); p.pumpUp(pc, server) }()
	go func() { defer pumps.Done(); defer pc.close(); p.pumpDown(pc, server) }()
	pumps.Wait()
}

// pumpUp copies client → server, arming reply drops before each request reaches the server.
func (p *FaultProxy) pumpUp(pc *proxyConn, server net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := pc.client.Read(buf)
		if n > 0 {
			if !p.gate(pc) {
				return
			}
			p.mu.Lock()
			if p.dropLeft > 0 && (p.dropMatch == nil || p.dropMatch(buf[:n])) {
				p.dropLeft--
				pc.armed.Add(1)
			} else {
				pc.swallow.Store(false)
			}
			p.mu.Unlock()
			p.toServer.Add(int64(n)) // counted before the write, so a peer that saw it sees it counted
			if _, werr := server.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// pumpDown copies server → client, swallowing armed replies and delaying the rest.
func (p *FaultProxy) pumpDown(pc *proxyConn, server net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if !p.gate(pc) {
				return
			}
			if pc.armed.Load() > 0 || pc.swallow.Load() {
				if pc.armed.Load() > 0 {
					pc.armed.Add(-1)
					p.dropped.Add(1)
					pc.swallow.Store(true)
				}
				p.droppedBytes.Add(int64(n))
				if err != nil {
					return
				}
				continue
			}
			p.mu.Lock()
			d := p.delay
			p.mu.Unlock()
			if d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-pc.done:
					t.Stop()
					return
				}
			}
			p.toClient.Add(int64(n))
			if _, werr := pc.client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
