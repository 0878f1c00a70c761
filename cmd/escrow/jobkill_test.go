//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
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

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
)

// The SIGKILL test's knobs. A job's lease is short so the takeover comes quickly; the poller
// bounds a poll at half the lease, so a poll that hangs upstream holds its lease that long.
const (
	killJobs       = 20 // background responses
	killBatches    = 2  // OpenAI batches of killBatchLines lines, one of which fails
	killBatchLines = 4
	killLease      = 4 * time.Second
	killFunds      = 10_000_000
	killWait       = 90 * time.Second // generous: every wait below ends on its condition
	killOrg        = "acme"
	killOutWord    = 2 // micro-units per output token; 1 per input token (cached or not)
)

// gatedUpstream is the fake upstream behind a gate: background responses are created and
// batches run at once, but every poll of one (GET /v1/responses/{id}, GET /v1/batches/{id})
// hangs until the test opens the gate (or the caller goes away), so no proxy sees a job end
// before that. After release everything passes. url serves through the gate, direct without.
type gatedUpstream struct {
	fake   http.Handler
	open   chan struct{}
	once   sync.Once
	polls  atomic.Int64 // polls that reached the gate
	url    string       // the gate
	direct string       // the fake itself, ungated
}

func startGatedUpstream(t *testing.T) *gatedUpstream {
	t.Helper()
	g := &gatedUpstream{
		fake: fakeupstream.New(fakeupstream.Options{KeepRequests: -1, BackgroundDelay: 100 * time.Millisecond,
			BatchLineDelay: time.Millisecond}),
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
	g.direct, g.url = serve(g.fake), serve(g)
	return g
}

func (g *gatedUpstream) release() { g.once.Do(func() { close(g.open) }) }

func (g *gatedUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rest, isPoll := strings.CutPrefix(r.URL.Path, "/v1/responses/")
	if !isPoll {
		rest, isPoll = strings.CutPrefix(r.URL.Path, "/v1/batches/")
	}
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
// background responses and 2 batches for an org and is SIGKILLed while its poller holds the
// leases of all of them (its polls hang at the upstream); proxy B (another child, same Redis
// prefix and Postgres schema) takes every job over once A's leases run out and, when the
// upstream lets the jobs end, settles each:
// charged exactly once (one ledger charge per hold id: a response's, a batch line's) at the usage
// the upstream reports (a batch line that failed: nothing), no hold
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
	dir := t.TempDir()
	proxy := func(name string) *proxyProc {
		p := &proxyProc{t: t, bin: bin, log: filepath.Join(dir, name+".log"), addr: freeAddr(t)}
		p.env = append(os.Environ(),
			"ESCROW_ADDR="+p.addr,
			"REDIS_URL="+rdb.URL,
			"ESCROW_PREFIX="+rdb.Prefix,
			"DATABASE_URL="+pg.URL,
			"UPSTREAM_URL="+up.url,
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

	// Two batches through A (model bm: input 2, output 4 per token live, half that in a batch),
	// each with a line the upstream fails (it costs nothing).
	must(chaosAdmin(base, "PUT", "/models/bm", map[string]any{"input_price": 2_000_000, "output_price": 4_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 100, "default_hold": 100}))
	batchIDs := make([]string, killBatches)
	for i := range batchIDs {
		var lines []string
		for l := range killBatchLines {
			text := strings.TrimSpace(strings.Repeat("word ", 1+l))
			if l == 1 {
				text += " [fail]"
			}
			b, _ := json.Marshal(map[string]any{"custom_id": fmt.Sprintf("b%d-l%d", i, l), "method": "POST", "url": "/v1/chat/completions",
				"body": map[string]any{"model": "bm", "max_tokens": 3 + 2*l + i, "messages": []map[string]string{{"role": "user", "content": text}}}})
			lines = append(lines, string(b))
		}
		batchIDs[i] = createBatch(t, base, k.Key, lines)
	}
	const liveJobs = killJobs + killBatches

	// Wait until A's poller holds a lease on every job at once (its polls hang at the gate), then
	// SIGKILL it: nothing is given back, each lease stays taken until it runs out.
	db := pg.Pool
	waitFor(t, "proxy A to hold a lease on every job", func() (bool, string) {
		var total, leased, owners int
		err := db.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE lease_until > now()),
			count(DISTINCT lease_owner) FILTER (WHERE lease_until > now()) FROM jobs WHERE settled_at IS NULL`).Scan(&total, &leased, &owners)
		return err == nil && total == liveJobs && leased == liveJobs && owners == 1,
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
	t.Logf("proxy A SIGKILLed holding the leases of %d of %d jobs (owner %s); %d polls reached the upstream", leasedAtKill, liveJobs, deadOwner, up.polls.Load())

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

	// The jobs as the ledger ended them, by upstream id.
	type jobRow struct {
		id, status string
		cost       int64
	}
	jobs := map[string]jobRow{}
	rows, err := db.Query(ctx, `SELECT id::text, upstream_id, status, cost FROM jobs WHERE org_id = $1`, killOrg)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var j jobRow
		var upID string
		if err := rows.Scan(&j.id, &upID, &j.status, &j.cost); err != nil {
			t.Fatal(err)
		}
		jobs[upID] = j
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(jobs) != liveJobs {
		t.Fatalf("%d jobs recorded, want %d", len(jobs), liveJobs)
	}

	// What the upstream billed, asked of the fake directly: a background response its usage,
	// priced 1 per input token and 2 per output; a batch each line of its output file, at the
	// batch price (half of bm's: 1 and 2). wantHold is the charge each hold id should carry: a
	// response's hold id its cost; a batch line's event id (derived from the job's and the line's
	// custom id) the line's cost; a batch's own id 0 (its closing event gives the hold back).
	wantJob, wantHold := map[string]int64{}, map[string]int64{}
	var totalBilled int64
	for _, id := range upstreamIDs {
		var r struct {
			Status string
			Usage  *fakeupstream.ResponsesUsage
		}
		if err := getJSON(up.direct+"/v1/responses/"+url.PathEscape(id), &r); err != nil || r.Status != "completed" || r.Usage == nil {
			t.Fatalf("upstream response %s: %v %+v", id, err, r)
		}
		cost := int64(r.Usage.InputTokens + killOutWord*r.Usage.OutputTokens)
		wantJob[id], wantHold[jobs[id].id] = cost, cost
		totalBilled += cost
	}
	batchLines := 0
	for _, id := range batchIDs {
		var bt struct {
			Status       string
			OutputFileID string `json:"output_file_id"`
		}
		if err := getJSON(up.direct+"/v1/batches/"+url.PathEscape(id), &bt); err != nil || bt.Status != "completed" || bt.OutputFileID == "" {
			t.Fatalf("upstream batch %s: %v %+v", id, err, bt)
		}
		resp, err := http.Get(up.direct + "/v1/files/" + url.PathEscape(bt.OutputFileID) + "/content")
		if err != nil {
			t.Fatal(err)
		}
		dec := json.NewDecoder(resp.Body)
		jobID := jobs[id].id
		wantHold[jobID] = 0
		for dec.More() {
			var ln struct {
				CustomID string `json:"custom_id"`
				Response struct {
					Body struct {
						Usage struct {
							Prompt     int64 `json:"prompt_tokens"`
							Completion int64 `json:"completion_tokens"`
						}
					}
				}
			}
			if err := dec.Decode(&ln); err != nil {
				t.Fatalf("batch %s output: %v", id, err)
			}
			cost := ln.Response.Body.Usage.Prompt + 2*ln.Response.Body.Usage.Completion
			wantHold[uuid.NewSHA1(uuid.MustParse(jobID), []byte(ln.CustomID)).String()] = cost
			wantJob[id] += cost
			totalBilled += cost
			batchLines++
		}
		resp.Body.Close()
	}
	if batchLines != killBatches*(killBatchLines-1) {
		t.Fatalf("the upstream ran %d batch lines, want %d (one of each batch's fails)", batchLines, killBatches*(killBatchLines-1))
	}

	// Each job ended completed at what the upstream billed; each hold id charged once, exactly.
	for upID, want := range wantJob {
		if j := jobs[upID]; j.status != "completed" || j.cost != want {
			t.Errorf("job %s (upstream %s): %s at %d, want completed at %d", j.id, upID, j.status, j.cost, want)
		}
	}
	rows, err = db.Query(ctx, `SELECT hold_id::text, count(*), sum(delta) FROM ledger_entries
		WHERE org_id = $1 AND kind = 'charge' GROUP BY hold_id`, killOrg)
	if err != nil {
		t.Fatal(err)
	}
	charged := map[string]bool{}
	for rows.Next() {
		var id string
		var n int
		var delta int64
		if err := rows.Scan(&id, &n, &delta); err != nil {
			t.Fatal(err)
		}
		charged[id] = true
		want, ok := wantHold[id]
		if !ok || n != 1 || -delta != want {
			t.Errorf("hold %s: %d charges totalling %d; want one of %d (expected: %v)", id, n, -delta, want, ok)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for id, want := range wantHold {
		if want != 0 && !charged[id] {
			t.Errorf("hold %s never charged (want %d)", id, want)
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
	t.Logf("%d background responses and %d batches (%d lines run) settled by proxy B, billed %d in all; ledger %d",
		killJobs, killBatches, batchLines, totalBilled, v.LedgerBalance)
}

// getJSON decodes the JSON answer of a GET of u into out.
func getJSON(u string, out any) error {
	resp, err := http.Get(u)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", u, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// createBatch uploads lines as a batch input file through the proxy at base and creates their
// batch; it returns the batch's id.
func createBatch(t *testing.T, base, key string, lines []string) string {
	t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("file", "input.jsonl")
	_, _ = io.WriteString(fw, strings.Join(lines, "\n")+"\n")
	_ = mw.WriteField("purpose", "batch")
	_ = mw.Close()
	post := func(path, contentType string, body io.Reader, out any) {
		t.Helper()
		req, _ := http.NewRequest("POST", base+path, body)
		req.Header.Set("Content-Type", contentType)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, out) != nil {
			t.Fatalf("POST %s: %d %s", path, resp.StatusCode, b)
		}
	}
	var f, bt struct{ ID string }
	post("/v1/files", mw.FormDataContentType(), &buf, &f)
	j, _ := json.Marshal(map[string]string{"input_file_id": f.ID, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
	post("/v1/batches", "application/json", bytes.NewReader(j), &bt)
	if bt.ID == "" {
		t.Fatal("batch created without an id")
	}
	return bt.ID
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
