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
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tidwall/gjson"
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

	Codes   map[string]int64 // non-2xx answers by status and error code
	samples []time.Duration  // latencies of the successful requests

	ProxyCPU    time.Duration // CPU time of the proxy process during the run
	LoadCPU     time.Duration // CPU time of the load generator (this process) during the run
	RedisCPU    time.Duration // CPU time of the Redis server during the run
	PostgresCPU time.Duration // CPU time of the Postgres processes during the run
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
	codes   map[string]int64 // status and OpenAI error code of the non-2xx answers
	ok, bad atomic.Int64
	errs    atomic.Int64
	sent    atomic.Int64
}

func (r *recorder) add(d time.Duration, status int, code string, err error) {
	r.sent.Add(1)
	if err != nil {
		r.errs.Add(1)
		return
	}
	r.mu.Lock()
	r.status[status]++
	if status/100 != 2 {
		r.codes[strconv.Itoa(status)+" "+code]++
	}
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

func doOne(ctx context.Context, c *http.Client, s *loadSpec, i int64) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL, bytes.NewReader(s.Body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	if len(s.Keys) > 0 {
		req.Header.Set("Authorization", "Bearer "+s.Keys[int(i)%len(s.Keys)])
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return resp.StatusCode, gjson.GetBytes(b, "error.code").String(), nil
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, "", nil
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
	rec := &recorder{status: map[int]int64{}, codes: map[string]int64{}}
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
					st, code, err := doOne(context.Background(), c, &s, i)
					if ctx.Err() != nil && err == nil {
						// finished after the window: still counted
					}
					rec.add(time.Since(t0), st, code, err)
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
				st, code, err := doOne(context.Background(), c, &s, i)
				rec.add(time.Since(intended), st, code, err)
				<-sem
			}()
		}
	}
	wg.Wait()
	close(stopProgress)
	el := time.Since(start)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	r := loadResult{Name: s.Name, Sent: rec.sent.Load(), OK: rec.ok.Load(), Non2xx: rec.bad.Load(), Errors: rec.errs.Load(),
		Status: rec.status, Codes: rec.codes, Elapsed: el, samples: rec.samples}
	r.summarize()
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

// summarize computes throughput and percentiles from the counts and samples.
func (r *loadResult) summarize() {
	slices.Sort(r.samples)
	if r.Elapsed > 0 {
		r.Throughput = float64(r.OK) / r.Elapsed.Seconds()
	}
	r.P50, r.P90, r.P99, r.P999 = percentile(r.samples, 50), percentile(r.samples, 90), percentile(r.samples, 99), percentile(r.samples, 99.9)
	if len(r.samples) > 0 {
		r.Max = r.samples[len(r.samples)-1]
	}
}

// merge adds run b (another round of the same scenario) to r.
func (r *loadResult) merge(b loadResult) {
	if r.Name == "" {
		*r = b
		return
	}
	r.MachineBusy = (r.MachineBusy*r.Elapsed.Seconds() + b.MachineBusy*b.Elapsed.Seconds()) / (r.Elapsed + b.Elapsed).Seconds()
	if r.Sent+b.Sent > 0 {
		r.RedisPerReq = (r.RedisPerReq*float64(r.Sent) + b.RedisPerReq*float64(b.Sent)) / float64(r.Sent+b.Sent)
	}
	r.Sent, r.OK, r.Non2xx, r.Errors = r.Sent+b.Sent, r.OK+b.OK, r.Non2xx+b.Non2xx, r.Errors+b.Errors
	r.Elapsed, r.ProxyCPU, r.LoadCPU = r.Elapsed+b.Elapsed, r.ProxyCPU+b.ProxyCPU, r.LoadCPU+b.LoadCPU
	r.RedisCPU, r.PostgresCPU = r.RedisCPU+b.RedisCPU, r.PostgresCPU+b.PostgresCPU
	for k, v := range b.Status {
		r.Status[k] += v
	}
	for k, v := range b.Codes {
		r.Codes[k] += v
	}
	r.samples = append(r.samples, b.samples...)
	r.RedisCmds = b.RedisCmds
	r.summarize()
}
