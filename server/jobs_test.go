package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger/job"
)

// jobsUpstream is one fake upstream shared by every proxy of a test (the background responses
// live in it), and the tweak that points a proxy at it with a fast poller.
func jobsUpstream(t *testing.T, delay time.Duration) (*testUpstream, func(*Config)) {
	u := startTestUpstream(t, fakeupstream.Options{BackgroundDelay: delay}, false)
	return u, func(c *Config) {
		c.UpstreamURL, c.UpstreamAPIKey = u.url, "sk-up"
		c.JobMinBackoff, c.JobMaxBackoff = 20*time.Millisecond, 100*time.Millisecond
	}
}

// setupJobs prices model m at 1 micro-unit per input and per output token and makes an org
// with funds and a key.
func (p *testProxy) setupJobs(org string, funds int64) string {
	p.admin("PUT", "/models/m", map[string]any{"input_price": 1_000_000, "cached_input_price": 1_000_000, "output_price": 1_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 1000, "max_cost": 101_000, "default_hold": 101_000}, http.StatusOK, nil)
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	if funds > 0 {
		p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	}
	var k struct{ Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// startBackground creates a background response and returns its id.
func (p *testProxy) startBackground(key, input string, extra string) string {
	p.t.Helper()
	resp, body := p.send("/v1/responses", key, `{"model":"m","background":true,"input":"`+input+`"`+extra+`}`, nil)
	var r struct{ ID, Status string }
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &r) != nil || r.ID == "" || r.Status != "queued" {
		p.t.Fatalf("background create: %d %s", resp.StatusCode, body)
	}
	return r.ID
}

// jobsDone waits until the ledger has no live job.
func (p *testProxy) jobsDone() {
	p.t.Helper()
	js := p.app.ledger.(job.Store)
	deadline := time.Now().Add(60 * time.Second)
	for {
		n, err := js.LiveJobs(context.Background())
		if err == nil && n[job.BackgroundResponse] == 0 {
			return
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("jobs never ended: %v %v", n, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBackgroundResponses: background responses that complete, end incomplete, fail, are
// cancelled by the client and are lost by the upstream, each charged exactly once what the
// upstream billed (the lost one its estimate, flagged), nothing else held, and the ledger equal
// to the credit less those charges.
func TestBackgroundResponses(t *testing.T) {
	t.Parallel()
	u, tweak := jobsUpstream(t, 3*time.Second)
	p := startTestProxy(t, true, tweak)
	key := p.setupJobs("acme", 1_000_000)
	ids := map[string]string{
		"completed":  p.startBackground(key, "[hold] one two", ""),                         // 3 in + 20 out (runs until ended below)
		"incomplete": p.startBackground(key, "[incomplete] a b", `,"max_output_tokens":5`), // 3 + 5
		"failed":     p.startBackground(key, "[bgfail] x", ""),                             // 2 in only
		"cancelled":  p.startBackground(key, "[hold] cancel", ""),                          // 2 in only (runs until cancelled)
		"lost":       p.startBackground(key, "[lose] y", ""),                               // its estimate
	}
	want := map[string]int64{"completed": 23, "incomplete": 8, "failed": 2, "cancelled": 2}
	st, _, body := p.do("POST", "/v1/responses/"+ids["cancelled"]+"/cancel", key, nil)
	if st != http.StatusOK || !strings.Contains(string(body), `"cancelled"`) {
		t.Fatalf("cancel: %d %s", st, body)
	}
	// While they run, the org holds them (the completed one runs until it is ended here).
	if b := p.balance("acme"); b.Holds < 1 || b.Held <= 0 {
		t.Fatalf("while the jobs run: %+v", b)
	}
	if !u.fake.EndBackground(ids["completed"]) {
		t.Fatal("the completed response was not held in progress")
	}
	// The client reads one of them as it ends (either it or the poller settles it).
	waitUntil(t, "the completed response readable", func() bool {
		st, _, body := p.do("GET", "/v1/responses/"+ids["completed"], key, nil)
		return st == http.StatusOK && strings.Contains(string(body), `"completed"`)
	})
	p.jobsDone()
	b := p.settled("acme")
	js := p.app.ledger.(job.Store)
	var total int64
	for name, id := range ids {
		j, err := js.JobByUpstream(context.Background(), job.BackgroundResponse, id)
		if err != nil {
			t.Fatal(err)
		}
		if name == "lost" {
			if j.Status != job.Lost || !j.Unresolved || j.Cost != j.Estimate || j.Estimate <= 0 {
				t.Fatalf("lost job %+v", j)
			}
			total += j.Cost
			continue
		}
		if string(j.Status) != name || j.Cost != want[name] || j.Unresolved {
			t.Fatalf("%s job: status %s cost %d, want cost %d (%+v)", name, j.Status, j.Cost, want[name], j)
		}
		total += j.Cost
	}
	if b.LedgerBalance != 1_000_000-total || b.Available != b.LedgerBalance || b.Held != 0 {
		t.Fatalf("balance %+v, want ledger %d", b, 1_000_000-total)
	}
	es := ledgerCharges(t, p, "acme")
	if len(es) != len(ids) {
		t.Fatalf("%d charges for %d jobs: %+v", len(es), len(ids), es)
	}
	_, _, m := p.do("GET", "/metrics", "", nil)
	for _, want := range []string{`escrow_jobs_live{kind="background_response"} 0`, "escrow_jobs_unresolved_total 1", "escrow_job_polls_total"} {
		if !strings.Contains(string(m), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// ledgerCharges are the org's charge entries.
func ledgerCharges(t *testing.T, p *testProxy, org string) []int64 {
	t.Helper()
	es, _, err := p.app.ledger.EntriesAfter(context.Background(), org, 0, 10_000)
	if err != nil {
		t.Fatal(err)
	}
	var out []int64
	for _, e := range es {
		if e.Delta <= 0 && e.HoldID != "" {
			out = append(out, e.Delta)
		}
	}
	return out
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBackgroundResponseRoutesScopedToOrg: every route on a background response answers 404 to
// another org's key (and never reaches the upstream), and passes for the org that created it.
func TestBackgroundResponseRoutesScopedToOrg(t *testing.T) {
	t.Parallel()
	u, tweak := jobsUpstream(t, time.Hour)
	p := startTestProxy(t, true, tweak, func(c *Config) { c.JobMinBackoff, c.JobMaxBackoff = time.Hour, time.Hour })
	key := p.setupJobs("acme", 1_000_000)
	other := p.setupJobs2("other", 1_000_000)
	id := p.startBackground(key, "hello", "")
	js := p.app.ledger.(job.Store)
	waitUntil(t, "the poller's first poll (the next is an hour away)", func() bool {
		j, err := js.JobByUpstream(context.Background(), job.BackgroundResponse, id)
		return err == nil && j.Attempts == 1
	})
	routes := []struct{ name, method, path string }{
		{"get", "GET", "/v1/responses/" + id},
		{"input_items", "GET", "/v1/responses/" + id + "/input_items"},
		{"stream", "GET", "/v1/responses/" + id + "?stream=true&starting_after=0"},
		{"cancel", "POST", "/v1/responses/" + id + "/cancel"},
		{"delete", "DELETE", "/v1/responses/" + id},
	}
	for _, r := range routes {
		t.Run(r.name, func(t *testing.T) {
			before := u.fake.Requests()
			st, _, body := p.do(r.method, r.path, other, nil)
			if st != http.StatusNotFound || !strings.Contains(string(body), "No response found") || strings.Contains(string(body), "hello") {
				t.Fatalf("another org: %d %s", st, body)
			}
			if u.fake.Requests() != before {
				t.Fatal("another org's request reached the upstream")
			}
			st, _, body = p.do(r.method, "/v1/responses/resp_unknown", key, nil)
			if st != http.StatusNotFound {
				t.Fatalf("an id escrow did not start: %d %s", st, body)
			}
		})
	}
	// The customer's own list: the owner sees its job, the other org none.
	st, _, body := p.do("GET", "/v1/escrow/jobs", key, nil)
	if st != http.StatusOK || !strings.Contains(string(body), `"id":"`+id+`"`) || !strings.Contains(string(body), `"hold":`) {
		t.Fatalf("the owner's jobs: %d %s", st, body)
	}
	st, _, body = p.do("GET", "/v1/escrow/jobs", other, nil)
	if st != http.StatusOK || strings.Contains(string(body), id) {
		t.Fatalf("another org's jobs: %d %s", st, body)
	}
	// The owner passes.
	for _, r := range routes[:3] {
		st, _, body := p.do(r.method, r.path, key, nil)
		if st != http.StatusOK || !strings.Contains(string(body), id) && !strings.Contains(string(body), "hello") {
			t.Fatalf("owner %s: %d %s", r.name, st, body)
		}
	}
	st, _, body = p.do("DELETE", "/v1/responses/"+id, key, nil)
	if st != http.StatusBadRequest || !strings.Contains(string(body), "cancel it first") {
		t.Fatalf("owner deletes a running response: %d %s", st, body)
	}
	st, _, body = p.do("POST", "/v1/responses/"+id+"/cancel", key, nil)
	if st != http.StatusOK || !strings.Contains(string(body), "cancelled") {
		t.Fatalf("owner cancels: %d %s", st, body)
	}
	st, _, body = p.do("DELETE", "/v1/responses/"+id, key, nil)
	if st != http.StatusOK || !strings.Contains(string(body), "deleted") {
		t.Fatalf("owner deletes: %d %s", st, body)
	}
	p.jobsDone()
	p.settled("acme")
}

// setupJobs2 is setupJobs for a second org (the model exists).
func (p *testProxy) setupJobs2(org string, funds int64) string {
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	var k struct{ Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// TestBackgroundJobsSurviveAKilledProxy: proxy A starts 20 background responses and dies while
// its poller holds their leases (its polls hang upstream; it stops without giving anything
// back); proxy B, on the same Redis and Postgres, claims every job once A's leases run out and
// settles each once.
func TestBackgroundJobsSurviveAKilledProxy(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	up, tweak := jobsUpstream(t, 500*time.Millisecond)
	shared := func(c *Config) {
		c.RedisURL, c.DatabaseURL, c.Prefix = env.URL, pg.URL, env.Prefix
		c.JobLease = 2 * time.Second
	}
	// A's upstream: creates pass to the shared fake; its polls hang until A gives up.
	polled := make(chan struct{}, 100)
	hanging := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/v1/responses/") {
			polled <- struct{}{}
			<-r.Context().Done()
			return
		}
		up.ServeHTTP(w, r)
	}))
	t.Cleanup(hanging.Close)
	a := startTestProxy(t, false, tweak, shared, func(c *Config) { c.UpstreamURL, c.JobLease = hanging.URL, 6*time.Second })
	key := a.setupJobs("acme", 10_000_000)
	const n = 20
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.startBackground(key, fmt.Sprintf("job %d", i), "")
		}()
	}
	wg.Wait()
	<-polled // A's poller is in the middle of its polls, holding leases
	// A dies: its poller stops where it is; the leases it took stay taken until they run out.
	if err := a.app.poller.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	js := a.app.ledger.(job.Store)
	held, err := js.Jobs(context.Background(), job.Query{Live: true})
	if err != nil {
		t.Fatal(err)
	}
	leased := 0
	for _, j := range held {
		if j.LeaseOwner == a.app.poller.Config().Owner && j.LeaseUntil.After(time.Now()) {
			leased++
		}
	}
	if leased == 0 {
		t.Fatal("the dead proxy holds no lease: the takeover would not be tested")
	}
	b := startTestProxy(t, false, tweak, shared)
	b.jobsDone()
	bal := b.settled("acme")
	if bal.LedgerBalance != 10_000_000-n*22 || bal.Held != 0 { // 2 input + 20 output each
		t.Fatalf("after the takeover %+v, want ledger %d", bal, 10_000_000-n*22)
	}
	if es := ledgerCharges(t, b, "acme"); len(es) != n {
		t.Fatalf("%d charges for %d jobs", len(es), n)
	}
	if sa, sb := a.app.poller.Stats(), b.app.poller.Stats(); sa.Settled != 0 || sb.Settled != n {
		t.Fatalf("settled by the dead proxy %d, by the second %d, want 0 and %d", sa.Settled, sb.Settled, n)
	}
	t.Logf("%d of %d jobs were leased by the dead proxy and taken over after their leases ran out", leased, n)
}

// TestBackgroundResponseSettledByStream: a client that streams a background response after it
// ended (GET …?stream=true) sees its response.completed event, and that read settles the job
// (the poller's next poll is an hour away): charged once, exactly its usage. The upstream holds
// the response in progress until the poller's first poll is recorded, then ends it: at any
// speed, that poll saw it live.
func TestBackgroundResponseSettledByStream(t *testing.T) {
	t.Parallel()
	u, tweak := jobsUpstream(t, 300*time.Millisecond)
	p := startTestProxy(t, true, tweak, func(c *Config) { c.JobMinBackoff, c.JobMaxBackoff = time.Hour, time.Hour })
	key := p.setupJobs("acme", 1_000_000)
	id := p.startBackground(key, "[hold] me", "") // 2 input tokens, as any two words
	js := p.app.ledger.(job.Store)
	waitUntil(t, "the poller's first poll (the next is an hour away)", func() bool {
		j, err := js.JobByUpstream(context.Background(), job.BackgroundResponse, id)
		return err == nil && j.Attempts == 1
	})
	if !u.fake.EndBackground(id) {
		t.Fatal("the upstream's response was not held in progress")
	}
	waitUntil(t, "the stream to end with response.completed", func() bool {
		st, _, body := p.do("GET", "/v1/responses/"+id+"?stream=true&starting_after=0", key, nil)
		return st == http.StatusOK && strings.Contains(string(body), "response.completed") && !strings.Contains(string(body), "response.created")
	})
	p.jobsDone()
	b := p.settled("acme")
	if b.LedgerBalance != 1_000_000-22 { // 2 input + 20 output
		t.Fatalf("balance %+v, want %d", b, 1_000_000-22)
	}
	if s := p.app.poller.Stats(); s.Settled != 1 || s.Polls != 1 {
		t.Fatalf("poller stats %+v: the stream's read should have settled it", s)
	}
}
