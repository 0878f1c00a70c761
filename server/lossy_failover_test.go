package server

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// The lossy-failover test's knobs.
const (
	lfRich, lfPoor  = 8, 2 // orgs with plenty of money, orgs that run out
	lfClients       = 5    // clients per org: 50 in all
	lfPause         = 5 * time.Millisecond
	lfRichFunds     = 100_000_000
	lfPoorFunds     = 650 // the warm-up (20) and then 31 requests at most
	lfCost, lfHold  = 20, 65
	lfDeadline      = 2 * time.Minute // generous: a condition that does not come within it is a failure
	lfWaitTimeout   = 100 * time.Millisecond
	lfRichAfterHang = 20 // rich orgs' requests that must start during the hold-back
)

// lfResult is what one client saw of one request.
type lfResult struct {
	org        string
	status     int
	id, code   string // x-request-id; the error code of a refusal
	start, end time.Time
}

// lfLoad is the clients' record of what they saw.
type lfLoad struct {
	mu      sync.Mutex
	results []lfResult
}

func (l *lfLoad) add(r lfResult) {
	l.mu.Lock()
	l.results = append(l.results, r)
	l.mu.Unlock()
}

// count counts the results that match.
func (l *lfLoad) count(match func(r lfResult) bool) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.results {
		if match(r) {
			n++
		}
	}
	return n
}

// lfWait polls cond until it holds, failing the test after lfDeadline.
func lfWait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(lfDeadline)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, lfDeadline)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replicate makes r a replica of the server at addr and waits until master m reports it online.
func replicate(t *testing.T, r *testutil.RedisServer, addr string, m *testutil.RedisServer) {
	t.Helper()
	ctx := context.Background()
	host, port, _ := strings.Cut(addr, ":")
	if err := r.Client().ReplicaOf(ctx, host, port).Err(); err != nil {
		t.Fatal(err)
	}
	lfWait(t, "replica "+r.Addr()+" online", func() bool {
		info, err := m.Client().Info(ctx, "replication").Result()
		return err == nil && strings.Contains(info, "connected_slaves:1") && strings.Contains(info, "state=online")
	})
}

// TestLossyFailover (issue 34 item 7): a Redis master with one replica, replication held back,
// the master killed and the replica promoted, under load — the failover loses the master's last
// writes (holds, finishes, settles) — and the money stays exact.
//
// Topology: master M; replica R1 of M, its replication link through a fault proxy that holds
// every byte back (Hang) when told; replica R2 of R1 (so that R1, once promoted, has a replica,
// as an operator would give it). The proxy reaches Redis through a second fault proxy, the
// "service address", moved from M to R1 after the promotion (a DNS name or virtual IP of a
// managed Redis). 50 clients: 5 for each of 8 rich orgs from the start, 5 for each of 2 poor
// orgs (funds for 31 requests) from the moment replication is held back. The master is killed
// once the poor orgs have spent everything on it (a 429) and the rich orgs have had
// lfRichAfterHang requests; R1 is promoted (REPLICAOF NO ONE), its holds and tombstones read,
// and the service address moved to it. The load goes on until every rich org has been served
// by R1 and the poor orgs are refused again. Asserted, per org, at rest:
//   - every request that got a 200 is billed exactly once at its cost, nothing else is billed,
//     and the ledger's balance is the funds minus those costs (the ledger is the truth: the
//     failover loses no usage event, so no money is lost to the seller);
//   - Redis agrees with the ledger (available = ledger balance, no hold left) — through the
//     settles that follow the failover (a settle past R1's watermark is a GAP, and the entries
//     R1 lacks are sent again), with the reconciler left at its 1-minute cycle, and the
//     reaper for a hold R1 got whose release only M saw (with WAIT: a reserve replicated just
//     before the hold-back whose acknowledgement was held back — 503, released on M);
//   - debt (a ledger balance below zero) is at most the sum of the holds the failover lost (the
//     200s whose hold, reserved on M, is neither held nor tombstoned on R1 at its promotion);
//   - without WAIT the failover did lose holds (else this test would prove nothing); with
//     ESCROW_REDIS_WAIT_REPLICAS=1 it lost none, the poor orgs owe nothing, and the reserves
//     made while replication was held back were refused (503).
//
// Logged: statuses, the 503s, the time from the kill to the first 200, the holds lost and the
// largest debt (docs/failover.md quotes them).
func TestLossyFailover(t *testing.T) {
	t.Parallel()
	for _, wait := range []bool{false, true} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) { lossyFailover(t, wait) })
	}
}

