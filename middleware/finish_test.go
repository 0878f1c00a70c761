package middleware

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// finishEnv is the middleware harness with a per-org cap of capN, an *accounting.Recorder that
// finishes holds (as the proxy wires it), no worker (no hold is ever settled), and outcomes
// counted instead of queued.
func finishEnv(t *testing.T, capN int, finisher bool) (*testEnv, *accounting.Recorder, *sync.Map) {
	t.Helper()
	var rec *accounting.Recorder
	var outcomes sync.Map // code or kind → *atomic.Int64
	e := newEnv(t, envOpt{
		storeCfg: func(c *balance.Config) { c.MaxInFlight = capN },
		cfg: func(c *Config) {
			rc := accounting.RecorderConfig{Logger: quiet}
			if finisher {
				rc.Finisher = c.Store.(*balance.Store)
			}
			var err error
			rec, err = accounting.NewRecorder(c.Ledger.(*memledger.Ledger), &rc)
			must(t, err)
			rec.Start(context.Background())
			t.Cleanup(func() { _ = rec.Stop(context.Background()) })
			c.Recorder = rec
			c.OnOutcome = func(o Outcome) {
				k := string(o.Kind)
				if o.Code != "" {
					k = o.Code
				}
				v, _ := outcomes.LoadOrStore(k, new(atomic.Int64))
				v.(*atomic.Int64).Add(1)
			}
		},
	})
	// Warm before any request: a warm that ran while the burst's first usage was recorded
	// would account it (the snapshot accounts pending usage) and settle its hold, which these
	// tests, with no worker, count as never happening.
	must(t, e.store.Warm(context.Background(), e.org))
	return e, rec, &outcomes
}

func count(m *sync.Map, k string) int64 {
	if v, ok := m.Load(k); ok {
		return v.(*atomic.Int64).Load()
	}
	return 0
}

// hammer sends n chat requests from clients goroutines, never more than inFlight at once (a
// semaphore), and returns the status counts. A count, not a duration: how many requests a
// second brings depends on the machine's speed.
func hammer(t *testing.T, e *testEnv, clients, inFlight int, n int64) map[int]int64 {
	t.Helper()
	sem := make(chan struct{}, inFlight)
	var left atomic.Int64
	left.Store(n)
	var mu sync.Mutex
	statuses := map[int]int64{}
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				sem <- struct{}{}
				resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				<-sem
				mu.Lock()
				statuses[resp.StatusCode]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return statuses
}

// TestNoFalseTooManyAtFullSpeed (issue 12): one org at full speed with a fast upstream and a
// small cap gets no rate_limit_exceeded as long as no more than the cap are really in flight,
// although no worker settles anything: each hold is finished (out of the in-flight count) in the
// recorder's batch, before the response's last bytes. Without the finish (the control run) the
// same load is refused as soon as the cap's worth of requests have ended.
func TestNoFalseTooManyAtFullSpeed(t *testing.T) {
	t.Parallel()
	const capN = 8
	e, rec, outcomes := finishEnv(t, capN, true)
	statuses := hammer(t, e, 3*capN, capN, 8*capN)
	total := statuses[http.StatusOK] + statuses[http.StatusTooManyRequests]
	t.Logf("statuses %v; recorder %+v", statuses, rec.Stats())
	if n := count(outcomes, CodeRateLimit); n != 0 || statuses[http.StatusTooManyRequests] != 0 {
		t.Fatalf("%d false rate_limit_exceeded (%v) with at most %d in flight", n, statuses, capN)
	}
	if statuses[http.StatusOK] != 8*capN || total != statuses[http.StatusOK] {
		t.Fatalf("statuses %v: want only 200s, for the cap several times over", statuses)
	}
	st := e.state()
	if st.InFlight() != 0 || int64(st.Finished) != statuses[http.StatusOK] || rec.Stats().Finished != statuses[http.StatusOK] {
		t.Fatalf("hot balance %+v after %d requests; recorder %+v", st, statuses[http.StatusOK], rec.Stats())
	}
	// The unused part of every hold is back before any settle: bal = credit − Σ costs.
	evCost := cost(t, chatUsage)
	if want := testCredit - statuses[http.StatusOK]*evCost; st.Balance != want || st.Held != statuses[http.StatusOK]*evCost {
		t.Fatalf("hot balance %+v, want available %d", st, want)
	}

	// Control: the same load without finish meets the cap at once.
	c, _, _ := finishEnv(t, capN, false)
	ctl := hammer(t, c, 3*capN, capN, 3*capN)
	if ctl[http.StatusOK] != capN || ctl[http.StatusTooManyRequests] != 2*capN {
		t.Fatalf("control without finish: %v, want %d 200s then only 429s", ctl, capN)
	}
}

// TestCapRefusesWhenReallyInFlight: with a slow upstream, 2×cap concurrent requests are really
// in flight together: exactly cap pass and the rest get 429 rate_limit_exceeded, finish or not.
func TestCapRefusesWhenReallyInFlight(t *testing.T) {
	t.Parallel()
	const capN = 8
	e, rec, outcomes := finishEnv(t, capN, true)
	release := make(chan struct{})
	var arrived atomic.Int64
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		arrived.Add(1)
		<-release
		fakeOpenAI(w, r, body)
	})
	var wg sync.WaitGroup
	codes := make([]int, 2*capN)
	for i := range codes {
		wg.Go(func() {
			resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes[i] = resp.StatusCode
		})
	}
	deadline := time.Now().Add(hangLimit)
	for count(outcomes, CodeRateLimit) < capN || arrived.Load() < capN {
		if time.Now().After(deadline) {
			t.Fatalf("%d upstream calls, %d refused", arrived.Load(), count(outcomes, CodeRateLimit))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if st := e.state(); st.InFlight() != capN || st.Finished != 0 {
		t.Fatalf("while %d are in flight: %+v", capN, st)
	}
	close(release)
	wg.Wait()
	got := map[int]int{}
	for _, c := range codes {
		got[c]++
	}
	if got[http.StatusOK] != capN || got[http.StatusTooManyRequests] != capN || arrived.Load() != capN {
		t.Fatalf("statuses %v, %d upstream calls; want %d of each", got, arrived.Load(), capN)
	}
	if st := e.state(); st.InFlight() != 0 || st.Finished != capN || rec.Stats().Finished != capN {
		t.Fatalf("after the requests: %+v", st)
	}
}
