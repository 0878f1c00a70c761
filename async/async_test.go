package async_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/async"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

// pins counts Pin calls per hold.
type pins struct {
	mu sync.Mutex
	n  map[string]int
}

func (p *pins) Pin(_ context.Context, _, id string) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[string]int{}
	}
	p.n[id]++
	return true, nil
}

func (p *pins) count(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n[id]
}

func newJob(org, upstream string) job.Job {
	return job.Job{ID: uuid.Must(uuid.NewV7()).String(), Kind: job.BackgroundResponse, Org: org, Model: "m",
		UpstreamID: upstream, Hold: 1000, Estimate: 50, Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 1_000_000}}
}

func fast(owner string) *async.Config {
	return &async.Config{Owner: owner, Lease: 200 * time.Millisecond, PollTimeout: 100 * time.Millisecond,
		Interval: 5 * time.Millisecond, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// upstream answers from a table: upstream id → the polls' answers in turn (the last repeats).
type upstream struct {
	mu      sync.Mutex
	answers map[string][]async.Observation
	polls   map[string]int
}

func (u *upstream) Poll(_ context.Context, j job.Job) (async.Observation, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.polls == nil {
		u.polls = map[string]int{}
	}
	as := u.answers[j.UpstreamID]
	i := min(u.polls[j.UpstreamID], len(as)-1)
	u.polls[j.UpstreamID]++
	if as[i].Reason == "error" {
		return async.Observation{}, errors.New("upstream down")
	}
	return as[i], nil
}

func TestPollerSettlesOnce(t *testing.T) {
	ctx := context.Background()
	l := memledger.New()
	if err := l.CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	h := &pins{}
	p, err := async.NewPoller(l, h, fast("a"))
	if err != nil {
		t.Fatal(err)
	}
	done := async.Observation{Status: job.Completed, Lines: []job.Line{{Usage: pricing.Usage{Prompt: 10, Completion: 20}, Cost: 30}}}
	up := &upstream{answers: map[string][]async.Observation{
		"resp_ok":   {{Status: job.Pending}, {Reason: "error"}, {Status: job.Running}, done},
		"resp_gone": {{Status: job.Running}, {Gone: true}},
	}}
	p.Handle(job.BackgroundResponse, up)
	ok, err := p.Begin(ctx, newJob("acme", "resp_ok"))
	if err != nil {
		t.Fatal(err)
	}
	gone, err := p.Begin(ctx, newJob("acme", "resp_gone"))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer p.Stop(ctx)
	waitFor(t, "both jobs settled", func() bool {
		n, _ := l.LiveJobs(ctx)
		return n[job.BackgroundResponse] == 0
	})
	got, _ := l.Job(ctx, ok.ID)
	if got.Status != job.Completed || got.Cost != 30 || got.Unresolved || got.Attempts != 3 {
		t.Fatalf("job %+v", got)
	}
	if h.count(ok.ID) < 4 { // at Begin and at every poll
		t.Fatalf("hold pinned %d times", h.count(ok.ID))
	}
	lost, _ := l.Job(ctx, gone.ID)
	if lost.Status != job.Lost || !lost.Unresolved || lost.Cost != 50 {
		t.Fatalf("lost job %+v", lost)
	}
	// The client's GET that saw the end after the poller: nothing more.
	if _, first, err := p.Observe(ctx, got, done); err != nil || first {
		t.Fatalf("Observe after settle: first %v, %v", first, err)
	}
	if _, err := l.AccountPending(ctx, 100); err != nil {
		t.Fatal(err)
	}
	a, _ := l.Account(ctx, "acme")
	if a.Balance != -80 {
		t.Fatalf("balance %d, want -80 (30 charged, 50 estimated)", a.Balance)
	}
	if s := p.Stats(); s.Settled != 2 || s.Unresolved != 1 || s.PollErrors != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// A poller that dies holding leases (its polls hang, then it stops without giving them back):
// another process's poller claims every job once the leases run out and settles each once.
func TestPollerTakesOverCrashedLeases(t *testing.T) {
	ctx := context.Background()
	l := memledger.New()
	if err := l.CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	hang := make(chan struct{})
	entered := make(chan struct{}, 100)
	a, _ := async.NewPoller(l, &pins{}, fast("a"))
	a.Handle(job.BackgroundResponse, async.UpstreamFunc(func(ctx context.Context, j job.Job) (async.Observation, error) {
		entered <- struct{}{}
		select {
		case <-hang:
		case <-ctx.Done():
		}
		return async.Observation{}, ctx.Err()
	}))
	const n = 6
	for i := range n {
		if _, err := a.Begin(ctx, newJob("acme", "resp_"+string(rune('a'+i)))); err != nil {
			t.Fatal(err)
		}
	}
	actx, cancel := context.WithCancel(ctx)
	if err := a.Start(actx); err != nil {
		t.Fatal(err)
	}
	<-entered
	cancel() // the process dies mid-poll
	_ = a.Stop(ctx)
	close(hang)

	b, _ := async.NewPoller(l, &pins{}, fast("b"))
	b.Handle(job.BackgroundResponse, async.UpstreamFunc(func(ctx context.Context, j job.Job) (async.Observation, error) {
		return async.Observation{Status: job.Completed, Lines: []job.Line{{Cost: 7}}}, nil
	}))
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer b.Stop(ctx)
	waitFor(t, "every job settled by the second poller", func() bool {
		c, _ := l.LiveJobs(ctx)
		return c[job.BackgroundResponse] == 0
	})
	if s := b.Stats(); s.Settled != n {
		t.Fatalf("second poller settled %d of %d", s.Settled, n)
	}
	if _, err := l.AccountPending(ctx, 100); err != nil {
		t.Fatal(err)
	}
	if acct, _ := l.Account(ctx, "acme"); acct.Balance != -7*n {
		t.Fatalf("balance %d, want %d", acct.Balance, -7*n)
	}
}

func TestPollerConfig(t *testing.T) {
	l := memledger.New()
	for _, c := range []async.Config{
		{MinBackoff: time.Minute, MaxBackoff: time.Second},
		{Lease: time.Second, PollTimeout: 2 * time.Second},
		{Lease: -1},
	} {
		if _, err := async.NewPoller(l, &pins{}, &c); !errors.Is(err, async.ErrConfig) {
			t.Fatalf("config %+v: err %v", c, err)
		}
	}
	p, err := async.NewPoller(l, &pins{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := p.Config()
	if c.Lease != async.DefaultLease || c.MaxBackoff != async.DefaultMaxBackoff || c.Owner == "" {
		t.Fatalf("defaults %+v", c)
	}
	for i := range 20 {
		if d := p.Backoff(i); d < c.MinBackoff*9/10 || d > c.MaxBackoff*11/10 {
			t.Fatalf("backoff(%d) = %v", i, d)
		}
	}
}
