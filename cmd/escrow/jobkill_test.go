//go:build linux

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

// The SIGKILL test's knobs. A job's lease is short so the takeover comes quickly; the poller
// bounds a poll at half the lease, so a poll that hangs upstream holds its lease that long.
const (
	killJobs    = 20
	killLease   = 4 * time.Second
	killFunds   = 10_000_000
	killWait    = 90 * time.Second // generous: every wait below ends on its condition
	killOrg     = "acme"
	killOutWord = 2 // micro-units per output token; 1 per input token (cached or not)
)

// gatedUpstream is the fake upstream behind a gate: background responses are created at once,
// but every poll of one (GET /v1/responses/{id}) hangs until the test opens the gate (or the
// caller goes away), so no proxy can see a job end before that. After open, everything passes.
type gatedUpstream struct {
	fake   http.Handler
	open   chan struct{}
	once   sync.Once
	polls  atomic.Int64 // polls that reached the gate
	direct string       // the fake itself, ungated
}

func startGatedUpstream(t *testing.T) *gatedUpstream {
	t.Helper()
	g := &gatedUpstream{
		fake: fakeupstream.New(fakeupstream.Options{KeepRequests: -1, BackgroundDelay: 100 * time.Millisecond}),
		open: make(chan struct{}),
	}
	serve := func(h http.Handler) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
		return "http://" + ln.Addr().String()
	}
	g.direct = serve(g.fake)
	return g
}

func (g *gatedUpstream) release() { g.once.Do(func() { close(g.open) }) }

func (g *gatedUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, isPoll := strings.CutPrefix(r.URL.Path, "/v1/responses/")
	if isPoll && r.Method == http.MethodGet && !strings.Contains(rest, "/") {
		g.polls.Add(1)
		select {
		case <-g.open:
		case <-r.Context().Done():
			return // the poller gave up, or its process died
		}
	}
	g.fake.ServeHTTP(w, r)
}

