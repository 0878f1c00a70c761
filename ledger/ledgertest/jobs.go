package ledgertest

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/pricing"
)

// jobTests run on every ledger: each must implement job.Store (DESIGN.md "Async work").
var jobTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"JobsCreate", testJobsCreate},
	{"JobsLease", testJobsLease},
	{"JobsClaimConcurrent", testJobsClaimConcurrent},
	{"JobsSettleOnce", testJobsSettleOnce},
	{"JobsSettleLines", testJobsSettleLines},
	{"JobsUnresolved", testJobsUnresolved},
}

func jobStore(t *testing.T, l ledger.Ledger) job.Store {
	t.Helper()
	s, ok := l.(job.Store)
	if !ok {
		t.Fatalf("%T does not implement job.Store", l)
	}
	return s
}

func newJob(org, upstream string) job.Job {
	return job.Job{ID: NewEventID(), Kind: job.BackgroundResponse, Org: org, KeyID: "key_1", Model: "gpt-test",
		Endpoint: "/v1/responses", UpstreamID: upstream, Hold: 5000, Estimate: 100, ReservedAt: t0,
		Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000}}
}

func testJobsCreate(t *testing.T, l ledger.Ledger) {
	c, s := ctx(t), jobStore(t, l)
	_, _, err := s.CreateJob(c, newJob("nobody", "resp_0"))
	wantErr(t, err, ledger.ErrUnknownOrg, "CreateJob of an unknown org")
	noErr(t, l.CreateOrg(c, "acme"))
	noErr(t, l.CreateOrg(c, "other"))
	for _, bad := range []func(*job.Job){
		func(j *job.Job) { j.ID = "not-a-uuid" },
		func(j *job.Job) { j.Kind = "cron" },
		func(j *job.Job) { j.UpstreamID = "" },
		func(j *job.Job) { j.Model = "" },
		func(j *job.Job) { j.Hold = -1 },
		func(j *job.Job) { j.Estimate = j.Hold + 1 },
		func(j *job.Job) { j.Data = []byte("{") },
	} {
		j := newJob("acme", "resp_bad")
		bad(&j)
		_, _, err := s.CreateJob(c, j)
		wantErr(t, err, job.ErrInvalid, "CreateJob of a bad job")
	}
	j := newJob("acme", "resp_1")
	j.Data = []byte(`{"input_file":"file_1"}`)
	j.Prices = pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000, pricing.CachedInput: 500_000}
	got, created, err := s.CreateJob(c, j)
	noErr(t, err)
	if !created || got.Status != job.Pending || !got.Live() || got.Attempts != 0 || got.CreatedAt.IsZero() ||
		got.NextPollAt.IsZero() || got.Hold != 5000 || got.Estimate != 100 || !got.ReservedAt.Equal(t0) ||
		!got.Prices.Equal(j.Prices) || !strings.Contains(string(got.Data), "file_1") || got.KeyID != "key_1" {
		t.Fatalf("created %+v (created %v)", got, created)
	}
	again, created, err := s.CreateJob(c, j)
	noErr(t, err)
	if created || again.ID != got.ID || !again.CreatedAt.Equal(got.CreatedAt) {
		t.Fatalf("created twice: %+v (created %v)", again, created)
	}
	dupUp := newJob("acme", "resp_1")
	_, _, err = s.CreateJob(c, dupUp)
	wantErr(t, err, job.ErrConflict, "another job with the same upstream id")
	dupID := newJob("acme", "resp_2")
	dupID.ID = j.ID
	_, _, err = s.CreateJob(c, dupID)
	wantErr(t, err, job.ErrConflict, "another job with the same id")
	batch := newJob("acme", "resp_1")
	batch.Kind = job.OpenAIBatch // another kind may share the upstream id
	mustJob(s.CreateJob(c, batch))
	theirs := newJob("other", "resp_3")
	mustJob(s.CreateJob(c, theirs))

	if r := must(s.Job(c, strings.ToUpper(j.ID))); r.ID != j.ID || r.UpstreamID != "resp_1" {
		t.Fatalf("Job = %+v", r)
	}
	_, err = s.Job(c, NewEventID())
	wantErr(t, err, job.ErrUnknownJob, "Job of an unknown id")
	_, err = s.Job(c, "junk")
	wantErr(t, err, job.ErrUnknownJob, "Job of a malformed id")
	if r := must(s.JobByUpstream(c, job.BackgroundResponse, "resp_3")); r.ID != theirs.ID || r.Org != "other" {
		t.Fatalf("JobByUpstream = %+v", r)
	}
	_, err = s.JobByUpstream(c, job.AnthropicBatch, "resp_1")
	wantErr(t, err, job.ErrUnknownJob, "JobByUpstream of another kind")
	if js := must(s.Jobs(c, job.Query{Org: "acme"})); len(js) != 2 || js[0].ID != batch.ID || js[1].ID != j.ID {
		t.Fatalf("Jobs(acme) = %+v", js)
	}
	if js := must(s.Jobs(c, job.Query{Kind: job.BackgroundResponse, Limit: 1})); len(js) != 1 || js[0].ID != theirs.ID {
		t.Fatalf("Jobs(kind, limit 1) = %+v", js)
	}
	if n := must(s.LiveJobs(c)); n[job.BackgroundResponse] != 2 || n[job.OpenAIBatch] != 1 {
		t.Fatalf("LiveJobs = %v", n)
	}
}

