package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// loadSpec is one load run against an HTTP endpoint.
type loadSpec struct {
	Name        string
	URL         string
	Keys        []string // API keys; request i uses Keys[i%len(Keys)] (many orgs, or one hot org)
	Body        []byte
	Concurrency int           // closed loop: this many clients back to back
	Rate        float64       // open loop: requests per second (0: closed loop)
	Duration    time.Duration // how long to send
	Warmup      time.Duration // sent and discarded before measuring
}

// loadResult is what a run measured.
type loadResult struct {
	Name                string
	Sent, OK, Non2xx    int64
	Errors              int64
	Status              map[int]int64
	Elapsed             time.Duration
	Throughput          float64 // successful requests per second
	P50, P90, P99, P999 time.Duration
	Max                 time.Duration

	ProxyCPU    time.Duration // CPU time of the proxy process during the run
	LoadCPU     time.Duration // CPU time of the load generator (this process) during the run
	MachineBusy float64       // share of all CPUs busy during the run (every process)
	RedisPerReq float64       // Redis commands the proxy sent per request
	RedisCmds   string        // the same, by command
}

func (r loadResult) String() string {
	return fmt.Sprintf("%-28s %9.0f req/s  p50 %8s  p99 %8s  ok %d  non-2xx %d  errors %d",
		r.Name, r.Throughput, r.P50.Round(time.Microsecond), r.P99.Round(time.Microsecond), r.OK, r.Non2xx, r.Errors)
}

// recorder collects latencies of successful requests; percentiles come from the sorted samples
// (exact, unlike bucketed histograms), which fits the few million samples a run takes.
type recorder struct {
	mu      sync.Mutex
	samples []time.Duration
	status  map[int]int64
	ok, bad atomic.Int64
	errs    atomic.Int64
	sent    atomic.Int64
}

func (r *recorder) add(d time.Duration, status int, err error) {
	r.sent.Add(1)
	if err != nil {
		r.errs.Add(1)
		return
	}
	r.mu.Lock()
	r.status[status]++
	if status/100 == 2 {
		r.samples = append(r.samples, d)
	}
	r.mu.Unlock()
	if status/100 == 2 {
		r.ok.Add(1)
	} else {
		r.bad.Add(1)
	}
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func newClient(conns int) *http.Client {
	tr := &http.Transport{MaxIdleConns: conns * 2, MaxIdleConnsPerHost: conns * 2, MaxConnsPerHost: 0, IdleConnTimeout: time.Minute}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

func doOne(ctx context.Context, c *http.Client, s *loadSpec, i int64) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL, bytes.NewReader(s.Body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	if len(s.Keys) > 0 {
		req.Header.Set("Authorization", "Bearer "+s.Keys[int(i)%len(s.Keys)])
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// runLoad runs s and prints a progress line every second to stderr.
func runLoad(ctx context.Context, s loadSpec) loadResult {
	conns := max(s.Concurrency, 1)
	c := newClient(conns)
	defer c.CloseIdleConnections()
	if s.Warmup > 0 {
		w := s
		w.Duration, w.Warmup = s.Warmup, 0
		w.Name = s.Name + " (warm-up)"
		measure(ctx, c, w, true)
	}
	return measure(ctx, c, s, false)
}

func measure(ctx context.Context, c *http.Client, s loadSpec, quiet bool) loadResult {
	rec := &recorder{status: map[int]int64{}}
	ctx, cancel := context.WithTimeout(ctx, s.Duration)
	defer cancel()
	start := time.Now()
	stopProgress := make(chan struct{})
	if !quiet {
		go progress(s.Name, rec, start, stopProgress)
	}
	var wg sync.WaitGroup
	var n atomic.Int64
	if s.Rate <= 0 { // closed loop
		for w := 0; w < max(s.Concurrency, 1); w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					i := n.Add(1)
					t0 := time.Now()
					st, err := doOne(context.Background(), c, &s, i)
					if ctx.Err() != nil && err == nil {
						// finished after the window: still counted
					}
					rec.add(time.Since(t0), st, err)
				}
			}()
		}
	} else { // open loop: latency from the intended send time, so stalls are not hidden
		interval := time.Duration(float64(time.Second) / s.Rate)
		sem := make(chan struct{}, max(s.Concurrency, 1024))
		next := time.Now()
		for ctx.Err() == nil {
			if d := time.Until(next); d > 0 {
				time.Sleep(d)
			}
			intended := next
			next = next.Add(interval)
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
			}
			if ctx.Err() != nil {
				break
			}
			wg.Add(1)
			i := n.Add(1)
			go func() {
				defer wg.Done()
				st, err := doOne(context.Background(), c, &s, i)
				rec.add(time.Since(intended), st, err)
				<-sem
			}()
		}
	}
	wg.Wait()
	close(stopProgress)
	el := time.Since(start)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	slices.Sort(rec.samples)
	r := loadResult{Name: s.Name, Sent: rec.sent.Load(), OK: rec.ok.Load(), Non2xx: rec.bad.Load(), Errors: rec.errs.Load(),
		Status: rec.status, Elapsed: el, Throughput: float64(rec.ok.Load()) / el.Seconds(),
		P50: percentile(rec.samples, 50), P90: percentile(rec.samples, 90), P99: percentile(rec.samples, 99),
		P999: percentile(rec.samples, 99.9)}
	if len(rec.samples) > 0 {
		r.Max = rec.samples[len(rec.samples)-1]
	}
	if !quiet {
		fmt.Fprintf(os.Stderr, "\r%-90s\r", "")
	}
	return r
}

func progress(name string, rec *recorder, start time.Time, stop <-chan struct{}) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			el := time.Since(start).Seconds()
			fmt.Fprintf(os.Stderr, "\r  %-28s %5.0fs  %8.0f req/s  ok %d  non-2xx %d  errors %d   ",
				name, el, float64(rec.ok.Load())/el, rec.ok.Load(), rec.bad.Load(), rec.errs.Load())
		}
	}
}
