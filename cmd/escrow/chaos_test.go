//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

// The chaos test's knobs. Prices: 1 micro-unit per input token, 2 per output token, so a
// client computes a request's cost from the usage it got back: prompt + 2 × completion.
const (
	chaosClients     = 200
	chaosLoad        = 32 * time.Second
	chaosHoldTTL     = 3 * time.Second
	chaosReapGrace   = 4 * time.Second
	chaosMaxInFlight = 1024
	chaosMaxCost     = 100
	chaosRichFunds   = 5_000_000
	chaosPoorFunds   = 3_000
	chaosCredit      = 2_000
)

// chaosResult is what one client saw of one request.
type chaosResult struct {
	org        string
	holdID     string // x-request-id; "" when no response header arrived
	status     int    // 0: no response
	kind       string // ok, refused (a complete non-200 answer), unknown (no or cut answer), unsent (connection refused)
	cost       int64  // for ok: prompt + 2 × completion, from the response's usage
	code       string // error code of a refusal
	start, end time.Time
}

// proxyProc is the proxy binary running as a child process.
type proxyProc struct {
	t        *testing.T
	bin, log string
	env      []string
	addr     string

	mu       sync.Mutex
	cmd      *exec.Cmd
	exited   chan struct{}
	restarts int
}

func (p *proxyProc) start() {
	p.t.Helper()
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		p.t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(p.bin, "serve")
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		p.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	p.mu.Lock()
	p.cmd, p.exited = cmd, exited
	p.mu.Unlock()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + p.addr + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		select {
		case <-exited:
			p.t.Fatalf("proxy exited at start; log:\n%s", tail(p.log, 4000))
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("proxy not healthy after 30s: %v; log:\n%s", err, tail(p.log, 4000))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill sends SIGKILL and waits for the process to be gone.
func (p *proxyProc) kill() {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-exited
}

// stop sends SIGTERM (graceful shutdown) and returns the exit error.
func (p *proxyProc) stop() error {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		if !cmd.ProcessState.Success() {
			return fmt.Errorf("proxy exited with %v; log:\n%s", cmd.ProcessState, tail(p.log, 3000))
		}
		return nil
	case <-time.After(40 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		return errors.New("proxy did not stop within 40s of SIGTERM")
	}
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// testAdmin is the admin token the chaos test's proxy runs with.
const testAdmin = "test-admin-token"

// startFakeUpstream serves the fake OpenAI upstream from the test process (the escrow binary
// carries no test double); it outlives every restart of the proxy.
func startFakeUpstream(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}

// buildProxy compiles this package's command into a temporary directory.
func buildProxy(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "escrow-proxy")
	cmd := exec.Command("go", "build", "-o", bin, ".")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// chaosHTTP does one admin call against the running proxy.
func chaosAdmin(base, method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		j, _ := json.Marshal(body)
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, base+"/admin/v1"+path, rd)
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+testAdmin)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// TestChaos drives the proxy binary with 200 concurrent clients for 32 s on a private Redis
// (behind a fault proxy, AOF off) and a private Postgres, while it restarts Redis (data loss),
// kills the proxy with SIGKILL and restarts it, stops and starts Postgres (usage goes to the
// local journal) and drops Redis script replies, in a random order. Then, at rest, for every
// org: the ledger equals its credits minus the costs of the requests the clients saw succeed
// (each charged exactly once, at the cost the client computed), plus at most one charge for each
// request whose outcome the client never saw; no hold id is charged twice; no request the
// client saw refused is charged; the balance never went below the debt bound; and Redis
// available equals the ledger.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos test: skipped with -short")
	}
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("ESCROW_CHAOS_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("chaos seed %d (ESCROW_CHAOS_SEED to replay the fault order)", seed)
	rng := rand.New(rand.NewPCG(seed, 1))

	began := time.Now()
	rs := testutil.StartRedisServer(t)
	fp := testutil.StartFaultProxy(t, rs.Addr())
	pg := testutil.StartPostgresServer(t)
	bin := buildProxy(t)
	upstream := startFakeUpstream(t)
	dir := t.TempDir()
	p := &proxyProc{t: t, bin: bin, log: filepath.Join(dir, "proxy.log"), addr: freeAddr(t)}
	p.env = append(os.Environ(),
		"ESCROW_ADDR="+p.addr,
		"REDIS_URL=redis://"+fp.Addr()+"/0",
		"DATABASE_URL="+pg.URL(),
		"UPSTREAM_URL="+upstream,
		"UPSTREAM_API_KEY=sk-fake-upstream",
		"ESCROW_ADMIN_TOKEN="+testAdmin,
		"ESCROW_HOLD_TTL="+chaosHoldTTL.String(),
		"ESCROW_REAP_GRACE="+chaosReapGrace.String(),
		"ESCROW_REAP_INTERVAL=1s",
		"ESCROW_SCAN_INTERVAL=2s",
		"ESCROW_SWEEP_INTERVAL=500ms",
		"ESCROW_RECONCILE_INTERVAL=5s",
		"ESCROW_JOURNAL_DIR="+filepath.Join(dir, "journal"),
		"ESCROW_JOURNAL_REPLAY_INTERVAL=500ms",
		"ESCROW_MAX_IN_FLIGHT="+strconv.Itoa(chaosMaxInFlight),
		"ESCROW_SHUTDOWN_TIMEOUT=20s",
		"ESCROW_LOG_LEVEL=info",
	)
	t.Logf("built and started in %.1fs", time.Since(began).Seconds())
	p.start()
	defer p.kill()
	defer func() {
		if keep := os.Getenv("ESCROW_CHAOS_KEEP_LOG"); keep != "" {
			b, _ := os.ReadFile(p.log)
			_ = os.WriteFile(keep, b, 0o644)
		}
		if t.Failed() {
			t.Logf("proxy log (tail):\n%s", tail(p.log, 12000))
		}
	}()
	base := "http://" + p.addr

	// Setup: a model, four rich orgs, a poor one (429s, recharged during the run), a cold one.
	must := func(st int, b []byte, err error) []byte {
		t.Helper()
		if err != nil || st >= 300 {
			t.Fatalf("setup: %d %s %v", st, b, err)
		}
		return b
	}
	must(chaosAdmin(base, "PUT", "/models/m", map[string]any{"input_price": 1_000_000, "cached_input_price": 0, "output_price": 2_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": chaosMaxCost, "default_hold": chaosMaxCost}))
	orgs := []string{"rich1", "rich2", "rich3", "rich4", "poor", "cold"}
	keys := map[string]string{}
	for _, org := range orgs {
		must(chaosAdmin(base, "POST", "/orgs", map[string]string{"id": org}))
		funds := int64(chaosRichFunds)
		if org == "poor" {
			funds = chaosPoorFunds
		}
		must(chaosAdmin(base, "POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}))
		var k struct{ Key string }
		_ = json.Unmarshal(must(chaosAdmin(base, "POST", "/orgs/"+org+"/keys", nil)), &k)
		keys[org] = k.Key
	}
	loadOrgs := orgs[:5]

	client := &http.Client{
		Transport: &http.Transport{MaxIdleConns: 512, MaxIdleConnsPerHost: 512, IdleConnTimeout: 30 * time.Second},
		Timeout:   30 * time.Second,
	}

	// Load.
	ctx0 := context.Background()
	loadStart := time.Now()
	var (
		mu      sync.Mutex
		results []chaosResult
		stop    atomic.Bool
		wg      sync.WaitGroup
	)
	for i := range chaosClients {
		org := loadOrgs[i%len(loadOrgs)]
		crng := rand.New(rand.NewPCG(seed, uint64(i)+2))
		wg.Go(func() {
			var mine []chaosResult
			for !stop.Load() {
				r := chaosRequest(client, base, keys[org], crng)
				r.org = org
				mine = append(mine, r)
				switch {
				case r.kind == "unsent" || r.status == http.StatusServiceUnavailable:
					time.Sleep(time.Duration(20+crng.IntN(60)) * time.Millisecond)
				case r.status == http.StatusTooManyRequests:
					time.Sleep(time.Duration(50+crng.IntN(100)) * time.Millisecond)
				default:
					time.Sleep(time.Duration(crng.IntN(20)) * time.Millisecond)
				}
			}
			mu.Lock()
			results = append(results, mine...)
			mu.Unlock()
		})
	}

	// Credits to the poor org while the faults go on; only the ledger knows which landed when
	// the answer was lost, so each is checked there.
	type creditTry struct {
		ref    string
		status int
	}
	var (
		credits   []creditTry
		creditsWG sync.WaitGroup
	)
	creditsWG.Go(func() {
		for i := 0; !stop.Load(); i++ {
			time.Sleep(2 * time.Second)
			ref := fmt.Sprintf("chaos-credit-%d", i)
			st, _, _ := chaosAdmin(base, "POST", "/orgs/poor/credits", map[string]any{"amount": chaosCredit, "reference": ref})
			credits = append(credits, creditTry{ref, st})
		}
	})

	if os.Getenv("ESCROW_CHAOS_DEBUG") != "" {
		creditsWG.Go(func() {
			rc := rs.Client()
			for !stop.Load() {
				time.Sleep(500 * time.Millisecond)
				now := time.Now().UnixMilli()
				line := fmt.Sprintf("%5.1fs", time.Since(loadStart).Seconds())
				for _, org := range loadOrgs {
					k := balance.KeysOf(balance.DefaultPrefix, org).Hexp
					all, _ := rc.ZCard(ctx0, k).Result()
					unpinned, _ := rc.ZCount(ctx0, k, "-inf", strconv.FormatInt(now+12*3600*1000, 10)).Result()
					expired, _ := rc.ZCount(ctx0, k, "-inf", strconv.FormatInt(now, 10)).Result()
					line += fmt.Sprintf("  %s %d/%d/%d", org, all, unpinned, expired)
				}
				t.Log(line)
			}
		})
	}

	// Faults, one at a time, in a random order.
	type window struct {
		what       string
		start, end time.Time
	}
	var windows []window
	faults := []string{"redis-restart", "proxy-kill", "postgres-outage", "redis-drop", "proxy-kill", "redis-drop", "postgres-outage"}
	rng.Shuffle(len(faults), func(i, j int) { faults[i], faults[j] = faults[j], faults[i] })
	time.Sleep(3 * time.Second)
	coldDuringOutage := 0
	for _, f := range faults {
		w := window{what: f, start: time.Now()}
		switch f {
		case "redis-restart":
			rs.Kill() // AOF is off: every balance, hold and tombstone is gone
			time.Sleep(1500 * time.Millisecond)
			w.end = time.Now()
			rs.Start()
		case "proxy-kill":
			p.kill()
			time.Sleep(300 * time.Millisecond)
			p.start()
			p.restarts++
			w.end = time.Now()
		case "postgres-outage":
			pg.Stop()
			time.Sleep(1500 * time.Millisecond)
			// A cold org (never used, so neither its key nor its balance is cached) gets a 503.
			r := chaosRequest(client, base, keys["cold"], rand.New(rand.NewPCG(seed, 0)))
			if r.status != http.StatusServiceUnavailable {
				t.Errorf("cold org during the Postgres outage: status %d (%s), want 503", r.status, r.kind)
			}
			coldDuringOutage++
			time.Sleep(2500 * time.Millisecond)
			w.end = time.Now()
			pg.Start()
		case "redis-drop":
			fp.DropRepliesIf(40, testutil.RequestContains("evalsha"))
			time.Sleep(2 * time.Second)
			fp.Reset()
			w.end = time.Now()
		}
		windows = append(windows, w)
		t.Logf("fault %-16s %5.1fs … %5.1fs", f, w.start.Sub(loadStart).Seconds(), w.end.Sub(loadStart).Seconds())
		time.Sleep(1500 * time.Millisecond)
	}
	if rest := chaosLoad - time.Since(loadStart); rest > 0 {
		time.Sleep(rest)
	}
	stop.Store(true)
	wg.Wait()
	creditsWG.Wait()
	loadTime := time.Since(loadStart)

	// At rest: everything healthy; wait for the journal to be replayed, every hold to be
	// settled or reaped, and every entry to be settled.
	fp.Reset()
	ctx := context.Background()
	db, err := pgx.Connect(ctx, pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(ctx)
	type view struct {
		LedgerBalance int64 `json:"ledger_balance"`
		Available     int64 `json:"available"`
		Held          int64 `json:"held"`
		Holds         int   `json:"holds"`
		LedgerSeq     int64 `json:"ledger_seq"`
		SettledSeq    int64 `json:"settled_seq"`
	}
	views := map[string]view{}
	restDeadline := time.Now().Add(60 * time.Second)
	for {
		var pending int
		err := db.QueryRow(ctx, `SELECT count(*) FROM usage_events WHERE status = 'pending'`).Scan(&pending)
		ok := err == nil && pending == 0
		for _, org := range orgs {
			st, b, err := chaosAdmin(base, "GET", "/orgs/"+org+"/balance", nil)
			var v view
			if err != nil || st != http.StatusOK || json.Unmarshal(b, &v) != nil {
				ok = false
				continue
			}
			views[org] = v
			if v.Holds != 0 || v.Available != v.LedgerBalance || v.SettledSeq != v.LedgerSeq {
				ok = false
			}
		}
		if ok {
			break
		}
		if time.Now().After(restDeadline) {
			t.Fatalf("never at rest (pending usage %d, err %v): %+v", pending, err, views)
		}
		time.Sleep(200 * time.Millisecond)
	}
	restTime := time.Since(loadStart) - loadTime

	// A graceful stop flushes and exits 0; the journal is empty afterwards.
	if err := p.stop(); err != nil {
		t.Errorf("graceful stop: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "journal", "usage.journal")); err != nil || fi.Size() != 0 {
		t.Errorf("journal after the run: %v, size %d; want empty", err, fi.Size())
	}

	// The ledger, per hold id.
	type charge struct {
		org   string
		delta int64
		n     int
	}
	charges := map[string]*charge{}
	rows, err := db.Query(ctx, `SELECT org_id, hold_id::text, delta FROM ledger_entries WHERE kind = 'charge' ORDER BY org_id, seq`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var org, id string
		var delta int64
		if err := rows.Scan(&org, &id, &delta); err != nil {
			t.Fatal(err)
		}
		c := charges[id]
		if c == nil {
			c = &charge{org: org}
			charges[id] = c
		}
		c.delta += delta
		c.n++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	creditRefs := map[string]int64{}
	rows, err = db.Query(ctx, `SELECT ref, delta FROM ledger_entries WHERE kind = 'credit'`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var ref string
		var d int64
		if err := rows.Scan(&ref, &d); err != nil {
			t.Fatal(err)
		}
		creditRefs[ref] = d
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var events int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM usage_events`).Scan(&events); err != nil {
		t.Fatal(err)
	}
	if events != len(charges) {
		t.Errorf("%d usage events but %d charged hold ids", events, len(charges))
	}
	for id, c := range charges {
		if c.n != 1 {
			t.Errorf("hold %s charged %d times", id, c.n)
		}
	}

	// Every credit the admin API confirmed is in the ledger once; no other credit is.
	for _, c := range credits {
		if c.status == http.StatusCreated || c.status == http.StatusOK {
			if creditRefs[c.ref] != chaosCredit {
				t.Errorf("credit %s confirmed (%d) but not in the ledger", c.ref, c.status)
			}
		}
	}
	for ref := range creditRefs {
		if !strings.HasPrefix(ref, "init-") && !strings.HasPrefix(ref, "chaos-credit-") {
			t.Errorf("unexpected credit %s", ref)
		}
	}

	// Per org: what the clients saw against what the ledger charged.
	type tally struct {
		requests, ok, r429, r503, r5xx, other, unknown, unsent int
		okCost, unknownCharged                                 int64
		unknownNoID, unmatchedCharges                          int
	}
	tallies := map[string]*tally{}
	for _, org := range orgs {
		tallies[org] = &tally{}
	}
	seen := map[string]bool{}
	codes := map[string]int{}
	for _, r := range results {
		tl := tallies[r.org]
		tl.requests++
		codes[fmt.Sprintf("%s %d %s", r.kind, r.status, r.code)]++
		if r.holdID != "" {
			if seen[r.holdID] {
				t.Errorf("hold id %s seen by two requests", r.holdID)
			}
			seen[r.holdID] = true
		}
		c := charges[r.holdID]
		switch r.kind {
		case "ok":
			tl.ok++
			tl.okCost += r.cost
			switch {
			case c == nil:
				t.Errorf("request %s (%s) succeeded with cost %d but was never charged", r.holdID, r.org, r.cost)
			case -c.delta != r.cost || c.org != r.org:
				t.Errorf("request %s (%s) succeeded with cost %d but was charged %d to %s", r.holdID, r.org, r.cost, -c.delta, c.org)
			}
		case "refused":
			switch {
			case r.status == http.StatusTooManyRequests:
				tl.r429++
			case r.status == http.StatusServiceUnavailable:
				tl.r503++
			case r.status >= 500:
				tl.r5xx++
			default:
				tl.other++
			}
			if c != nil {
				t.Errorf("request %s (%s) got %d %s but was charged %d", r.holdID, r.org, r.status, r.code, -c.delta)
			}
		case "unknown":
			tl.unknown++
			if r.holdID == "" {
				tl.unknownNoID++
			} else if c != nil {
				tl.unknownCharged += -c.delta
			}
		case "unsent":
			tl.unsent++
		}
	}
	for id, c := range charges {
		if !seen[id] {
			tallies[c.org].unmatchedCharges++
			tallies[c.org].unknownCharged += -c.delta
		}
	}

	var total tally
	for _, org := range orgs {
		tl := tallies[org]
		v := views[org]
		var credited int64
		for ref, d := range creditRefs {
			if ref == "init-"+org || (org == "poor" && strings.HasPrefix(ref, "chaos-credit-")) {
				credited += d
			}
		}
		want := credited - tl.okCost - tl.unknownCharged
		t.Logf("%-6s requests %5d: 200 %5d, 429 %4d, 503 %4d, 5xx %4d, unknown %3d (no id %3d, charged %5d), unsent %3d; credits %8d, ledger %8d, available %8d",
			org, tl.requests, tl.ok, tl.r429, tl.r503, tl.r5xx, tl.unknown, tl.unknownNoID, tl.unknownCharged, tl.unsent, credited, v.LedgerBalance, v.Available)
		if v.LedgerBalance != want {
			t.Errorf("%s: ledger %d, want credits %d − successes %d − unknown-outcome charges %d = %d",
				org, v.LedgerBalance, credited, tl.okCost, tl.unknownCharged, want)
		}
		if tl.unmatchedCharges > tl.unknownNoID {
			t.Errorf("%s: %d charges for requests no client saw an id of, but only %d requests lost their answer before the headers",
				org, tl.unmatchedCharges, tl.unknownNoID)
		}
		if v.Available != v.LedgerBalance || v.Holds != 0 {
			t.Errorf("%s at rest: available %d, ledger %d, holds %d", org, v.Available, v.LedgerBalance, v.Holds)
		}
		// Debt: never below −(cap on requests in flight × the largest hold).
		var run, low int64
		rows, err := db.Query(ctx, `SELECT delta FROM ledger_entries WHERE org_id = $1 ORDER BY seq`, org)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var d int64
			_ = rows.Scan(&d)
			run += d
			low = min(low, run)
		}
		rows.Close()
		if low < -chaosMaxInFlight*chaosMaxCost {
			t.Errorf("%s went down to %d, below the debt bound %d", org, low, -chaosMaxInFlight*chaosMaxCost)
		}
		total.requests += tl.requests
		total.ok += tl.ok
		total.r429 += tl.r429
		total.r503 += tl.r503
		total.r5xx += tl.r5xx
		total.unknown += tl.unknown
		total.unsent += tl.unsent
	}

	// Redis down means 503, never a 200 or a false 429: requests that started after the kill and
	// ended before the restart.
	for _, w := range windows {
		if w.what != "redis-restart" {
			continue
		}
		for _, r := range results {
			if r.start.After(w.start.Add(100*time.Millisecond)) && r.end.Before(w.end) && r.kind != "unknown" && r.kind != "unsent" && r.status != http.StatusServiceUnavailable {
				t.Errorf("request during the Redis outage: %d %s, want 503", r.status, r.code)
			}
		}
	}
	// After a Redis restart every org is cold; each reseeds from the ledger and gets answers
	// from the reserve again (a 200, or the poor org's 429 insufficient_quota).
	for _, w := range windows {
		if w.what != "redis-restart" {
			continue
		}
		answered := map[string]bool{}
		for _, r := range results {
			if r.start.After(w.end) && (r.kind == "ok" || r.code == "insufficient_quota") {
				answered[r.org] = true
			}
		}
		for _, org := range loadOrgs {
			if !answered[org] {
				t.Errorf("%s was never served after the Redis restart", org)
			}
		}
	}
	// Warm orgs are served while Postgres is down (their usage goes to the journal).
	servedInOutage := 0
	for _, w := range windows {
		if w.what != "postgres-outage" {
			continue
		}
		for _, r := range results {
			if r.kind == "ok" && r.start.After(w.start.Add(time.Second)) && r.end.Before(w.end) {
				servedInOutage++
			}
		}
	}
	logText := tail(p.log, 1<<30)
	replays := strings.Count(logText, "local journal replayed into the ledger")
	journaled := strings.Count(logText, "usage goes to the local journal")
	t.Logf("chaos: %d clients, load %.1fs, rest %.1fs; requests %d: 200 %d, 429 %d, 503 %d, 5xx %d, unknown outcome %d, unsent %d; "+
		"proxy restarts %d, journal episodes %d, journal replays %d, served during Postgres outages %d, cold-org 503s %d, charged hold ids %d",
		chaosClients, loadTime.Seconds(), restTime.Seconds(), total.requests, total.ok, total.r429, total.r503, total.r5xx,
		total.unknown, total.unsent, p.restarts, journaled, replays, servedInOutage, coldDuringOutage, len(charges))
	t.Logf("outcomes: %v", codes)
	if testing.Verbose() {
		perSecond := map[int]map[string]int{}
		for _, r := range results {
			sec := int(r.start.Sub(loadStart).Seconds())
			if perSecond[sec] == nil {
				perSecond[sec] = map[string]int{}
			}
			perSecond[sec][fmt.Sprintf("%d%s", r.status, r.code)]++
		}
		for sec := 0; sec <= int(loadTime.Seconds()); sec++ {
			t.Logf("second %2d: %v", sec, perSecond[sec])
		}
	}
	if total.ok == 0 || total.r429 == 0 || total.r503 == 0 || total.r5xx == 0 {
		t.Errorf("the load did not cover every outcome: %+v", total)
	}
	if replays == 0 || journaled == 0 || servedInOutage == 0 {
		t.Errorf("the Postgres outages never went through the journal: %d outages journaled, %d replays, %d served", journaled, replays, servedInOutage)
	}
}

// chaosRequest sends one chat completion (JSON or stream, sometimes slow, sometimes failing
// upstream) and classifies what came back.
func chaosRequest(client *http.Client, base, key string, rng *rand.Rand) (r chaosResult) {
	r.start = time.Now()
	defer func() { r.end = time.Now() }()
	words := 1 + rng.IntN(6)
	content := strings.TrimSpace(strings.Repeat("hello ", words))
	switch x := rng.IntN(100); {
	case x < 8:
		content += " [fail]"
	case x < 38:
		content += " [slow]"
	}
	maxTokens := 1 + rng.IntN(20)
	if strings.Contains(content, "[slow]") {
		maxTokens = 1 + rng.IntN(2)
	}
	stream := rng.IntN(100) < 20
	body := map[string]any{"model": "m", "max_tokens": maxTokens, "messages": []map[string]string{{"role": "user", "content": content}}}
	if stream {
		body["stream"] = true
		body["stream_options"] = map[string]any{"include_usage": true}
	}
	j, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", base+"/v1/chat/completions", bytes.NewReader(j))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		r.kind = "unknown"
		if errors.Is(err, syscall.ECONNREFUSED) {
			r.kind = "unsent" // nothing listened: the request reached no one
		}
		return r
	}
	defer resp.Body.Close()
	r.status = resp.StatusCode
	r.holdID = resp.Header.Get("x-request-id")
	type usage struct {
		Prompt     int64 `json:"prompt_tokens"`
		Completion int64 `json:"completion_tokens"`
	}
	if resp.StatusCode != http.StatusOK {
		b, err := io.ReadAll(resp.Body)
		var e struct {
			Error struct{ Code string } `json:"error"`
		}
		if err != nil || json.Unmarshal(b, &e) != nil {
			r.kind = "unknown"
			return r
		}
		r.kind, r.code = "refused", e.Error.Code
		return r
	}
	r.kind = "unknown"
	if !stream {
		b, err := io.ReadAll(resp.Body)
		var out struct {
			Usage *usage `json:"usage"`
		}
		if err != nil || json.Unmarshal(b, &out) != nil || out.Usage == nil {
			return r
		}
		r.kind, r.cost = "ok", out.Usage.Prompt+2*out.Usage.Completion
		return r
	}
	var u *usage
	done := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			continue
		}
		var chunk struct {
			Usage *usage `json:"usage"`
			Error *struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		if json.Unmarshal([]byte(line), &chunk) == nil {
			if chunk.Usage != nil {
				u = chunk.Usage
			}
			if chunk.Error != nil {
				r.code = chunk.Error.Code
			}
		}
	}
	if sc.Err() == nil && done && u != nil && r.code == "" {
		r.kind, r.cost = "ok", u.Prompt+2*u.Completion
	}
	return r
}
