package balance

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/lua"
)

// Script names.
const (
	scReserve  = "reserve"
	scSettle   = "settle"
	scRelease  = "release"
	scFinish   = "finish"
	scReap     = "reap"
	scExpired  = "expired"
	scExtend   = "extend"
	scUnpin    = "unpin"
	scSeed     = "seed"
	scState    = "state"
	scRaiseMax = "raise_model_max"
	scPushLim  = "push_limits"
	scModelUse = "model_use"
)

type script struct {
	src, sha string
}

func newScripts() map[string]*script {
	m := map[string]*script{}
	for name, src := range lua.Scripts { // named as the sc constants above
		h := sha1.Sum([]byte(src))
		m[name] = &script{src: src, sha: hex.EncodeToString(h[:])}
	}
	return m
}

// run calls a script with EVALSHA. On NOSCRIPT (a restarted or failed-over server) the scripts
// are loaded again on the node that owns the keys — one round per node, however many calls
// meet NOSCRIPT at once (reloadScripts) — and the call is retried; if the script is still
// missing there, it falls back to EVAL, which loads it. Every error is noted (noteErr): a
// connection error reloads a Cluster's slot map.
func (s *Store) run(ctx context.Context, name string, keys []string, args ...any) *redis.Cmd {
	sc := s.scripts[name]
	sent := time.Now()
	cmd := s.c.EvalSha(ctx, sc.sha, keys, args...)
	if err := cmd.Err(); !isNoScript(err) {
		s.noteErr(err)
		return cmd
	}
	if err := s.reloadScripts(ctx, keys[0], sent); err != nil {
		s.log.Warn("balance: reloading scripts", "err", err)
	}
	cmd = s.c.EvalSha(ctx, sc.sha, keys, args...)
	if isNoScript(cmd.Err()) {
		cmd = s.c.Eval(ctx, sc.src, keys, args...)
	}
	s.noteErr(cmd.Err())
	return cmd
}

// runAdmin calls a script that writes the admin plane's keys, through the admin client:
// EVALSHA, then EVAL on NOSCRIPT (the admin plane's writes are rare).
func (s *Store) runAdmin(ctx context.Context, name string, keys []string, args ...any) *redis.Cmd {
	if s.adm == s.c {
		return s.run(ctx, name, keys, args...)
	}
	sc := s.scripts[name]
	cmd := s.adm.EvalSha(ctx, sc.sha, keys, args...)
	if isNoScript(cmd.Err()) {
		cmd = s.adm.Eval(ctx, sc.src, keys, args...)
	}
	return cmd
}

// pipelined calls one script once per (keys[i], args[i]) in one pipeline: one round trip (one
// per master on a Cluster). Calls that meet NOSCRIPT ran nothing: the scripts are loaded again
// on their nodes (reloadScripts) and those calls alone are sent again (EVAL where the script is
// still missing). The pipeline outlives no caller: ctx bounds it.
func (s *Store) pipelined(ctx context.Context, name string, keys [][]string, args [][]any) []*redis.Cmd {
	sc := s.scripts[name]
	cmds := make([]*redis.Cmd, len(keys))
	sent := time.Now()
	pipe := s.c.Pipeline()
	for i := range keys {
		cmds[i] = pipe.EvalSha(ctx, sc.sha, keys[i], args[i]...)
	}
	_, _ = pipe.Exec(ctx)
	var again []int
	for i, cmd := range cmds {
		if err := cmd.Err(); isNoScript(err) {
			again = append(again, i)
		} else if err != nil {
			s.noteErr(err)
		}
	}
	if len(again) == 0 {
		return cmds
	}
	// One wait per node (calls on one node share its round).
	var wg sync.WaitGroup
	seen := map[string]bool{}
	for _, i := range again {
		addr, _, err := s.nodeOf(ctx, keys[i][0])
		if err != nil || seen[addr] {
			continue
		}
		seen[addr] = true
		wg.Go(func() {
			if err := s.reloadScripts(ctx, keys[i][0], sent); err != nil {
				s.log.Warn("balance: reloading scripts", "err", err)
			}
		})
	}
	wg.Wait()
	pipe = s.c.Pipeline()
	for _, i := range again {
		cmds[i] = pipe.EvalSha(ctx, sc.sha, keys[i], args[i]...)
	}
	_, _ = pipe.Exec(ctx)
	for _, i := range again {
		if isNoScript(cmds[i].Err()) {
			// Still missing where the keys live: EVAL loads it there.
			cmds[i] = s.c.Eval(ctx, sc.src, keys[i], args[i]...)
		}
		s.noteErr(cmds[i].Err())
	}
	return cmds
}

func isNoScript(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// eachMaster runs fn on every master of a Cluster, or on the one server otherwise.
func (s *Store) eachMaster(ctx context.Context, fn func(context.Context, redis.Cmdable) error) error {
	var err error
	if cc, ok := s.c.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return fn(ctx, c) })
	} else {
		err = fn(ctx, s.c)
	}
	s.noteErr(err)
	return err
}

// loadScripts loads every script on every master (SCRIPT LOAD, one pipeline per master).
func (s *Store) loadScripts(ctx context.Context) error {
	return s.eachMaster(ctx, func(ctx context.Context, c redis.Cmdable) error { return s.loadScriptsOn(ctx, c) })
}

// warn adds a start-up warning once (checkServer runs on every master at once in a Cluster).
func (s *Store) warn(msg string) {
	s.warnMu.Lock()
	defer s.warnMu.Unlock()
	if !slices.Contains(s.warnings, msg) {
		s.warnings = append(s.warnings, msg)
	}
}

