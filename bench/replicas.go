package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
)

// waitCost is what waiting for a replica (balance.Config.WaitReplicas, ESCROW_REDIS_WAIT_REPLICAS)
// costs: a reserve and its settle, on a private master with one replica (both redis-server
// processes on this machine, started and killed by the bench), without and with WAIT 1 after
// each reserve, taking turns in the same rounds. docs/failover.md quotes it.
type waitCost struct {
	conns                          int
	plain, waited, coPlain, coWait float64       // reserve+settle pairs/s
	p50Plain, p50Waited            time.Duration // one caller, NoCoalesce
	p50CoPlain, p50CoWait          time.Duration // one caller, coalescing on
}

// redisProc is a private redis-server the bench started.
type redisProc struct {
	cmd  *exec.Cmd
	addr string
	port int
}

// startRedisProc starts redis-server in dir on a free loopback port (no persistence) with the
// extra arguments, and waits until it answers PING.
func startRedisProc(ctx context.Context, bin, dir string, extra ...string) (*redisProc, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	args := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir, "--daemonize", "no",
		"--save", "", "--appendonly", "no", "--logfile", filepath.Join(dir, "redis.log"),
		"--maxmemory-policy", "noeviction", "--repl-diskless-sync-delay", "0"}, extra...)
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &redisProc{cmd: cmd, addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), port: port}
	c := redis.NewClient(&redis.Options{Addr: p.addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(15 * time.Second)
	for c.Ping(ctx).Err() != nil {
		if time.Now().After(deadline) || ctx.Err() != nil {
			p.kill()
			return nil, fmt.Errorf("redis-server on %s did not answer PING", p.addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return p, nil
}

func (p *redisProc) kill() {
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// benchOrg is one org of a reserve+settle loop, used by one caller at a time (its pool), so
// that its settles come in sequence order.
type benchOrg struct {
	name string
	seq  int64
}

// measureWait measures waitCost: Store.Reserve followed by Store.Settle of its hold (a charge of
// 1), NoCoalesce and coalesced, each with WaitReplicas 0 and 1, from o.redisConns callers and
// from one.
func measureWait(ctx context.Context, o options) (*waitCost, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server for the master and its replica: %w", err)
	}
	dir, err := os.MkdirTemp("", "escrow-bench-wait-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	m, err := startRedisProc(ctx, bin, filepath.Join(dir, "m"))
	if err != nil {
		return nil, err
	}
	defer m.kill()
	r, err := startRedisProc(ctx, bin, filepath.Join(dir, "r"), "--replicaof", "127.0.0.1", strconv.Itoa(m.port))
	if err != nil {
		return nil, err
	}
	defer r.kill()
	c := redis.NewClient(&redis.Options{Addr: m.addr, PoolSize: 2*o.redisConns + 8})
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		info, err := c.Info(ctx, "replication").Result()
		if err == nil && strings.Contains(info, "state=online") {
			break
		}
		if time.Now().After(deadline) {
			return nil, errors.New("the replica never came online")
		}
		time.Sleep(10 * time.Millisecond)
	}

	w := &waitCost{conns: o.redisConns}
	mode := func(name string, coalesce bool, replicas int, out *float64, p50 *time.Duration) (limitMode, error) {
		cfg := balance.Config{Ledger: fixedLedger{}, Prefix: "bw", MaxInFlight: 1 << 30, Logger: slog.New(slog.DiscardHandler),
			NoCoalesce: !coalesce, WaitReplicas: replicas, WaitTimeout: 5 * time.Second}
		s, err := balance.New(ctx, c, &cfg)
		if err != nil {
			return limitMode{}, err
		}
		s.ObserveEpoch(benchEpoch)
		pool := make(chan *benchOrg, o.redisConns)
		for i := range o.redisConns {
			org := &benchOrg{name: fmt.Sprintf("w-%s-%d", strings.ReplaceAll(name, " ", ""), i), seq: fixedLedger{}.snapshot().Seq}
			if _, err := s.Seed(ctx, org.name, fixedLedger{}.snapshot()); err != nil {
				return limitMode{}, err
			}
			pool <- org
		}
		var ids atomic.Int64
		op := func() error {
			org := <-pool
			defer func() { pool <- org }()
			id := "w" + strconv.FormatInt(ids.Add(1), 10)
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: org.name, HoldID: id, Amount: 1}); err != nil {
				return err
			}
			org.seq++
			st, err := s.Settle(ctx, org.name, benchEpoch, []balance.Entry{{Seq: org.seq, Delta: -1, HoldID: id}})
			if err != nil {
				return err
			}
			if len(st) != 1 || st[0] != balance.Applied {
				return fmt.Errorf("settle of %s: %v", id, st)
			}
			return nil
		}
		return limitMode{name: name, perOp: 1, op: op, out: out, p50: p50}, nil
	}
	var modes []limitMode
	for _, d := range []struct {
		name     string
		coalesce bool
		replicas int
		out      *float64
		p50      *time.Duration
	}{
		{"no WAIT", false, 0, &w.plain, &w.p50Plain},
		{"WAIT 1", false, 1, &w.waited, &w.p50Waited},
		{"coalesced no WAIT", true, 0, &w.coPlain, &w.p50CoPlain},
		{"coalesced WAIT 1", true, 1, &w.coWait, &w.p50CoWait},
	} {
		md, err := mode(d.name, d.coalesce, d.replicas, d.out, d.p50)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.name, err)
		}
		modes = append(modes, md)
	}
	if err := throughputRounds(modes, o.redisConns, o.limitRound); err != nil {
		return nil, err
	}
	if err := loneLatencies(modes, o.limitRound); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "\r%-70s\r", "")
	return w, nil
}

// printWait prints waitCost's rows.
func printWait(w *waitCost) {
	fmt.Printf("\nWAIT for a replica (ESCROW_REDIS_WAIT_REPLICAS=1) on a private master + replica, Store.Reserve + Store.Settle, %d callers:\n", w.conns)
	row := func(name string, tput float64, p50 time.Duration, base float64) {
		ratio := ""
		if base > 0 {
			ratio = fmt.Sprintf("%.2f of no WAIT", tput/base)
		}
		fmt.Printf("  %-34s %9.0f pairs/s   p50 (one caller) %8s   %s\n", name, tput, p50.Round(time.Microsecond), ratio)
	}
	row("reserve+settle, NoCoalesce", w.plain, w.p50Plain, 0)
	row("reserve+settle, NoCoalesce, WAIT 1", w.waited, w.p50Waited, w.plain)
	row("reserve+settle, coalesced", w.coPlain, w.p50CoPlain, 0)
	row("reserve+settle, coalesced, WAIT 1", w.coWait, w.p50CoWait, w.coPlain)
}
