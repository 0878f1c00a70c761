// Command bench measures escrow on this machine, in one run and side by side:
//
//   - limit:    raw EVALSHA of the reserve script on the same Redis, and Postgres inserts of the
//     usage-event shape;
//   - baseline: the example proxy with the middleware switched off, against the fake upstream;
//   - escrow:   the same proxy with the middleware on (real Redis + Postgres): non-streaming and
//     streaming, many orgs and one hot org;
//
// and prints one table with throughput, p50/p99 latency and the ratios escrow/baseline and
// reserve/raw EVALSHA, then the settle lag at a steady rate and the worker backlog.
//
//	make bench                      # or: go run ./bench -duration 8s
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

type options struct {
	duration    time.Duration
	warmup      time.Duration
	concurrency int
	redisConns  int
	orgs        int
	lagRate     float64
	lagDuration time.Duration
	limitRound  time.Duration
	pgOnly      bool
	pgRuns      int
	rounds      int
	redisURL    string
	databaseURL string
	profileDir  string
	wrkDuration time.Duration
	wrkOnly     bool
	waitOnly    bool
	wrkRun      string
	before      string

	// the views row (views.go, issue 34)
	viewsRows                             int64
	viewsOrgs, viewsClients, viewsPollers int
	viewsDuration                         time.Duration
	viewsOnly                             bool
}