func mustJob(v job.Job, _ bool, err error) job.Job { return must(v, err) }

func testJobsLease(t *testing.T, l ledger.Ledger) {
	c, s := ctx(t), jobStore(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	j := mustJob(s.CreateJob(c, newJob("acme", "resp_1")))
	later := newJob("acme", "resp_later")
	later.NextPollAt = time.Now().Add(time.Hour)
	mustJob(s.CreateJob(c, later))
	b := newJob("acme", "batch_1")
	b.Kind = job.OpenAIBatch
	mustJob(s.CreateJob(c, b))

	// Only due jobs of the kinds asked for; one owner at a time.
	got := must(s.ClaimJobs(c, "a", []job.Kind{job.BackgroundResponse}, time.Hour, 10))
	if len(got) != 1 || got[0].ID != j.ID || got[0].LeaseOwner != "a" || !got[0].LeaseUntil.After(time.Now()) {
		t.Fatalf("claimed %+v", got)
	}
	if got := must(s.ClaimJobs(c, "b", []job.Kind{job.BackgroundResponse}, time.Hour, 10)); len(got) != 0 {
		t.Fatalf("a leased job claimed again: %+v", got)
	}
	if got := must(s.ClaimJobs(c, "b", nil, time.Hour, 10)); len(got) != 1 || got[0].ID != b.ID {
		t.Fatalf("claim of every kind: %+v", got)
	}
	// The holder records a poll: the lease is given back, the job due again later.
	_, err := s.RecordPoll(c, j.ID, "b", job.Progress{Status: job.Running})
	wantErr(t, err, job.ErrLeaseLost, "RecordPoll by another owner")
	_, err = s.RecordPoll(c, j.ID, "a", job.Progress{Status: job.Completed})
	wantErr(t, err, job.ErrInvalid, "RecordPoll of a terminal status")
	_, err = s.RecordPoll(c, NewEventID(), "a", job.Progress{Status: job.Running})
	wantErr(t, err, job.ErrUnknownJob, "RecordPoll of an unknown job")
	p := must(s.RecordPoll(c, j.ID, "a", job.Progress{Status: job.Running, Next: time.Hour}))
	if p.Status != job.Running || p.Attempts != 1 || !p.LeaseUntil.IsZero() || !p.NextPollAt.After(time.Now().Add(30*time.Minute)) {
		t.Fatalf("after a poll %+v", p)
	}
	if got := must(s.ClaimJobs(c, "b", nil, time.Hour, 10)); len(got) != 0 {
		t.Fatalf("a job claimed before it is due: %+v", got)
	}

	// A lease that runs out (its owner crashed) passes to another owner; the old one lost it.
	k := mustJob(s.CreateJob(c, newJob("acme", "resp_2")))
	if got := must(s.ClaimJobs(c, "a", []job.Kind{job.BackgroundResponse}, time.Millisecond, 10)); len(got) != 1 || got[0].ID != k.ID {
		t.Fatalf("claimed %+v", got)
	}
	var taken []job.Job
	waitFor(t, "the run-out lease to be claimed", func() bool {
		taken = must(s.ClaimJobs(c, "b", []job.Kind{job.BackgroundResponse}, time.Hour, 10))
		return len(taken) == 1
	})
	if taken[0].ID != k.ID || taken[0].LeaseOwner != "b" {
		t.Fatalf("taken over %+v", taken)
	}
	_, err = s.RecordPoll(c, k.ID, "a", job.Progress{Status: job.Running})
	wantErr(t, err, job.ErrLeaseLost, "RecordPoll by the owner whose lease ran out")
	must(s.RecordPoll(c, k.ID, "b", job.Progress{Status: job.Pending}))
	if _, err := s.ClaimJobs(c, "", nil, time.Hour, 1); err == nil {
		t.Fatal("ClaimJobs with no owner accepted")
	}
}

// waitFor polls cond until it holds, with a generous deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func testJobsClaimConcurrent(t *testing.T, l ledger.Ledger) {
	c, s := ctx(t), jobStore(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	const n = 40
	for i := range n {
		mustJob(s.CreateJob(c, newJob("acme", "resp_"+string(rune('a'+i%26))+strings.Repeat("x", i/26))))
	}
	var (
		mu    sync.Mutex
		seen  = map[string]string{}
		wg    sync.WaitGroup
		dupes atomic.Int32
	)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := string(rune('A' + w))
			for range 10 {
				got, err := s.ClaimJobs(c, owner, nil, time.Hour, 3)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, j := range got {
					if seen[j.ID] != "" {
						dupes.Add(1)
					}
					seen[j.ID] = owner
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if dupes.Load() != 0 || len(seen) != n {
		t.Fatalf("%d jobs claimed twice; %d of %d claimed", dupes.Load(), len(seen), n)
	}
}

func testJobsSettleOnce(t *testing.T, l ledger.Ledger) {
	c, s := ctx(t), jobStore(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	j := mustJob(s.CreateJob(c, newJob("acme", "resp_1")))
	// A live job's hold is busy for the reaper before any usage exists, like a pinned hold.
	if busy := must(l.UnsettledUsage(c, "acme", []string{j.ID})); !busy[j.ID] {
		t.Fatal("a live job's hold is not reported busy")
	}
	if busy := must(l.UnsettledUsage(c, "other", []string{j.ID})); busy[j.ID] {
		t.Fatal("a job's hold reported busy for another org")
	}
	_, _, err := s.SettleJob(c, j.ID, job.Settlement{Status: job.Running})
	wantErr(t, err, job.ErrInvalid, "SettleJob with a live status")
	_, _, err = s.SettleJob(c, NewEventID(), job.Settlement{Status: job.Completed})
	wantErr(t, err, job.ErrUnknownJob, "SettleJob of an unknown job")

	u := pricing.Usage{Prompt: 120, Completion: 80}
	var (
		wg    sync.WaitGroup
		first atomic.Int32
	)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Every path sees the same end, though some report a different cost: only the first counts.
			_, ok, err := s.SettleJob(c, j.ID, job.Settlement{Status: job.Completed, Lines: []job.Line{{Usage: u, Cost: 360 + int64(i%2)}}})
			if err != nil {
				t.Error(err)
			}
			if ok {
				first.Add(1)
			}
		}()
	}
	wg.Wait()
	if first.Load() != 1 {
		t.Fatalf("%d calls settled the job", first.Load())
	}
	got := must(s.Job(c, j.ID))
	if got.Live() || got.Status != job.Completed || (got.Cost != 360 && got.Cost != 361) || got.Usage.Prompt != 120 || got.LeaseOwner != "" {
		t.Fatalf("settled %+v", got)
	}
	// The job's own usage event carries its hold: the reaper still sees it busy until settled.
	if busy := must(l.UnsettledUsage(c, "acme", []string{j.ID})); !busy[j.ID] {
		t.Fatal("a settled job's pending usage is not reported busy")
	}
	must(l.AccountPending(c, 100))
	es := checkLedger(t, l, "acme")
	if len(es) != 1 || es[0].HoldID != j.ID || es[0].Delta != -got.Cost {
		t.Fatalf("entries %+v", es)
	}
	noErr(t, l.MarkSettled(c, "acme", 1))
	if busy := must(l.UnsettledUsage(c, "acme", []string{j.ID})); busy[j.ID] {
		t.Fatal("a settled job's hold still busy")
	}
	if n := must(s.LiveJobs(c)); n[job.BackgroundResponse] != 0 {
		t.Fatalf("LiveJobs after settle = %v", n)
	}
	// A poll after the end finds it settled.
	_, err = s.RecordPoll(c, j.ID, "a", job.Progress{Status: job.Running})
	wantErr(t, err, job.ErrLeaseLost, "RecordPoll of a settled job")
	if got := must(s.ClaimJobs(c, "a", nil, time.Hour, 10)); len(got) != 0 {
		t.Fatalf("a settled job claimed: %+v", got)
	}

	// Ending with nothing billed writes the job's event at cost 0: its settle gives the hold back.
	k := mustJob(s.CreateJob(c, newJob("acme", "resp_2")))
	mustJob(s.SettleJob(c, k.ID, job.Settlement{Status: job.Failed, Reason: "server_error"}))
	must(l.AccountPending(c, 100))
	es = checkLedger(t, l, "acme")
	if len(es) != 2 || es[1].HoldID != k.ID || es[1].Delta != 0 {
		t.Fatalf("entries after a failed job %+v", es)
	}
}

func testJobsSettleLines(t *testing.T, l ledger.Ledger) {
	c, s := ctx(t), jobStore(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	b := newJob("acme", "batch_1")
	b.Kind = job.OpenAIBatch
	b = mustJob(s.CreateJob(c, b))
	lines := []job.Line{
		{CustomID: "req-1", Usage: pricing.Usage{Prompt: 10, Completion: 5}, Cost: 20},
		{CustomID: "req-2", Usage: pricing.Usage{Prompt: 11, Completion: 6}, Cost: 22},
		{CustomID: "req-3", Model: "gpt-other", Usage: pricing.Usage{Prompt: 12, Completion: 7}, Cost: 26},
	}
	got, first, err := s.SettleJob(c, b.ID, job.Settlement{Status: job.Expired, Lines: lines})
	noErr(t, err)
	if !first || got.Cost != 68 || got.Usage.Prompt != 33 || got.Status != job.Expired {
		t.Fatalf("settled %+v (first %v)", got, first)
	}
	mustJob(s.SettleJob(c, b.ID, job.Settlement{Status: job.Completed, Lines: lines}))
	must(l.AccountPending(c, 100))
	es := checkLedger(t, l, "acme")
	var sum int64
	holds := 0
	for _, e := range es {
		sum += e.Delta
		if e.HoldID == b.ID {
			holds++
		}
	}
	// One event per line (ids derived from the job and the custom id), and the closing one
	// with the job's id that gives the hold back.
	if len(es) != 4 || sum != -68 || holds != 1 {
		t.Fatalf("entries %+v", es)
	}
	again := job.Events(got, job.Settlement{Status: job.Completed, Lines: lines}, time.Now())
	first2 := job.Events(got, job.Settlement{Status: job.Completed, Lines: lines}, time.Now())
	if len(again) != 4 || again[0].ID != first2[0].ID || again[0].ID == again[1].ID || again[3].ID != b.ID || again[2].Model != "gpt-other" {
		t.Fatalf("events %+v", again)
	}
}

func testJobsUnresolved(t *testing.T, l ledger.Ledger) {
	c, s, h := ctx(t), jobStore(t, l), hooks(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	_, _, err := h.CreateWebhook(c, "https://example.com/jobs", []ledger.EventType{ledger.EventJobUnresolved})
	noErr(t, err)
	ok := mustJob(s.CreateJob(c, newJob("acme", "resp_ok")))
	mustJob(s.SettleJob(c, ok.ID, job.Settlement{Status: job.Completed, Lines: []job.Line{{Cost: 1}}}))
	lost := mustJob(s.CreateJob(c, newJob("acme", "resp_lost")))
	got, first, err := s.SettleJob(c, lost.ID, job.Settlement{Status: job.Lost, Unresolved: true, Reason: "not found after it ended",
		Lines: []job.Line{{Cost: lost.Estimate, Estimated: true}}})
	noErr(t, err)
	if !first || !got.Unresolved || got.Cost != 100 || got.Status != job.Lost {
		t.Fatalf("unresolved %+v", got)
	}
	ds := must(h.ClaimDeliveries(c, 10, time.Minute, ledger.EndpointLimit{}))
	if len(ds) != 1 || ds[0].EventType != ledger.EventJobUnresolved || ds[0].Org != "acme" ||
		!strings.Contains(string(ds[0].Body), lost.ID) || !strings.Contains(string(ds[0].Body), "resp_lost") {
		t.Fatalf("job.unresolved deliveries %+v (%s)", ds, firstBody(ds))
	}
	mustJob(s.SettleJob(c, lost.ID, job.Settlement{Status: job.Lost, Unresolved: true}))
	if ds := must(h.ClaimDeliveries(c, 10, time.Minute, ledger.EndpointLimit{})); len(ds) != 0 {
		t.Fatalf("a second job.unresolved for one job: %+v", ds)
	}
	must(l.AccountPending(c, 100))
	if a := account(t, l, "acme"); a.Balance != -101 {
		t.Fatalf("balance %d, want -101", a.Balance)
	}
}
