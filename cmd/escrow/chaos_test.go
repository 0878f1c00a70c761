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

	"github.com/llmescrow/escrow/accounting"
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
	deadline := time.Now().Add(time.Minute) // bounds a hang: a loaded machine starts it slowly
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
			p.t.Fatalf("proxy not healthy after a minute: %v; log:\n%s", err, tail(p.log, 4000))
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
	// CGO_ENABLED=0, as make's non-race steps (go vet, the simulation, the model check) and the
	// image build: one build configuration, compiled once on an empty build cache.
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
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
// chaosRun is one run of the chaos test: the services and the proxy it runs, the orgs it loads,
// and what the clients, the credits and the faults saw.
type chaosRun struct {
	t    *testing.T
	seed uint64
	rs   *testutil.RedisServer
	fp   *testutil.FaultProxy
	pg   *testutil.PostgresServer
	p    *proxyProc
	dir  string
	base string

	client   *http.Client
	orgs     []string // every org; the first five take the load
	loadOrgs []string
	keys     map[string]string

	loadStart        time.Time
	loadTime         time.Duration
	results          []chaosResult
	credits          []creditTry
	windows          []faultWindow
	coldDuringOutage int
	views            map[string]accounting.Balance // each org's balance as the admin API shows it, at rest
}

// creditTry is one credit to the poor org during the faults, with the status it got.
type creditTry struct {
	ref    string
	status int
}

// faultWindow is when a fault was in force.
type faultWindow struct {
	what       string
	start, end time.Time
}

// chaosCharge is what the ledger charged one hold id: to which org, how much, how many times.
type chaosCharge struct {
	org   string
	delta int64
	n     int
}

// chaosTally counts what the clients of one org saw.
type chaosTally struct {
	requests, ok, r429, r503, r5xx, other, unknown, unsent int
	okCost, unknownCharged                                 int64
	unknownNoID, unmatchedCharges                          int
}

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

	c := startChaos(t, seed)
	c.setup()
	stop, wait := c.load()
	c.faults(rng)
	stop()
	wait()
	c.loadTime = time.Since(c.loadStart)

	ctx := context.Background()
	db, err := pgx.Connect(ctx, c.pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(ctx)
	c.waitAtRest(db)
	restTime := time.Since(c.loadStart) - c.loadTime
	c.checkStop()
	charges, creditRefs := c.readLedger(db)
	c.checkCredits(creditRefs)
	tallies, seen, codes := c.tally(charges)
	total := c.checkOrgs(db, tallies, seen, charges, creditRefs)
	c.checkRedisOutages()
	servedInOutage := c.servedInPostgresOutages()
	c.report(total, charges, codes, servedInOutage, restTime)
}

// startChaos starts Redis behind a fault proxy, a private Postgres, the fake upstream and the
// proxy binary, built for the test, configured for short holds and quick background loops.
func startChaos(t *testing.T, seed uint64) *chaosRun {
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
	t.Cleanup(p.kill)
	t.Cleanup(func() {
		if keep := os.Getenv("ESCROW_CHAOS_KEEP_LOG"); keep != "" {
			b, _ := os.ReadFile(p.log)
			_ = os.WriteFile(keep, b, 0o644)
		}
		if t.Failed() {
			t.Logf("proxy log (tail):\n%s", tail(p.log, 12000))
		}
	})
	return &chaosRun{t: t, seed: seed, rs: rs, fp: fp, pg: pg, p: p, dir: dir, base: "http://" + p.addr,
		client: &http.Client{
			Transport: &http.Transport{MaxIdleConns: 512, MaxIdleConnsPerHost: 512, IdleConnTimeout: 30 * time.Second},
			Timeout:   30 * time.Second,
		}}
}