func main() {
	var o options
	flag.DurationVar(&o.duration, "duration", 6*time.Second, "measured time of each closed-loop scenario (split into rounds taken in turns with the other scenarios)")
	flag.IntVar(&o.rounds, "rounds", 3, "rounds each closed-loop scenario is split into")
	flag.DurationVar(&o.warmup, "warmup", time.Second, "warm-up of each closed-loop scenario")
	flag.IntVar(&o.concurrency, "concurrency", 256, "clients of the closed-loop proxy runs (enough to keep the proxy busy while requests wait for the group commit)")
	flag.IntVar(&o.redisConns, "redis-conns", 64, "goroutines of the Redis limit loops")
	flag.IntVar(&o.orgs, "orgs", 100, "orgs of the many-orgs runs")
	flag.Float64Var(&o.lagRate, "lag-rate", 2000, "request rate of the settle-lag run (req/s, open loop)")
	flag.DurationVar(&o.lagDuration, "lag-duration", 10*time.Second, "length of the settle-lag run")
	flag.DurationVar(&o.limitRound, "limit-round", 400*time.Millisecond, "length of one round of a Redis limit loop (8 rounds each, interleaved)")
	flag.StringVar(&o.redisURL, "redis-url", envOr("REDIS_URL", "redis://127.0.0.1:6379/0"), "Redis under test (never flushed: the bench uses a prefix of its own and deletes its keys)")
	flag.StringVar(&o.databaseURL, "database-url", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres under test (the bench uses schemas of its own and drops them)")
	flag.StringVar(&o.profileDir, "profile", "", "if set: also take 10 s CPU and allocation profiles of the escrow proxy at max throughput into this directory, and in the wrk side by side a CPU profile of each escrow round (wrk-<row>-<round>.pprof)")
	flag.DurationVar(&o.wrkDuration, "wrk-duration", 6*time.Second, "measured time of each wrk scenario (split into -rounds rounds, in turns); 0: no wrk table")
	flag.BoolVar(&o.pgOnly, "pg-only", false, "run only the Postgres limit rows (usage-event inserts, the Recorder, the accounting pipeline with its WAL records per event) and print them; -pg-runs N repeats them")
	flag.IntVar(&o.pgRuns, "pg-runs", 1, "with -pg-only: how many times the Postgres rows are measured (each in a fresh schema)")
	flag.BoolVar(&o.waitOnly, "wait-only", false, "run only the WAIT rows: reserve+settle on a private master + replica (redis-server started by the bench) without and with WAIT 1 after each reserve (docs/failover.md)")
	flag.BoolVar(&o.wrkOnly, "wrk-only", false, "run only the wrk side by side (the proxies, no limits, no Go load, no settle lag)")
	flag.StringVar(&o.wrkRun, "wrk-run", "", "a regexp: run only the wrk rows whose name matches it (each keeps its middleware-off row), e.g. '100 orgs' or '-c1'")
	flag.StringVar(&o.before, "before", "", "a checkout of an earlier escrow (e.g. a git worktree of main): its proxy is built too and measured in the same wrk rounds, as the 'before' rows")
	flag.Int64Var(&o.viewsRows, "views-rows", 1_000_000, "views row: charges in the polling org's ledger (0: no views row)")
	flag.IntVar(&o.viewsOrgs, "views-orgs", 20, "views row: orgs that stream while the pollers poll")
	flag.IntVar(&o.viewsClients, "views-clients", 32, "views row: streaming clients")
	flag.IntVar(&o.viewsPollers, "views-pollers", 40, "views row: clients polling every customer view (a key each, one org)")
	flag.DurationVar(&o.viewsDuration, "views-duration", 24*time.Second, "views row: measured time, half without and half with the pollers, in -rounds turns")
	flag.BoolVar(&o.viewsOnly, "views-only", false, "run only the views row (the customer views of an org of -views-rows charges polled while other orgs stream)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// proxyProc is a proxy process under test.
type proxyProc struct {
	cmd   *exec.Cmd
	base  string
	admin string
	rdb   *redis.Client // the Redis it uses, for INFO cpu
}

func startProxy(ctx context.Context, bin string, env []string) (*proxyProc, error) {
	addr := freeAddr()
	admin := "bench-admin-token"
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = append(os.Environ(), append(env, "ESCROW_ADDR="+addr, "ESCROW_ADMIN_TOKEN="+admin, "ESCROW_LOG_LEVEL=error")...)
	cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proxyProc{cmd: cmd, base: "http://" + addr, admin: admin}
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "REDIS_URL="); ok {
			if opt, err := redis.ParseURL(v); err == nil {
				p.rdb = redis.NewClient(opt)
			}
		}
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(p.base + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return p, nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	p.stop()
	return nil, fmt.Errorf("proxy at %s did not become ready", addr)
}

func (p *proxyProc) stop() {
	_ = p.cmd.Process.Signal(os.Interrupt)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
	}
}

func (p *proxyProc) adminCall(method, path string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, p.base+"/admin/v1"+path, rd)
	req.Header.Set("Authorization", "Bearer "+p.admin)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, b)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// provision creates orgs with huge balances and keys, and prices the model.
func (p *proxyProc) provision(prefix string, n int) ([]string, error) {
	if err := p.adminCall("PUT", "/models/bench-model", map[string]any{
		"input_price": 150_000, "cached_input_price": 75_000, "output_price": 600_000,
		"max_input_tokens": 128_000, "max_output_tokens": 4_096, "max_cost": 10_000, "default_hold": 10_000,
	}, nil); err != nil {
		return nil, err
	}
	return p.orgs(prefix, n, 1e13)
}

// provisionFit creates orgs whose balance (300,000) is far below the bound of fitBody (a model
// with 1,000,000 output tokens at 0.6 each: ≈ 600,000) and far above its cost (≈ 12): every
// request is fitted (its output cap lowered to what fits, ≈ 500,000 tokens), for tens of
// thousands of requests per org.
func (p *proxyProc) provisionFit(prefix string, n int) ([]string, error) {
	if err := p.adminCall("PUT", "/models/bench-fit", map[string]any{
		"input_price": 150_000, "output_price": 600_000, "max_input_tokens": 128_000, "max_output_tokens": 1_000_000,
	}, nil); err != nil {
		return nil, err
	}
	return p.orgs(prefix, n, 300_000)
}

// orgs creates n orgs with funds each and returns a key of each.
func (p *proxyProc) orgs(prefix string, n int, funds int64) ([]string, error) {
	keys := make([]string, 0, n)
	for i := 0; i < n; i++ {
		org := fmt.Sprintf("%s-%03d", prefix, i)
		if err := p.adminCall("POST", "/orgs", map[string]string{"id": org}, nil); err != nil {
			return nil, err
		}
		if err := p.adminCall("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": org + "-funds"}, nil); err != nil {
			return nil, err
		}
		var k struct{ Key string }
		if err := p.adminCall("POST", "/orgs/"+org+"/keys", nil, &k); err != nil {
			return nil, err
		}
		keys = append(keys, k.Key)
	}
	return keys, nil
}