func lossyFailover(t *testing.T, wait bool) {
	ctx := context.Background()
	syncNow := testutil.RedisArgs("--repl-diskless-sync-delay", "0")
	m, r1, r2 := testutil.StartRedisServer(t, syncNow), testutil.StartRedisServer(t, syncNow), testutil.StartRedisServer(t, syncNow)
	link := testutil.StartFaultProxy(t, m.Addr()) // M → R1 replication
	replicate(t, r1, link.Addr(), m)
	replicate(t, r2, r1.Addr(), r1)
	front := testutil.StartFaultProxy(t, m.Addr()) // the service address
	pg := testutil.Postgres(t)
	const prefix = "lf"
	p := startTestProxy(t, false, func(c *Config) {
		c.RedisURL, c.DatabaseURL, c.Prefix = "redis://"+front.Addr()+"/0", pg.URL, prefix
		// Keys are looked up once (warm-up), and a reserve may take 5 s: this test is about the
		// failover, not about a loaded machine's Postgres look-ups or round trips.
		c.KeyCacheTTL = 10 * time.Minute
		c.ReserveTimeout = 5 * time.Second
		// A hold whose reserve R1 got but whose release only M saw (a reserve replicated just
		// before the hold-back whose WAIT then timed out: 503, released on M) is the reaper's:
		// short expiries, so that it is freed within the test (the grace stays above the
		// record timeout, as DESIGN's reaper rule asks).
		c.HoldTTL, c.RecordTimeout, c.ReapGrace, c.ReapInterval = 3*time.Second, 10*time.Second, 12*time.Second, 500*time.Millisecond
		if wait {
			c.RedisWaitReplicas, c.RedisWaitTimeout = 1, lfWaitTimeout
		}
	})

	var orgs []string
	funds := map[string]int64{}
	keys := map[string]string{}
	poor := map[string]bool{}
	for i := range lfRich + lfPoor {
		org := fmt.Sprintf("lf-r%d", i)
		funds[org] = lfRichFunds
		if i >= lfRich {
			org = fmt.Sprintf("lf-p%d", i-lfRich)
			funds[org], poor[org] = lfPoorFunds, true
		}
		orgs = append(orgs, org)
		if i == 0 {
			keys[org] = p.setup(org, funds[org], lfHold)
			continue
		}
		p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
		p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds[org], "reference": "init-" + org}, http.StatusCreated, nil)
		var k struct{ Key string }
		p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
		keys[org] = k.Key
	}
	warm := map[string]string{} // org → the warm-up request's id
	for _, org := range orgs {
		// With WAIT, a replica slow to acknowledge on a loaded machine is a 503: try again.
		lfWait(t, "warm-up of "+org, func() bool {
			st, h, b := p.do("POST", "/v1/chat/completions", keys[org], chat("hello"))
			if st != http.StatusOK && st != http.StatusServiceUnavailable {
				t.Fatalf("warm-up of %s: %d %s", org, st, b)
			}
			warm[org] = h.Get("x-request-id")
			return st == http.StatusOK
		})
	}
	// Everything so far is on R1 (and R2): a write and a WAIT on one connection of M.
	pipe := m.Client().Pipeline()
	pipe.Set(ctx, "lf-sync", "1", 0)
	acked := pipe.Do(ctx, "wait", 1, 30_000)
	if _, err := pipe.Exec(ctx); err != nil || acked.Val() != int64(1) {
		t.Fatalf("replication before the load: WAIT %v %v", acked.Val(), err)
	}

	// The load.
	load := &lfLoad{}
	client := &http.Client{Timeout: time.Minute}
	stop, poorGo := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	body := `{"model":"m","messages":[{"role":"user","content":"hello"}]}`
	for _, org := range orgs {
		for range lfClients {
			wg.Go(func() {
				if poor[org] {
					select {
					case <-poorGo:
					case <-stop:
						return
					}
				}
				for {
					select {
					case <-stop:
						return
					default:
					}
					r := lfResult{org: org, start: time.Now()}
					req, _ := http.NewRequest("POST", p.base+"/v1/chat/completions", strings.NewReader(body))
					req.Header.Set("Authorization", "Bearer "+keys[org])
					req.Header.Set("Content-Type", "application/json")
					resp, err := client.Do(req)
					if err == nil {
						b, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						r.status, r.id = resp.StatusCode, resp.Header.Get("x-request-id")
						if r.status != http.StatusOK {
							var e struct{ Error struct{ Code string } }
							_ = json.Unmarshal(b, &e)
							r.code = e.Error.Code
						}
					} else {
						r.code = err.Error()
					}
					r.end = time.Now()
					load.add(r)
					time.Sleep(lfPause)
				}
			})
		}
	}
	defer func() { // on a failure too
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	lfWait(t, "100 requests served before the hold-back", func() bool {
		return load.count(func(r lfResult) bool { return r.status == http.StatusOK }) >= 100
	})
	hangAt := time.Now()
	link.Hang() // from here on, nothing M writes reaches R1
	close(poorGo)
	after := func(at time.Time, org func(string) bool, match func(r lfResult) bool) func() bool {
		return func() bool {
			return load.count(func(r lfResult) bool { return r.start.After(at) && org(r.org) && match(r) }) > 0
		}
	}
	isRich := func(o string) bool { return !poor[o] }
	for org := range poor {
		is := func(o string) bool { return o == org }
		if wait {
			lfWait(t, org+" refused while replication is held back", after(hangAt, is, func(r lfResult) bool { return r.status == http.StatusServiceUnavailable }))
		} else {
			lfWait(t, org+" spent everything on the master", after(hangAt, is, func(r lfResult) bool { return r.status == http.StatusTooManyRequests }))
		}
	}
	lfWait(t, "the rich orgs' requests during the hold-back", func() bool {
		return load.count(func(r lfResult) bool { return r.start.After(hangAt) && isRich(r.org) && r.end.After(r.start) }) >= lfRichAfterHang
	})

	// The failover: M dies with what it did not replicate, R1 takes over.
	killedAt := time.Now()
	m.Kill()
	link.Cut() // what the link held back is gone with M (the link stays hung: R1 reconnects to nothing)
	if err := r1.Client().ReplicaOf(ctx, "NO", "ONE").Err(); err != nil {
		t.Fatal(err)
	}
	lfWait(t, "R1 promoted", func() bool {
		role, err := r1.Client().Do(ctx, "ROLE").Slice()
		return err == nil && len(role) > 0 && role[0] == "master"
	})
	promotedAt := time.Now()
	// What R1 knows of each org's holds: held, or ended (tombstone).
	known := map[string]map[string]bool{}
	for _, org := range orgs {
		k := balance.KeysOf(prefix, org)
		held, err := r1.Client().HKeys(ctx, k.Holds).Result()
		if err != nil {
			t.Fatal(err)
		}
		gone, err := r1.Client().ZRange(ctx, k.Gone, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		known[org] = map[string]bool{}
		for _, id := range append(held, gone...) {
			known[org][id] = true
		}
	}
	retargetAt := time.Now()
	front.SetTarget(r1.Addr())
	front.Cut()

	for _, org := range orgs {
		is := func(o string) bool { return o == org }
		if poor[org] {
			// Served by R1 until it knows the money is gone, or refused at once when a settle of
			// a request in flight at the kill brought the lost charges in first.
			lfWait(t, org+" refused by R1", after(retargetAt, is, func(r lfResult) bool { return r.status == http.StatusTooManyRequests }))
			continue
		}
		lfWait(t, org+" served by R1", after(retargetAt, is, func(r lfResult) bool { return r.status == http.StatusOK }))
	}
	close(stop)
	wg.Wait()
	// Holds on R1 now that belong to no request served: reserves refused after they were
	// written (the reaper frees them).
	reaped := map[string][]string{}
	for _, org := range orgs {
		held, err := r1.Client().HKeys(ctx, balance.KeysOf(prefix, org).Holds).Result()
		if err != nil {
			t.Fatal(err)
		}
		reaped[org] = held
	}

	// What the clients saw.
	load.mu.Lock()
	results := load.results
	load.mu.Unlock()
	ok := map[string]map[string]bool{}
	for _, org := range orgs {
		ok[org] = map[string]bool{warm[org]: true}
	}
	statuses := map[string]int{}
	var firstOK time.Time
	unavailable, refusedHeld := 0, 0
	for _, r := range results {
		statuses[strconv.Itoa(r.status)+" "+r.code]++
		switch {
		case r.status == http.StatusOK:
			if r.id == "" || ok[r.org][r.id] {
				t.Fatalf("a 200 of %s with request id %q (empty or seen before)", r.org, r.id)
			}
			ok[r.org][r.id] = true
			if r.start.After(killedAt) && (firstOK.IsZero() || r.end.Before(firstOK)) {
				firstOK = r.end
			}
		case r.status == http.StatusServiceUnavailable:
			unavailable++
			if r.start.After(hangAt) && r.end.Before(killedAt) {
				refusedHeld++
			}
		}
	}

	// Money, at rest, per org.
	lost, lostHeld, maxDebt, reapedHolds := 0, int64(0), int64(0), 0
	for _, org := range orgs {
		var b balanceView
		lfWait(t, org+" at rest, Redis equal to the ledger", func() bool { // through settles and the reaper
			b = p.balance(org)
			acct, err := p.app.ledger.Account(ctx, org)
			return err == nil && b.Holds == 0 && acct.Pending == 0 && acct.SettledSeq == acct.LedgerSeq && b.Available == b.LedgerBalance
		})
		rows, err := pg.Pool.Query(ctx, "SELECT id::text, cost, hold_amount, reserved_at FROM usage_events WHERE org_id = $1", org)
		if err != nil {
			t.Fatal(err)
		}
		var sum, orgLostHeld int64
		billed := map[string]bool{}
		orgLost := 0
		cut := retargetAt.Truncate(time.Millisecond)
		for rows.Next() {
			var id string
			var cost, hold int64
			var at time.Time
			if err := rows.Scan(&id, &cost, &hold, &at); err != nil {
				t.Fatal(err)
			}
			billed[id] = true
			sum += cost
			if !ok[org][id] {
				t.Errorf("%s: request %s billed %d without a 200", org, id, cost)
			}
			if cost != lfCost {
				t.Errorf("%s: request %s billed %d, want %d", org, id, cost, lfCost)
			}
			// Reserved on M (R1 was out of the proxy's reach until cut), and unknown to R1.
			if at.Before(cut) && !known[org][id] {
				orgLost++
				orgLostHeld += hold
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		for _, id := range reaped[org] {
			if !billed[id] {
				reapedHolds++
			}
		}
		for id := range ok[org] {
			if !billed[id] {
				t.Errorf("%s: request %s got a 200 and was not billed", org, id)
			}
		}
		var entries int64
		if err := pg.Pool.QueryRow(ctx, "SELECT coalesce(sum(delta), 0) FROM ledger_entries WHERE org_id = $1", org).Scan(&entries); err != nil {
			t.Fatal(err)
		}
		want := funds[org] - int64(len(ok[org]))*lfCost
		if sum != int64(len(ok[org]))*lfCost || b.LedgerBalance != want || entries != want {
			t.Errorf("%s: %d 200s, billed %d, ledger balance %d, entries sum %d; want %d", org, len(ok[org]), sum, b.LedgerBalance, entries, want)
		}
		debt := max(0, -b.LedgerBalance)
		if debt > orgLostHeld {
			t.Errorf("%s: debt %d above the holds the failover lost (%d: %d holds)", org, debt, orgLostHeld, orgLost)
		}
		lost += orgLost
		lostHeld += orgLostHeld
		maxDebt = max(maxDebt, debt)
		if orgLost > 0 || debt > 0 || poor[org] {
			t.Logf("%s: %d 200s, %d holds lost (%d held), ledger balance %d", org, len(ok[org]), orgLost, orgLostHeld, b.LedgerBalance)
		}
	}

	keysOf := make([]string, 0, len(statuses))
	for k := range statuses {
		keysOf = append(keysOf, k)
	}
	sort.Strings(keysOf)
	var st []string
	for _, k := range keysOf {
		st = append(st, fmt.Sprintf("%s: %d", k, statuses[k]))
	}
	t.Logf("WAIT %v: %d requests (%s); hold-back %v, promotion %v after the kill, service address moved %v after it",
		wait, len(results), strings.Join(st, ", "), killedAt.Sub(hangAt).Round(time.Millisecond),
		promotedAt.Sub(killedAt).Round(time.Millisecond), retargetAt.Sub(killedAt).Round(time.Millisecond))
	t.Logf("WAIT %v: 503s %d (%d during the hold-back); first 200 %v after the kill; holds lost %d (%d micro-units held); largest debt %d; holds left for the reaper %d",
		wait, unavailable, refusedHeld, firstOK.Sub(killedAt).Round(time.Millisecond), lost, lostHeld, maxDebt, reapedHolds)
	if wait {
		if lost != 0 || maxDebt != 0 {
			t.Errorf("with WAIT: %d holds lost, debt %d; want none", lost, maxDebt)
		}
		if refusedHeld == 0 {
			t.Error("with WAIT: no reserve refused while replication was held back")
		}
		_, _, metrics := p.do("GET", "/metrics", "", nil)
		if strings.Contains(string(metrics), "escrow_redis_wait_short_total 0\n") || !strings.Contains(string(metrics), "escrow_redis_wait_short_total ") {
			t.Error("with WAIT: escrow_redis_wait_short_total did not count the WAITs the replica never answered")
		}
	} else if lost == 0 {
		t.Error("without WAIT the failover lost no hold: the test did not hold replication back")
	}
}

// TestWaitReplicasConfig: ESCROW_REDIS_WAIT_REPLICAS and ESCROW_REDIS_WAIT_TIMEOUT are read
// into the configuration, and refused with the embedded Redis (no replica to wait for: every
// reserve would be refused).
func TestWaitReplicasConfig(t *testing.T) {
	t.Parallel()
	env := map[string]string{"REDIS_URL": "redis://127.0.0.1:1/0", "DATABASE_URL": "postgres://x@127.0.0.1:1/x",
		"ESCROW_REDIS_WAIT_REPLICAS": "2", "ESCROW_REDIS_WAIT_TIMEOUT": "250ms"}
	c, err := LoadConfig("t", nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil || c.RedisWaitReplicas != 2 || c.RedisWaitTimeout != 250*time.Millisecond {
		t.Fatalf("LoadConfig: %v %+v", err, c)
	}
	delete(env, "REDIS_URL")
	delete(env, "DATABASE_URL")
	if _, err := LoadConfig("t", nil, func(k string) string { return env[k] }, io.Discard); err == nil || !strings.Contains(err.Error(), "ESCROW_REDIS_WAIT_REPLICAS") {
		t.Fatalf("LoadConfig with the embedded Redis and WAIT: %v, want a refusal naming ESCROW_REDIS_WAIT_REPLICAS", err)
	}
}
