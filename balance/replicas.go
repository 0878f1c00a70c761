package balance

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Waiting for replicas (Config.WaitReplicas). Replication is asynchronous: a master that dies
// takes with it the writes its replicas had not received, and a replica promoted in its place
// lacks the holds those writes made — money a client was told is held is then free to spend
// again (docs/failover.md bounds what that costs). With WaitReplicas, every reserve script is
// followed, on the same connection and in the same pipeline, by WAIT: Redis answers it once
// that many replicas have acknowledged every write the connection made so far (the scripts
// before it included), or at the timeout with how many did. A hold granted is then on the
// replicas too.

// errNotReplicated: a reserve's hold was written but fewer replicas than Config.WaitReplicas
// acknowledged it within Config.WaitTimeout, so a failover could lose it. Reserve's error wraps
// it with ErrRedis: the hold is not granted, and the caller releases it like that of any
// reserve whose outcome is unknown. (Unexported: callers need only ErrRedis.)
var errNotReplicated = errors.New("balance: hold not acknowledged by the replicas")

// reserveOne runs one reserve script: alone (EVALSHA), or followed by WAIT with WaitReplicas.
func (s *Store) reserveOne(ctx context.Context, keys []string, args []any) ([]any, error) {
	if s.cfg.WaitReplicas > 0 {
		return s.reserveWaited(ctx, [][]string{keys}, [][]any{args})[0].Slice()
	}
	return s.run(ctx, scReserve, keys, args...).Slice()
}

// reserveMany runs the reserve script once per (keys[i], args[i]) in one pipeline (one per
// master on a Cluster), each pipeline ending with WAIT when WaitReplicas > 0.
func (s *Store) reserveMany(ctx context.Context, keys [][]string, args [][]any) []*redis.Cmd {
	if s.cfg.WaitReplicas > 0 {
		return s.reserveWaited(ctx, keys, args)
	}
	return s.pipelined(ctx, scReserve, keys, args)
}

// reserveWaited sends the reserves to the master of their keys, one pipeline per master ending
// with WAIT. A reserve that granted a hold (OK) whose WAIT saw fewer than WaitReplicas
// acknowledgements gets an error wrapping errNotReplicated instead of its reply; so does a
// DUP (a re-sent reserve finding the hold its first try wrote): that write may have been made on
// another connection, which this connection's WAIT does not cover. Every other reply (a refusal
// writes no hold) is passed on as it is.
//
// On a Cluster the pipelines go to the node clients (a WAIT cannot ride in a Cluster pipeline),
// so a MOVED reply is not followed: the reserve fails (503, retryable) and the slot map is
// reloaded for the next one.
func (s *Store) reserveWaited(ctx context.Context, keys [][]string, args [][]any) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(keys))
	type group struct {
		node redis.Cmdable
		idx  []int
	}
	groups := map[string]*group{}
	var order []string
	for i := range keys {
		addr, node, err := s.nodeOf(ctx, keys[i][0])
		if err != nil {
			s.noteErr(err)
			cmds[i] = redis.NewCmd(ctx)
			cmds[i].SetErr(err)
			continue
		}
		g := groups[addr]
		if g == nil {
			g = &group{node: node}
			groups[addr] = g
			order = append(order, addr)
		}
		g.idx = append(g.idx, i)
	}
	if len(order) == 1 {
		g := groups[order[0]]
		s.waitedOn(ctx, g.node, keys, args, g.idx, cmds)
		return cmds
	}
	var wg sync.WaitGroup
	for _, addr := range order {
		g := groups[addr]
		wg.Go(func() { s.waitedOn(ctx, g.node, keys, args, g.idx, cmds) })
	}
	wg.Wait()
	return cmds
}

// waitedOn runs the reserves idx on node, each pipeline ending with WAIT, and sets cmds[i] for
// each. Reserves that met NOSCRIPT ran nothing: the scripts are loaded again and those reserves
// sent again in a pipeline of their own, with a WAIT of its own.
func (s *Store) waitedOn(ctx context.Context, node redis.Cmdable, keys [][]string, args [][]any, idx []int, cmds []*redis.Cmd) {
	sc := s.scripts[scReserve]
	send := func(idx []int, eval bool) *redis.Cmd {
		pipe := node.Pipeline()
		for _, i := range idx {
			if eval {
				cmds[i] = pipe.Eval(ctx, sc.src, keys[i], args[i]...)
			} else {
				cmds[i] = pipe.EvalSha(ctx, sc.sha, keys[i], args[i]...)
			}
		}
		w := pipe.Do(ctx, "wait", s.cfg.WaitReplicas, s.cfg.WaitTimeout.Milliseconds())
		_, _ = pipe.Exec(ctx)
		return w
	}
	sent := time.Now()
	w := send(idx, false)
	s.judge(idx, cmds, w)
	var again []int
	for _, i := range idx {
		if isNoScript(cmds[i].Err()) {
			again = append(again, i)
		} else {
			s.noteMoved(cmds[i].Err())
		}
	}
	if len(again) == 0 {
		return
	}
	if err := s.reloadScripts(ctx, keys[again[0]][0], sent); err != nil {
		s.log.Warn("balance: reloading scripts", "err", err)
	}
	w = send(again, false)
	var still []int
	for _, i := range again {
		if isNoScript(cmds[i].Err()) {
			still = append(still, i)
		}
	}
	if len(still) > 0 {
		w2 := send(still, true) // still missing: EVAL loads it
		s.judge(still, cmds, w2)
		again = slices.DeleteFunc(again, func(i int) bool { return slices.Contains(still, i) })
	}
	s.judge(again, cmds, w)
	for _, i := range again {
		s.noteMoved(cmds[i].Err())
	}
}

// judge turns the replies idx that granted a hold into errNotReplicated when w, their
// pipeline's WAIT, saw fewer than WaitReplicas acknowledgements (or failed); see
// reserveWaited. Errors of Redis itself are noted (noteErr) as for any call.
func (s *Store) judge(idx []int, cmds []*redis.Cmd, w *redis.Cmd) {
	acked, werr := w.Int64()
	for _, i := range idx {
		cmd := cmds[i]
		res, err := cmd.Slice()
		if err != nil {
			if !isNoScript(err) {
				s.noteErr(err)
			}
			continue
		}
		status, _ := res[0].(string)
		switch {
		case status == "DUP":
			cmd.SetErr(fmt.Errorf("%w: a re-sent reserve found its hold, whose write this connection's WAIT does not cover", errNotReplicated))
		case status != "OK":
		case werr != nil:
			s.noteErr(werr)
			cmd.SetErr(fmt.Errorf("%w: WAIT failed: %w", errNotReplicated, werr))
		case acked < int64(s.cfg.WaitReplicas):
			cmd.SetErr(fmt.Errorf("%w: %d of %d replicas within %v", errNotReplicated, acked, s.cfg.WaitReplicas, s.cfg.WaitTimeout))
		}
	}
}

// noteMoved asks a Cluster client for its slot map again when a node client was answered
// MOVED or ASK (it does not follow them the way the Cluster client does).
func (s *Store) noteMoved(err error) {
	if s.topo.cc == nil || err == nil {
		return
	}
	if redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK") {
		s.topo.cc.ReloadState(context.Background())
	}
}