var (
	plainBody  = []byte(`{"model":"bench-model","max_tokens":16,"messages":[{"role":"user","content":"say hello to the benchmark"}]}`)
	streamBody = []byte(`{"model":"bench-model","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"say hello to the benchmark"}]}`)
	// fitBody states no cap: its bound is the model's max output, which the fit orgs cannot cover;
	// its answer stops at 16 words, as plainBody's, well before the fitted cap.
	fitBody = []byte(`{"model":"bench-fit","messages":[{"role":"user","content":"say hello to the benchmark [stop:16]"}]}`)
)

func num(v float64) string {
	if v == 0 {
		return ""
	}
	s := strconv.FormatFloat(v, 'f', 0, 64)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// measure runs s against the proxy and adds the proxy's CPU time and Redis commands.
func (p *proxyProc) measure(ctx context.Context, s loadSpec) loadResult {
	if s.Warmup > 0 {
		w := s
		w.Duration, w.Warmup, w.Name = s.Warmup, 0, s.Name+" (warm-up)"
		_ = runLoad(ctx, w)
		s.Warmup = 0
	}
	cpu0, self0, redis0, pg0 := procCPU(p.cmd.Process.Pid), procCPU(os.Getpid()), p.redisCPU(), postgresCPU()
	busy0, all0 := machineCPU()
	cmds0 := scrapeCounters(p, "escrow_redis_commands_total")
	r := runLoad(ctx, s)
	r.ProxyCPU = procCPU(p.cmd.Process.Pid) - cpu0
	r.LoadCPU = procCPU(os.Getpid()) - self0
	r.RedisCPU, r.PostgresCPU = p.redisCPU()-redis0, postgresCPU()-pg0
	if busy1, all1 := machineCPU(); all1 > all0 {
		r.MachineBusy = float64(busy1-busy0) / float64(all1-all0)
	}
	cmds1 := scrapeCounters(p, "escrow_redis_commands_total")
	var total float64
	var parts []string
	for k, v := range cmds1 {
		if d := v - cmds0[k]; d > 0 {
			total += d
			if r.OK > 0 {
				parts = append(parts, fmt.Sprintf("%s %.2f", k, d/float64(r.Sent)))
			}
		}
	}
	slices.Sort(parts)
	if r.Sent > 0 {
		r.RedisPerReq = total / float64(r.Sent)
	}
	r.RedisCmds = strings.Join(parts, ", ")
	fmt.Fprintln(os.Stderr, "  "+r.String())
	return r
}

func (r loadResult) cpuPerReq(cpu time.Duration) string {
	if r.Sent == 0 {
		return ""
	}
	return (cpu / time.Duration(r.Sent)).Round(time.Microsecond).String()
}

// redisCPU is the Redis server's CPU time so far (INFO cpu; the whole server, every client).
func (p *proxyProc) redisCPU() time.Duration {
	if p.rdb == nil {
		return 0
	}
	info, err := p.rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		return 0
	}
	var total float64
	for _, l := range strings.Split(info, "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(l), ":")
		if k == "used_cpu_user" || k == "used_cpu_sys" {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// postgresCPU is the CPU time so far of the shared PostgreSQL's processes (those of the server
// whose data directory is not a test's private one), from /proc. Backends that exit during a run
// take their CPU time with them; the proxies' pooled connections stay.
func postgresCPU() time.Duration {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var total time.Duration
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			continue
		}
		cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if bytes.Contains(cmd, []byte("/tmp/")) || bytes.Contains(cmd, []byte("escrow-pg")) {
			continue // a private server of some test
		}
		total += procCPU(pid)
	}
	return total
}

// machineCPU returns the busy and total jiffies of all CPUs so far (/proc/stat).
func machineCPU() (busy, total int64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	for i, v := range f[1:] {
		n, _ := strconv.ParseInt(v, 10, 64)
		if i >= 8 { // guest times are already in user
			break
		}
		total += n
		if i != 3 && i != 4 { // idle, iowait
			busy += n
		}
	}
	return busy, total
}

// procCPU is the user+system CPU time of a process so far.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command (which may hold spaces) start after the last ')'.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	const hz = 100 // USER_HZ on Linux
	return time.Duration(ut+st) * time.Second / hz
}