// TestBackgroundJobsSurviveSIGKILL: proxy A (the escrow binary, a child process) starts 20
// background responses for an org and is SIGKILLed while its poller holds their leases (its polls
// hang at the upstream); proxy B (another child, same Redis prefix and Postgres schema) takes
// every job over once A's leases run out and, when the upstream lets the jobs end, settles each:
// charged exactly once (one ledger charge per hold id) at the usage the upstream reports, no hold
// left in Redis, and the ledger equal to the credit less what the upstream billed.
func TestBackgroundJobsSurviveSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("SIGKILL test: skipped with -short")
	}
	t.Parallel()
	ctx := context.Background()
	rdb := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	bin := buildProxy(t)
	up := startGatedUpstream(t)
	gateURL := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: up, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
		return "http://" + ln.Addr().String()
	}()
	dir := t.TempDir()
	proxy := func(name string) *proxyProc {
		p := &proxyProc{t: t, bin: bin, log: filepath.Join(dir, name+".log"), addr: freeAddr(t)}
		p.env = append(os.Environ(),
			"ESCROW_ADDR="+p.addr,
			"REDIS_URL="+rdb.URL,
			"ESCROW_PREFIX="+rdb.Prefix,
			"DATABASE_URL="+pg.URL,
			"UPSTREAM_URL="+gateURL,
			"UPSTREAM_API_KEY=sk-fake-upstream",
			"ESCROW_ADMIN_TOKEN="+testAdmin,
			"ESCROW_JOB_LEASE="+killLease.String(),
			"ESCROW_JOB_MIN_BACKOFF=50ms",
			"ESCROW_JOB_MAX_BACKOFF=250ms",
			"ESCROW_JOURNAL_DIR="+filepath.Join(dir, name+"-journal"),
			"ESCROW_LOG_LEVEL=info",
		)
		t.Cleanup(p.kill)
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("proxy %s log (tail):\n%s", name, tail(p.log, 6000))
			}
		})
		return p
	}
	a := proxy("a")
	a.start()
	base := "http://" + a.addr
	must := func(st int, b []byte, err error) []byte {
		t.Helper()
		if err != nil || st >= 300 {
			t.Fatalf("setup: %d %s %v", st, b, err)
		}
		return b
	}
	must(chaosAdmin(base, "PUT", "/models/m", map[string]any{"input_price": 1_000_000, "cached_input_price": 1_000_000,
		"output_price": killOutWord * 1_000_000, "max_input_tokens": 100_000, "max_output_tokens": 1000,
		"max_cost": 101_000, "default_hold": 101_000}))
	must(chaosAdmin(base, "POST", "/orgs", map[string]string{"id": killOrg}))
	must(chaosAdmin(base, "POST", "/orgs/"+killOrg+"/credits", map[string]any{"amount": killFunds, "reference": "init-" + killOrg}))
	var k struct{ Key string }
	if err := json.Unmarshal(must(chaosAdmin(base, "POST", "/orgs/"+killOrg+"/keys", nil)), &k); err != nil || k.Key == "" {
		t.Fatalf("key: %v %q", err, k.Key)
	}

	// 20 background responses through A, of different sizes (1 to 5 words of input).
	upstreamIDs := make([]string, killJobs)
	var wg sync.WaitGroup
	errs := make(chan error, killJobs)
	for i := range killJobs {
		wg.Go(func() {
			input := strings.TrimSpace(strings.Repeat(fmt.Sprintf("w%d ", i), 1+i%5))
			body := fmt.Sprintf(`{"model":"m","background":true,"input":%q}`, input)
			req, _ := http.NewRequest("POST", base+"/v1/responses", strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+k.Key)
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			var r struct{ ID, Status string }
			if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&r) != nil || r.ID == "" || r.Status != "queued" {
				errs <- fmt.Errorf("background create %d: %d %+v", i, resp.StatusCode, r)
				return
			}
			upstreamIDs[i] = r.ID
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// Wait until A's poller holds a lease on every job at once (its polls hang at the gate), then
	// SIGKILL it: nothing is given back, each lease stays taken until it runs out.
	db := pg.Pool
	waitFor(t, "proxy A to hold a lease on every job", func() (bool, string) {
		var total, leased, owners int
		err := db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE lease_until > now()),
			count(DISTINCT lease_owner) FILTER (WHERE lease_until > now()) FROM jobs WHERE settled_at IS NULL`).Scan(&total, &leased, &owners)
		return err == nil && total == killJobs && leased == killJobs && owners == 1,
			fmt.Sprintf("live %d, leased %d, owners %d, err %v", total, leased, owners, err)
	})
	a.kill()
	var leasedAtKill int
	var deadOwner string
	if err := db.QueryRow(ctx, `SELECT count(*), coalesce(max(lease_owner), '') FROM jobs
		WHERE settled_at IS NULL AND lease_until > now()`).Scan(&leasedAtKill, &deadOwner); err != nil {
		t.Fatal(err)
	}
	if leasedAtKill == 0 {
		t.Fatal("the killed proxy holds no lease any more: the takeover would not be tested")
	}
	killedAt := time.Now()
	t.Logf("proxy A SIGKILLed holding the leases of %d of %d jobs (owner %s); %d polls reached the upstream", leasedAtKill, killJobs, deadOwner, up.polls.Load())

	// B takes over; then the upstream lets the jobs end.
	b := proxy("b")
	b.start()
	base = "http://" + b.addr
	up.release()
	waitFor(t, "every job settled", func() (bool, string) {
		var live int
		err := db.QueryRow(ctx, `SELECT count(*) FROM jobs WHERE settled_at IS NULL`).Scan(&live)
		return err == nil && live == 0, fmt.Sprintf("live %d, err %v", live, err)
	})
	t.Logf("every job settled %.1fs after the kill (lease %v)", time.Since(killedAt).Seconds(), killLease)

	// The org at rest: every usage event charged (the worker charges after a job is settled),
	// no hold left.
	var v accounting.Balance
	waitFor(t, "the org at rest", func() (bool, string) {
		st, body, err := chaosAdmin(base, "GET", "/orgs/"+killOrg+"/balance", nil)
		v = accounting.Balance{}
		if err != nil || st != http.StatusOK || json.Unmarshal(body, &v) != nil {
			return false, fmt.Sprintf("%d %s %v", st, body, err)
		}
		var pending int
		err = db.QueryRow(ctx, `SELECT coalesce(sum(n), 0) FROM usage_pending`).Scan(&pending)
		return err == nil && pending == 0 && v.Holds == 0 && v.Held == 0 && v.SettledSeq == v.LedgerSeq && v.Available == v.LedgerBalance,
			fmt.Sprintf("%+v, usage pending %d (%v)", v, pending, err)
	})

	// What the upstream billed each job: its usage, priced 1 per input token and 2 per output.
	billed := map[string]int64{}
	var totalBilled int64
	for _, id := range upstreamIDs {
		resp, err := http.Get(up.direct + "/v1/responses/" + url.PathEscape(id))
		if err != nil {
			t.Fatal(err)
		}
		var r struct {
			Status string
			Usage  *fakeupstream.ResponsesUsage
		}
		err = json.NewDecoder(resp.Body).Decode(&r)
		resp.Body.Close()
		if err != nil || r.Status != "completed" || r.Usage == nil {
			t.Fatalf("upstream %s: %v %+v", id, err, r)
		}
		billed[id] = int64(r.Usage.InputTokens + killOutWord*r.Usage.OutputTokens)
		totalBilled += billed[id]
	}

	// Each job: settled completed, charged once (one ledger charge for its hold id) its real cost.
	type jobRow struct {
		id, status, owner string
		cost              int64
	}
	jobs := map[string]jobRow{}
	rows, err := db.Query(ctx, `SELECT id::text, upstream_id, status, cost, coalesce(lease_owner, '') FROM jobs WHERE org_id = $1`, killOrg)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var j jobRow
		var upID string
		if err := rows.Scan(&j.id, &upID, &j.status, &j.cost, &j.owner); err != nil {
			t.Fatal(err)
		}
		jobs[upID] = j
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	type charge struct {
		n     int
		delta int64
	}
	charges := map[string]charge{}
	rows, err = db.Query(ctx, `SELECT hold_id::text, count(*), sum(delta) FROM ledger_entries
		WHERE org_id = $1 AND kind = 'charge' GROUP BY hold_id`, killOrg)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var c charge
		if err := rows.Scan(&id, &c.n, &c.delta); err != nil {
			t.Fatal(err)
		}
		charges[id] = c
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(jobs) != killJobs || len(charges) != killJobs {
		t.Errorf("%d jobs and %d charged hold ids, want %d of each", len(jobs), len(charges), killJobs)
	}
	for upID, want := range billed {
		j, ok := jobs[upID]
		if !ok {
			t.Errorf("upstream %s: no job", upID)
			continue
		}
		c := charges[j.id]
		if j.status != "completed" || j.cost != want || c.n != 1 || -c.delta != want {
			t.Errorf("job %s (upstream %s): status %s, cost %d, %d charges totalling %d; want completed, charged %d once",
				j.id, upID, j.status, j.cost, c.n, -c.delta, want)
		}
	}

	// The ledger is the credit less what the upstream billed.
	if want := int64(killFunds) - totalBilled; v.LedgerBalance != want {
		t.Errorf("ledger %d, want credit %d − billed %d = %d", v.LedgerBalance, killFunds, totalBilled, want)
	}
	// Redis itself: no unfinished hold of the org (its hexp set is empty).
	hexp := balance.KeysOf(rdb.Prefix, killOrg).Hexp
	if n, err := rdb.Client.ZCard(ctx, hexp).Result(); err != nil || n != 0 {
		t.Errorf("Redis %s: %d unfinished holds after every job settled (%v)", hexp, n, err)
	}
	t.Logf("%d jobs settled by proxy B, billed %d in all; ledger %d", killJobs, totalBilled, v.LedgerBalance)
}

// waitFor polls cond every 20ms until it holds, or fails the test after killWait with cond's
// last note.
func waitFor(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(killWait)
	for {
		ok, note := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s: %s", killWait, what, note)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