// setup makes a model, four rich orgs, a poor one (429s, recharged during the run) and a cold
// one, each with a key.
func (c *chaosRun) setup() {
	t := c.t
	must := func(st int, b []byte, err error) []byte {
		t.Helper()
		if err != nil || st >= 300 {
			t.Fatalf("setup: %d %s %v", st, b, err)
		}
		return b
	}
	must(chaosAdmin(c.base, "PUT", "/models/m", map[string]any{"input_price": 1_000_000, "cached_input_price": 0, "output_price": 2_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": chaosMaxCost, "default_hold": chaosMaxCost}))
	c.orgs = []string{"rich1", "rich2", "rich3", "rich4", "poor", "cold"}
	c.keys = map[string]string{}
	for _, org := range c.orgs {
		must(chaosAdmin(c.base, "POST", "/orgs", map[string]string{"id": org}))
		funds := int64(chaosRichFunds)
		if org == "poor" {
			funds = chaosPoorFunds
		}
		must(chaosAdmin(c.base, "POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}))
		var k struct{ Key string }
		_ = json.Unmarshal(must(chaosAdmin(c.base, "POST", "/orgs/"+org+"/keys", nil)), &k)
		c.keys[org] = k.Key
	}
	c.loadOrgs = c.orgs[:5]
}

// load starts the clients, the credits to the poor org (only the ledger knows which landed when
// the answer was lost, so each is checked there) and, with ESCROW_CHAOS_DEBUG, a line of hold
// counts every half second. stop ends them all; wait waits for them and collects the results.
func (c *chaosRun) load() (stop, wait func()) {
	c.loadStart = time.Now()
	var (
		mu        sync.Mutex
		stopped   atomic.Bool
		wg        sync.WaitGroup
		creditsWG sync.WaitGroup
	)
	for i := range chaosClients {
		org := c.loadOrgs[i%len(c.loadOrgs)]
		crng := rand.New(rand.NewPCG(c.seed, uint64(i)+2))
		wg.Go(func() {
			var mine []chaosResult
			for !stopped.Load() {
				r := chaosRequest(c.client, c.base, c.keys[org], crng)
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
			c.results = append(c.results, mine...)
			mu.Unlock()
		})
	}
	creditsWG.Go(func() {
		for i := 0; !stopped.Load(); i++ {
			time.Sleep(2 * time.Second)
			ref := fmt.Sprintf("chaos-credit-%d", i)
			st, _, _ := chaosAdmin(c.base, "POST", "/orgs/poor/credits", map[string]any{"amount": chaosCredit, "reference": ref})
			c.credits = append(c.credits, creditTry{ref, st})
		}
	})
	if os.Getenv("ESCROW_CHAOS_DEBUG") != "" {
		creditsWG.Go(func() { c.debugHolds(&stopped) })
	}
	return func() { stopped.Store(true) }, func() { wg.Wait(); creditsWG.Wait() }
}

// debugHolds logs, every half second until stopped, each load org's holds: all, unpinned,
// expired.
func (c *chaosRun) debugHolds(stopped *atomic.Bool) {
	ctx := context.Background()
	rc := c.rs.Client()
	for !stopped.Load() {
		time.Sleep(500 * time.Millisecond)
		now := time.Now().UnixMilli()
		line := fmt.Sprintf("%5.1fs", time.Since(c.loadStart).Seconds())
		for _, org := range c.loadOrgs {
			k := balance.KeysOf(balance.DefaultPrefix, org).Hexp
			all, _ := rc.ZCard(ctx, k).Result()
			unpinned, _ := rc.ZCount(ctx, k, "-inf", strconv.FormatInt(now+12*3600*1000, 10)).Result()
			expired, _ := rc.ZCount(ctx, k, "-inf", strconv.FormatInt(now, 10)).Result()
			line += fmt.Sprintf("  %s %d/%d/%d", org, all, unpinned, expired)
		}
		c.t.Log(line)
	}
}

// faults plays the faults, one at a time, in a random order, then lets the load run to its end.
func (c *chaosRun) faults(rng *rand.Rand) {
	faults := []string{"redis-restart", "proxy-kill", "postgres-outage", "redis-drop", "proxy-kill", "redis-drop", "postgres-outage"}
	rng.Shuffle(len(faults), func(i, j int) { faults[i], faults[j] = faults[j], faults[i] })
	time.Sleep(3 * time.Second)
	for _, f := range faults {
		w := faultWindow{what: f, start: time.Now()}
		switch f {
		case "redis-restart":
			c.rs.Kill() // AOF is off: every balance, hold and tombstone is gone
			time.Sleep(1500 * time.Millisecond)
			w.end = time.Now()
			c.rs.Start()
		case "proxy-kill":
			c.p.kill()
			time.Sleep(300 * time.Millisecond)
			c.p.start()
			c.p.restarts++
			w.end = time.Now()
		case "postgres-outage":
			c.pg.Stop()
			time.Sleep(1500 * time.Millisecond)
			// A cold org (never used, so neither its key nor its balance is cached) gets a 503.
			r := chaosRequest(c.client, c.base, c.keys["cold"], rand.New(rand.NewPCG(c.seed, 0)))
			if r.status != http.StatusServiceUnavailable {
				c.t.Errorf("cold org during the Postgres outage: status %d (%s), want 503", r.status, r.kind)
			}
			c.coldDuringOutage++
			time.Sleep(2500 * time.Millisecond)
			w.end = time.Now()
			c.pg.Start()
		case "redis-drop":
			c.fp.DropRepliesIf(40, testutil.RequestContains("evalsha"))
			time.Sleep(2 * time.Second)
			c.fp.Reset()
			w.end = time.Now()
		}
		c.windows = append(c.windows, w)
		c.t.Logf("fault %-16s %5.1fs … %5.1fs", f, w.start.Sub(c.loadStart).Seconds(), w.end.Sub(c.loadStart).Seconds())
		time.Sleep(1500 * time.Millisecond)
	}
	if rest := chaosLoad - time.Since(c.loadStart); rest > 0 {
		time.Sleep(rest)
	}
}

// waitAtRest waits, everything healthy again, for the journal to be replayed, every hold to be
// settled or reaped, and every entry to be settled; it keeps each org's balance in c.views.
func (c *chaosRun) waitAtRest(db *pgx.Conn) {
	c.fp.Reset()
	ctx := context.Background()
	c.views = map[string]accounting.Balance{}
	restDeadline := time.Now().Add(60 * time.Second)
	for {
		var pending int
		err := db.QueryRow(ctx, `SELECT coalesce(sum(n), 0) FROM usage_pending`).Scan(&pending)
		ok := err == nil && pending == 0
		for _, org := range c.orgs {
			st, b, err := chaosAdmin(c.base, "GET", "/orgs/"+org+"/balance", nil)
			var v accounting.Balance
			if err != nil || st != http.StatusOK || json.Unmarshal(b, &v) != nil {
				ok = false
				continue
			}
			c.views[org] = v
			if v.Holds != 0 || v.Available != v.LedgerBalance || v.SettledSeq != v.LedgerSeq {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(restDeadline) {
			c.t.Fatalf("never at rest (pending usage %d, err %v): %+v", pending, err, c.views)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// checkStop: a graceful stop flushes and exits 0; the journal is empty afterwards.
func (c *chaosRun) checkStop() {
	if err := c.p.stop(); err != nil {
		c.t.Errorf("graceful stop: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(c.dir, "journal", "usage.journal")); err != nil || fi.Size() != 0 {
		c.t.Errorf("journal after the run: %v, size %d; want empty", err, fi.Size())
	}
}

// readLedger reads the charges per hold id and the credits per reference, and checks that
// every usage event was charged once.
func (c *chaosRun) readLedger(db *pgx.Conn) (charges map[string]*chaosCharge, creditRefs map[string]int64) {
	t, ctx := c.t, context.Background()
	charges = map[string]*chaosCharge{}
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
		ch := charges[id]
		if ch == nil {
			ch = &chaosCharge{org: org}
			charges[id] = ch
		}
		ch.delta += delta
		ch.n++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	creditRefs = map[string]int64{}
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
	for id, ch := range charges {
		if ch.n != 1 {
			t.Errorf("hold %s charged %d times", id, ch.n)
		}
	}
	return charges, creditRefs
}

// checkCredits: every credit the admin API confirmed is in the ledger once; no other credit is.
func (c *chaosRun) checkCredits(creditRefs map[string]int64) {
	for _, cr := range c.credits {
		if cr.status == http.StatusCreated || cr.status == http.StatusOK {
			if creditRefs[cr.ref] != chaosCredit {
				c.t.Errorf("credit %s confirmed (%d) but not in the ledger", cr.ref, cr.status)
			}
		}
	}
	for ref := range creditRefs {
		if !strings.HasPrefix(ref, "init-") && !strings.HasPrefix(ref, "chaos-credit-") {
			c.t.Errorf("unexpected credit %s", ref)
		}
	}
}

// tally counts, per org, what the clients saw, and checks each answer against the ledger: a
// success charged its cost once, to its org; a refusal charged nothing; no hold id twice.
func (c *chaosRun) tally(charges map[string]*chaosCharge) (tallies map[string]*chaosTally, seen map[string]bool, codes map[string]int) {
	t := c.t
	tallies = map[string]*chaosTally{}
	for _, org := range c.orgs {
		tallies[org] = &chaosTally{}
	}
	seen = map[string]bool{}
	codes = map[string]int{}
	for _, r := range c.results {
		tl := tallies[r.org]
		tl.requests++
		codes[fmt.Sprintf("%s %d %s", r.kind, r.status, r.code)]++
		if r.holdID != "" {
			if seen[r.holdID] {
				t.Errorf("hold id %s seen by two requests", r.holdID)
			}
			seen[r.holdID] = true
		}
		ch := charges[r.holdID]
		switch r.kind {
		case "ok":
			tl.ok++
			tl.okCost += r.cost
			switch {
			case ch == nil:
				t.Errorf("request %s (%s) succeeded with cost %d but was never charged", r.holdID, r.org, r.cost)
			case -ch.delta != r.cost || ch.org != r.org:
				t.Errorf("request %s (%s) succeeded with cost %d but was charged %d to %s", r.holdID, r.org, r.cost, -ch.delta, ch.org)
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
			if ch != nil {
				t.Errorf("request %s (%s) got %d %s but was charged %d", r.holdID, r.org, r.status, r.code, -ch.delta)
			}
		case "unknown":
			tl.unknown++
			if r.holdID == "" {
				tl.unknownNoID++
			} else if ch != nil {
				tl.unknownCharged += -ch.delta
			}
		case "unsent":
			tl.unsent++
		}
	}
	return tallies, seen, codes
}

// checkOrgs checks each org's accounts: the ledger is its credits less what its clients saw
// charged and the charges of unknown outcome; charges no client saw an id of are at most the
// answers lost before the headers; at rest nothing is held; the debt stayed within its bound.
// It returns the totals over the orgs.
func (c *chaosRun) checkOrgs(db *pgx.Conn, tallies map[string]*chaosTally, seen map[string]bool,
	charges map[string]*chaosCharge, creditRefs map[string]int64) (total chaosTally) {
	t := c.t
	for id, ch := range charges {
		if !seen[id] {
			tallies[ch.org].unmatchedCharges++
			tallies[ch.org].unknownCharged += -ch.delta
		}
	}
	for _, org := range c.orgs {
		tl := tallies[org]
		v := c.views[org]
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
		c.checkDebt(db, org)
		total.requests += tl.requests
		total.ok += tl.ok
		total.r429 += tl.r429
		total.r503 += tl.r503
		total.r5xx += tl.r5xx
		total.unknown += tl.unknown
		total.unsent += tl.unsent
	}
	return total
}

// checkDebt: an org's running balance never went below −(cap on requests in flight × the
// largest hold).
func (c *chaosRun) checkDebt(db *pgx.Conn, org string) {
	var run, low int64
	rows, err := db.Query(context.Background(), `SELECT delta FROM ledger_entries WHERE org_id = $1 ORDER BY seq`, org)
	if err != nil {
		c.t.Fatal(err)
	}
	for rows.Next() {
		var d int64
		_ = rows.Scan(&d)
		run += d
		low = min(low, run)
	}
	rows.Close()
	if low < -chaosMaxInFlight*chaosMaxCost {
		c.t.Errorf("%s went down to %d, below the debt bound %d", org, low, -chaosMaxInFlight*chaosMaxCost)
	}
}

// checkRedisOutages: Redis down means 503, never a 200 or a false 429 (requests that started
// after the kill and ended before the restart); after a restart every org is cold, reseeds from
// the ledger and gets answers from the reserve again (a 200, or the poor org's 429
// insufficient_quota).
func (c *chaosRun) checkRedisOutages() {
	for _, w := range c.windows {
		if w.what != "redis-restart" {
			continue
		}
		for _, r := range c.results {
			if r.start.After(w.start.Add(100*time.Millisecond)) && r.end.Before(w.end) && r.kind != "unknown" && r.kind != "unsent" && r.status != http.StatusServiceUnavailable {
				c.t.Errorf("request during the Redis outage: %d %s, want 503", r.status, r.code)
			}
		}
	}
	for _, w := range c.windows {
		if w.what != "redis-restart" {
			continue
		}
		answered := map[string]bool{}
		for _, r := range c.results {
			if r.start.After(w.end) && (r.kind == "ok" || r.code == "insufficient_quota") {
				answered[r.org] = true
			}
		}
		for _, org := range c.loadOrgs {
			if !answered[org] {
				c.t.Errorf("%s was never served after the Redis restart", org)
			}
		}
	}
}

// servedInPostgresOutages counts the successes while Postgres was down (warm orgs are served,
// their usage goes to the journal).
func (c *chaosRun) servedInPostgresOutages() int {
	served := 0
	for _, w := range c.windows {
		if w.what != "postgres-outage" {
			continue
		}
		for _, r := range c.results {
			if r.kind == "ok" && r.start.After(w.start.Add(time.Second)) && r.end.Before(w.end) {
				served++
			}
		}
	}
	return served
}

// report logs the run's totals (and, with -v, the outcomes second by second) and checks that
// the load met every outcome and that the Postgres outages went through the journal.
func (c *chaosRun) report(total chaosTally, charges map[string]*chaosCharge, codes map[string]int, servedInOutage int, restTime time.Duration) {
	t := c.t
	logText := tail(c.p.log, 1<<30)
	replays := strings.Count(logText, "local journal replayed into the ledger")
	journaled := strings.Count(logText, "usage goes to the local journal")
	t.Logf("chaos: %d clients, load %.1fs, rest %.1fs; requests %d: 200 %d, 429 %d, 503 %d, 5xx %d, unknown outcome %d, unsent %d; "+
		"proxy restarts %d, journal episodes %d, journal replays %d, served during Postgres outages %d, cold-org 503s %d, charged hold ids %d",
		chaosClients, c.loadTime.Seconds(), restTime.Seconds(), total.requests, total.ok, total.r429, total.r503, total.r5xx,
		total.unknown, total.unsent, c.p.restarts, journaled, replays, servedInOutage, c.coldDuringOutage, len(charges))
	t.Logf("outcomes: %v", codes)
	if testing.Verbose() {
		perSecond := map[int]map[string]int{}
		for _, r := range c.results {
			sec := int(r.start.Sub(c.loadStart).Seconds())
			if perSecond[sec] == nil {
				perSecond[sec] = map[string]int{}
			}
			perSecond[sec][fmt.Sprintf("%d%s", r.status, r.code)]++
		}
		for sec := 0; sec <= int(c.loadTime.Seconds()); sec++ {
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