// pprofAddr is the address the proxy serves pprof on ("" for none, or a nil p).
func (p *proxyProc) pprofAddr() string {
	if p == nil {
		return ""
	}
	for _, kv := range p.cmd.Env {
		if v, ok := strings.CutPrefix(kv, "ESCROW_PPROF_ADDR="); ok {
			return v
		}
	}
	return ""
}

// profile takes CPU and allocation profiles of the proxy while a closed-loop run keeps it at
// max throughput.
func (p *proxyProc) profile(ctx context.Context, o options, url string, keys []string) error {
	addr := p.pprofAddr()
	if err := os.MkdirAll(o.profileDir, 0o755); err != nil {
		return err
	}
	errs := make(chan error, 2)
	get := func(path, file string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			errs <- err
			return
		}
		defer resp.Body.Close()
		f, err := os.Create(filepath.Join(o.profileDir, file))
		if err != nil {
			errs <- err
			return
		}
		_, err = io.Copy(f, resp.Body)
		errs <- errors.Join(err, f.Close())
	}
	go get("/debug/pprof/profile?seconds=10", "cpu.pprof")
	go get("/debug/pprof/allocs?seconds=10", "allocs.pprof")
	r := p.measure(ctx, loadSpec{Name: "escrow json (profiled)", URL: url, Keys: keys, Body: plainBody, Concurrency: o.concurrency, Duration: 11 * time.Second})
	fmt.Fprintf(os.Stderr, "  profiles in %s (%d requests during the run)\n", o.profileDir, r.OK)
	return errors.Join(<-errs, <-errs)
}

