package balance

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// clusterReloadInterval is the least time between two slot-map reloads that connection errors
// ask for (see Store.noteErr).
const clusterReloadInterval = 200 * time.Millisecond

// scriptLoadTimeout bounds one node's SCRIPT LOAD round after a NOSCRIPT.
const scriptLoadTimeout = 5 * time.Second

// topology is what the Store keeps about the servers behind its client: on a Cluster, when it
// last asked for the slot map again, and for every node the scripts' last load.
type topology struct {
	cc         *redis.ClusterClient // nil: one server
	lastReload atomic.Int64         // unix ns of the last reload asked for

	mu    sync.Mutex
	loads map[string]*scriptLoad // node address ("" for one server) → its last script load
}

// scriptLoad is one round of SCRIPT LOADs on one node: in progress until done is closed.
type scriptLoad struct {
	done   chan struct{}
	err    error
	doneAt time.Time // when it ended (set before done is closed)
}

func newTopology(c redis.UniversalClient) *topology {
	t := &topology{loads: map[string]*scriptLoad{}}
	t.cc, _ = c.(*redis.ClusterClient)
	return t
}

// noteErr is told about every error of a Redis call. go-redis refreshes a Cluster's slot map
// only on MOVED/ASK replies and every minute: a master that died answers neither, so after a
// failover its slots would still be sent to the dead address until then. A connection error
// (anything but a reply of Redis, the caller's cancellation and redis.Nil) or a CLUSTERDOWN
// reply asks for the slot map again, in the background, at most once per
// clusterReloadInterval: the replica's promotion is seen within that of the first failure after
// it.
func (s *Store) noteErr(err error) {
	t := s.topo
	if t.cc == nil || !needsReload(err) {
		return
	}
	now := time.Now().UnixNano()
	last := t.lastReload.Load()
	if now-last < int64(clusterReloadInterval) || !t.lastReload.CompareAndSwap(last, now) {
		return
	}
	t.cc.ReloadState(context.Background()) // asynchronous
}

// needsReload reports whether err may mean that the slot map is stale.
func needsReload(err error) bool {
	if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) {
		return false
	}
	var re redis.Error
	if errors.As(err, &re) {
		return redis.HasErrorPrefix(err, "CLUSTERDOWN") || redis.HasErrorPrefix(err, "MASTERDOWN")
	}
	return true // a refused or broken connection, a timeout
}

// nodeOf returns the address of the master that serves key as the client's slot map has it
// ("" for one server), and a client of that node.
func (s *Store) nodeOf(ctx context.Context, key string) (string, redis.Cmdable, error) {
	if s.topo.cc == nil {
		return "", s.c, nil
	}
	n, err := s.topo.cc.MasterForKey(ctx, key)
	if err != nil {
		return "", nil, err
	}
	return n.Options().Addr, n, nil
}

// reloadScripts makes sure the scripts are loaded on the node that answered NOSCRIPT to a call
// sent at sent, and returns once they are (or the load failed): one round of SCRIPT LOADs (one
// pipeline) per node, however many calls meet NOSCRIPT at once. A caller joins the round in
// progress on its node; a round that ended after its call was sent already covers it (the call
// ran before it); only a call sent after the last round ended and still answered NOSCRIPT (the
// node lost its scripts again: restart, failover, SCRIPT FLUSH) starts a new round.
func (s *Store) reloadScripts(ctx context.Context, key string, sent time.Time) error {
	addr, node, err := s.nodeOf(ctx, key)
	if err != nil {
		return err
	}
	t := s.topo
	t.mu.Lock()
	l := t.loads[addr]
	switch {
	case l == nil:
	case !l.ended():
		t.mu.Unlock()
		return l.wait(ctx)
	case l.err == nil && l.doneAt.After(sent):
		t.mu.Unlock()
		return nil
	}
	l = &scriptLoad{done: make(chan struct{})}
	t.loads[addr] = l
	t.mu.Unlock()
	s.log.Warn("balance: scripts missing on a server (restart or failover?); loading them again", "node", addr)
	go func() {
		// The round outlives the caller that started it: others wait for it too.
		lctx, cancel := context.WithTimeout(context.Background(), scriptLoadTimeout)
		defer cancel()
		err := s.loadScriptsOn(lctx, node)
		if err != nil {
			s.noteErr(err)
			err = fmt.Errorf("balance: loading scripts on %s: %w", addr, err)
		}
		t.mu.Lock()
		l.err, l.doneAt = err, time.Now()
		t.mu.Unlock()
		close(l.done)
	}()
	return l.wait(ctx)
}

func (l *scriptLoad) ended() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

func (l *scriptLoad) wait(ctx context.Context) error {
	select {
	case <-l.done:
		return l.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// loadScriptsOn loads every script on one server, in one pipeline.
func (s *Store) loadScriptsOn(ctx context.Context, c redis.Cmdable) error {
	names := make([]string, 0, len(s.scripts))
	cmds := make([]*redis.StringCmd, 0, len(s.scripts))
	pipe := c.Pipeline()
	for name, sc := range s.scripts {
		names = append(names, name)
		cmds = append(cmds, pipe.ScriptLoad(ctx, sc.src))
	}
	_, _ = pipe.Exec(ctx)
	for i, cmd := range cmds {
		sha, err := cmd.Result()
		if err != nil {
			return fmt.Errorf("balance: loading script %s: %w", names[i], err)
		}
		if sc := s.scripts[names[i]]; sha != sc.sha {
			return fmt.Errorf("balance: script %s: server sha %s, expected %s", names[i], sha, sc.sha)
		}
	}
	return nil
}