// checkServer checks one server: version ≥ 6.0, maxmemory-policy noeviction, AOF, and on a
// Cluster cluster-require-full-coverage (a warning when yes).
func (s *Store) checkServer(ctx context.Context, c redis.Cmdable) error {
	info, err := c.Info(ctx, "server").Result()
	if err != nil {
		// miniredis answers only some INFO sections; a real server always has "server".
		info, err = c.Info(ctx).Result()
		if err != nil {
			return fmt.Errorf("balance: INFO: %w", err)
		}
	}
	if v, ok := infoField(info, "redis_version"); ok {
		major, minor := parseVersion(v)
		if major < 6 {
			return fmt.Errorf("%w: redis %s; escrow needs 6.0 or later", ErrUnsupportedRedis, v)
		}
		_ = minor
	} else {
		s.warn("balance: the server does not report its version (an embedded Redis?)")
	}

	policy, err := configGet(ctx, c, "maxmemory-policy")
	switch {
	case isUnknownCommand(err):
		// miniredis has no CONFIG: it never evicts.
	case err != nil:
		return fmt.Errorf("balance: CONFIG GET maxmemory-policy: %w", err)
	case policy != "noeviction" && policy != "":
		if !s.cfg.AllowEviction {
			return fmt.Errorf("%w: maxmemory-policy is %q; escrow needs noeviction (eviction can drop a hold and lock money, or drop a watermark); set Config.AllowEviction to override", ErrUnsupportedRedis, policy)
		}
		s.warn(fmt.Sprintf("balance: DANGER: maxmemory-policy is %q and AllowEviction is set: eviction can drop a hold and lock money, or drop a watermark", policy))
		s.log.Error("balance: Redis may evict escrow keys", "maxmemory-policy", policy)
	}

	aof, err := configGet(ctx, c, "appendonly")
	switch {
	case isUnknownCommand(err):
	case err != nil:
		return fmt.Errorf("balance: CONFIG GET appendonly: %w", err)
	case aof != "yes":
		s.warn("balance: AOF persistence is off: a Redis restart loses holds and tombstones (the ledger reseeds balances)")
	}

	if s.topo.cc != nil {
		full, err := configGet(ctx, c, "cluster-require-full-coverage")
		switch {
		case isUnknownCommand(err):
		case err != nil:
			return fmt.Errorf("balance: CONFIG GET cluster-require-full-coverage: %w", err)
		case full == "yes":
			s.warn("balance: cluster-require-full-coverage is yes: while a failed master's replica is not yet promoted, every master refuses every org (CLUSTERDOWN), not only the failed master's; set it to no")
		}
	}
	return nil
}

func configGet(ctx context.Context, c redis.Cmdable, key string) (string, error) {
	m, err := c.ConfigGet(ctx, key).Result()
	if err != nil {
		return "", err
	}
	return m[key], nil
}

func isUnknownCommand(err error) bool {
	if err == nil {
		return false
	}
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "unknown command") || strings.Contains(msg, "not supported")
}

func infoField(info, field string) (string, bool) {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v, true
		}
	}
	return "", false
}

func parseVersion(v string) (major, minor int) {
	parts := strings.SplitN(v, ".", 3)
	major, _ = strconv.Atoi(parts[0])
	if len(parts) > 1 {
		minor, _ = strconv.Atoi(parts[1])
	}
	return major, minor
}

// scanPage is the COUNT of one SCAN page.
const scanPage = 100

// ScanOrgs calls fn for every org that has a holds-expiry key (unfinished or finished holds),
// with a slow, rate-limited SCAN (never KEYS), on every master of a Cluster. It is the reaper's
// backstop for holds left by dead processes. fn may see an org more than once; an error from fn
// stops the scan.
func (s *Store) ScanOrgs(ctx context.Context, fn func(org string) error) error {
	if err := s.scanKind(ctx, func(k OrgKeys) string { return k.Hexp }, fn); err != nil {
		return err
	}
	return s.scanKind(ctx, func(k OrgKeys) string { return k.Hfin }, fn)
}

// ScanWarmOrgs calls fn for every org that has a hot balance (an acct key), with the same slow
// SCAN as ScanOrgs. It is the reconciler's round: every warm org, busy or at rest. On a store
// that may write the admin plane it first takes the orgs whose limits data-plane stores found
// missing (DESIGN.md "Two planes"), cold as they are: the reconciler pushes their limits.
func (s *Store) ScanWarmOrgs(ctx context.Context, fn func(org string) error) error {
	if err := s.takeWantedLimits(ctx, fn); err != nil {
		return err
	}
	return s.scanKind(ctx, func(k OrgKeys) string { return k.Acct }, fn)
}

// scanKind calls fn for the org of every key of one kind (a field of OrgKeys).
func (s *Store) scanKind(ctx context.Context, kind func(OrgKeys) string, fn func(org string) error) error {
	pattern, orgOf := s.kindPattern(kind)
	return s.eachMaster(ctx, func(ctx context.Context, c redis.Cmdable) error {
		var cursor uint64
		for {
			keys, next, err := c.Scan(ctx, cursor, pattern, scanPage).Result()
			if err != nil {
				return fmt.Errorf("balance: scan: %w", err)
			}
			for _, k := range keys {
				org, ok := orgOf(k)
				if !ok {
					continue
				}
				if err := fn(org); err != nil {
					return err
				}
			}
			if next == 0 {
				return nil
			}
			cursor = next
			t := time.NewTimer(s.cfg.ScanPause)
			select {
			case <-ctx.Done():
				t.Stop()
				return ctx.Err()
			case <-t.C:
			}
		}
	})
}