// waitSettled waits until nothing is pending or unsettled in the ledger and returns how long
// that took.
func waitSettled(p *proxyProc, limit time.Duration) time.Duration {
	start := time.Now()
	for time.Since(start) < limit {
		if scrapeMetrics(p) == "" { // the proxy is gone (interrupted)
			return time.Since(start)
		}
		if scrapeGauge(p, "escrow_worker_pending_events") == 0 && scrapeGauge(p, "escrow_worker_unsettled_entries") == 0 {
			return time.Since(start)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}

func scrapeMetrics(p *proxyProc) string {
	resp, err := http.Get(p.base + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func scrapeGauge(p *proxyProc, name string) float64 {
	for _, line := range strings.Split(scrapeMetrics(p), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f
		}
	}
	return -1
}

// scrapeCounters returns every series of a labelled counter, by its label text.
func scrapeCounters(p *proxyProc, name string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(scrapeMetrics(p), "\n") {
		rest, ok := strings.CutPrefix(line, name+"{")
		if !ok {
			continue
		}
		labels, val, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		f, _ := strconv.ParseFloat(strings.TrimSpace(val), 64)
		labels = strings.NewReplacer(`command=`, "", `pipelined="true"`, "piped", `pipelined="false"`, "", `"`, "", ",", " ").Replace(labels)
		out[strings.TrimSpace(labels)] = f
	}
	return out
}

// histogram is a scraped Prometheus histogram: cumulative counts by upper bound.
type histogram struct {
	bounds []float64
	counts []float64
}

func scrapeHistogram(p *proxyProc, name string) histogram {
	var h histogram
	for _, line := range strings.Split(scrapeMetrics(p), "\n") {
		rest, ok := strings.CutPrefix(line, name+`_bucket{le="`)
		if !ok {
			continue
		}
		le, val, ok := strings.Cut(rest, `"} `)
		if !ok {
			continue
		}
		b, err := strconv.ParseFloat(le, 64)
		if le == "+Inf" {
			b, err = math.Inf(1), nil
		}
		if err != nil {
			continue
		}
		c, _ := strconv.ParseFloat(strings.TrimSpace(val), 64)
		h.bounds, h.counts = append(h.bounds, b), append(h.counts, c)
	}
	return h
}

// plus adds two scrapes of the same histogram (two processes).
func (h histogram) plus(o histogram) histogram {
	if len(h.counts) == 0 {
		return o
	}
	out := histogram{bounds: h.bounds, counts: slices.Clone(h.counts)}
	for i := range out.counts {
		if i < len(o.counts) {
			out.counts[i] += o.counts[i]
		}
	}
	return out
}

// lagQuantiles reads p50 and p99 of what the histogram gained between two scrapes,
// interpolated linearly within the bucket that holds each (as Prometheus' histogram_quantile).
func lagQuantiles(before, after histogram) (p50, p99 string, n int64) {
	if len(after.counts) == 0 {
		return "n/a", "n/a", 0
	}
	diff := make([]float64, len(after.counts))
	for i := range diff {
		diff[i] = after.counts[i]
		if i < len(before.counts) {
			diff[i] -= before.counts[i]
		}
	}
	total := diff[len(diff)-1]
	q := func(p float64) string {
		if total == 0 {
			return "n/a"
		}
		rank := p * total
		for i, c := range diff {
			if c < rank {
				continue
			}
			if math.IsInf(after.bounds[i], 1) {
				return "> " + secs(after.bounds[i-1])
			}
			lo, below := 0.0, 0.0
			if i > 0 {
				lo, below = after.bounds[i-1], diff[i-1]
			}
			in := c - below
			v := after.bounds[i]
			if in > 0 {
				v = lo + (after.bounds[i]-lo)*(rank-below)/in
			}
			return secs(v)
		}
		return "n/a"
	}
	return q(0.50), q(0.99), int64(total)
}

func secs(v float64) string {
	return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
}

// benchSchema creates a schema of the bench's own and returns a URL whose search_path is it,
// and a function that drops it.
func benchSchema(ctx context.Context, base, schema string) (string, func(), error) {
	pool, err := pgxpool.New(ctx, base)
	if err != nil {
		return "", nil, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return "", nil, fmt.Errorf("create schema %s: %w", schema, err)
	}
	u, err := neturl.Parse(base)
	if err != nil {
		return "", nil, err
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		p, err := pgxpool.New(ctx, base)
		if err != nil {
			fmt.Fprintf(os.Stderr, "bench: schema %s NOT dropped: %v\n", schema, err)
			return
		}
		defer p.Close()
		// A proxy that is still shutting down may hold a lock for a moment: retry.
		for attempt := 1; ; attempt++ {
			_, err = p.Exec(ctx, "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS "+schema+" CASCADE")
			if err == nil {
				return
			}
			if attempt == 5 || ctx.Err() != nil {
				fmt.Fprintf(os.Stderr, "bench: schema %s NOT dropped (drop it by hand): %v\n", schema, err)
				return
			}
			time.Sleep(time.Second)
		}
	}
	return u.String(), drop, nil
}

// cleanRedis deletes the bench's keys (its prefix only), with SCAN and DEL: never FLUSH.
func cleanRedis(url, prefix string) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return
	}
	c := redis.NewClient(opt)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n := 0
	iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	var batch []string
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == 500 {
			n += int(c.Del(ctx, batch...).Val())
			batch = batch[:0]
		}
	}
	if len(batch) > 0 {
		n += int(c.Del(ctx, batch...).Val())
	}
	fmt.Fprintf(os.Stderr, "bench: removed %d Redis keys under %s*\n", n, prefix)
}

// describeMachine names what the numbers were measured on.
func describeMachine(ctx context.Context, o options) string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "model name"); ok {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	rv := "?"
	if opt, err := redis.ParseURL(o.redisURL); err == nil {
		c := redis.NewClient(opt)
		if info, err := c.Info(ctx, "server").Result(); err == nil {
			for _, l := range strings.Split(info, "\n") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
					rv = v
				}
			}
		}
		c.Close()
	}
	pv := "?"
	if p, err := pgxpool.New(ctx, o.databaseURL); err == nil {
		_ = p.QueryRow(ctx, "SHOW server_version").Scan(&pv)
		p.Close()
	}
	load := ""
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		load = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return fmt.Sprintf("machine: %d CPUs (%s), Go %s, Redis %s, PostgreSQL %s; load average at start %s",
		runtime.NumCPU(), model, runtime.Version(), rv, pv, load)
}
