package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// The wrk side by side (DESIGN.md "Performance budget"; issue 12): the same small chat request
// driven by wrk, a C load generator whose own CPU stays out of the proxy's way, against the fake
// upstream directly, the proxy with the middleware off, and the proxy with holds on (100 orgs,
// one hot org, JSON and stream, and one connection). CPU per request by component is what the
// budget is written in; it moves less than throughput on a shared machine. The Go load
// generator (load.go) stays for what wrk cannot do: open-loop rates (settle lag) and the
// Redis-command counts per request.

// wrkRun is one wrk run's result, with the CPU each component spent during it.
type wrkRun struct {
	name                string
	requests, non2xx    int64
	n429                int64
	p50, p99            time.Duration
	elapsed             time.Duration
	proxy, redis, pgCPU time.Duration
}

func (r wrkRun) rps() float64 { return float64(r.requests) / r.elapsed.Seconds() }

func (r wrkRun) per(d time.Duration) time.Duration {
	if r.requests == 0 {
		return 0
	}
	return d / time.Duration(r.requests)
}

// ensureWrk installs wrk (scripts/wrk.sh: the Debian package) when it is absent.
func ensureWrk(ctx context.Context) (string, error) {
	if p, err := exec.LookPath("wrk"); err == nil {
		return p, nil
	}
	cmd := exec.CommandContext(ctx, "bash", "scripts/wrk.sh")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("wrk is not installed and scripts/wrk.sh could not install it: %w", err)
	}
	return exec.LookPath("wrk")
}

// wrkScript is the Lua script: POST body, rotating the API keys, and counting 429s per thread
// (each wrk thread has its own Lua state; done() reads them through thread:get).
func wrkScript(dir string, keys []string, body []byte) (string, error) {
	var b strings.Builder
	b.WriteString("local keys = {")
	for i, k := range keys {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "%q", "Bearer "+k)
	}
	b.WriteString("}\n")
	fmt.Fprintf(&b, "local body = %q\n", string(body))
	b.WriteString(`
local threads = {}
function setup(thread) table.insert(threads, thread) end
local i = 0
n429 = 0
function init(args) i = math.random(#keys) end
function request()
  i = i % #keys + 1
  return wrk.format("POST", nil, {["Authorization"] = keys[i], ["Content-Type"] = "application/json"}, body)
end
function response(status, headers, body)
  if status == 429 then n429 = n429 + 1 end
end
function done(summary, latency, requests)
  local t429 = 0
  for _, t in ipairs(threads) do t429 = t429 + t:get("n429") end
  io.write(string.format("WRKRESULT %d %d %d %d %d %d\n", summary.requests, summary.errors.status,
    t429, latency:percentile(50), latency:percentile(99), summary.duration))
end
`)
	f, err := os.CreateTemp(dir, "wrk-*.lua")
	if err != nil {
		return "", err
	}
	defer f.Close()
	_, err = f.WriteString(b.String())
	return f.Name(), err
}

// runWrk runs wrk once against url and measures the components' CPU around it (p may be nil: the
// direct run).
func runWrk(ctx context.Context, wrk, dir, name, url string, keys []string, body []byte, threads, conns int, d time.Duration, p *proxyProc) (wrkRun, error) {
	r := wrkRun{name: name}
	script, err := wrkScript(dir, keys, body)
	if err != nil {
		return r, err
	}
	defer os.Remove(script)
	var cpu0, redis0 time.Duration
	if p != nil {
		cpu0, redis0 = procCPU(p.cmd.Process.Pid), p.redisCPU()
	}
	pg0 := postgresCPU()
	cmd := exec.CommandContext(ctx, wrk, "-t"+strconv.Itoa(threads), "-c"+strconv.Itoa(conns), "-d"+strconv.Itoa(int(d.Seconds()))+"s", "-s", script, url)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		return r, fmt.Errorf("wrk %s: %w: %s", name, err, out.String())
	}
	if p != nil {
		r.proxy, r.redis = procCPU(p.cmd.Process.Pid)-cpu0, p.redisCPU()-redis0
	}
	r.pgCPU = postgresCPU() - pg0
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 7 && f[0] == "WRKRESULT" {
			v := make([]int64, 6)
			for i := range v {
				v[i], _ = strconv.ParseInt(f[i+1], 10, 64)
			}
			r.requests, r.non2xx, r.n429 = v[0], v[1], v[2]
			r.p50, r.p99 = time.Duration(v[3])*time.Microsecond, time.Duration(v[4])*time.Microsecond
			r.elapsed = time.Duration(v[5]) * time.Microsecond
		}
	}
	if r.elapsed == 0 {
		return r, fmt.Errorf("wrk %s: no result in its output: %s", name, out.String())
	}
	fmt.Fprintf(os.Stderr, "  wrk %-40s %8.0f req/s  p50 %-9s 429s %d  non-2xx %d\n", name, r.rps(), r.p50, r.n429, r.non2xx)
	return r, nil
}

// beforeProxy is an earlier escrow's proxy (-before), provisioned like the current one.
type beforeProxy struct {
	p         *proxyProc
	keys, hot []string
}

func startBefore(ctx context.Context, dir, tmp string, env []string, orgs int) (*beforeProxy, error) {
	bin := filepath.Join(tmp, "proxy-before")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./examples/proxy")
	build.Dir = dir
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return nil, fmt.Errorf("build %s/examples/proxy: %w", dir, err)
	}
	p, err := startProxy(ctx, bin, env)
	if err != nil {
		return nil, err
	}
	b := &beforeProxy{p: p}
	if b.keys, err = p.provision("org", orgs); err == nil {
		b.hot, err = p.provision("hot", 1)
	}
	if err != nil {
		p.stop()
		return nil, err
	}
	return b, nil
}

// startDirect serves the fake upstream from this process, for the "direct" row.
func startDirect() (base string, stop func(), err error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	return "http://" + l.Addr().String(), func() { _ = srv.Close() }, nil
}

// wrkSideBySide runs the wrk scenarios (each split into rounds taken in turns, so a burst of load
// from elsewhere on the machine spreads over all of them) and prints their table.
func wrkSideBySide(ctx context.Context, o options, base, esc *proxyProc, keys, hot []string, before *beforeProxy, co coRows) ([]*wrkScenario, error) {
	wrk, err := ensureWrk(ctx)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "escrow-wrk-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	direct, stopDirect, err := startDirect()
	if err != nil {
		return nil, err
	}
	defer stopDirect()
	scs := wrkScenarios(direct, base, esc, keys, hot, before, co)
	if o.wrkRun != "" {
		if scs, err = filterScenarios(scs, o.wrkRun); err != nil {
			return nil, err
		}
	}
	round := max(o.wrkDuration/time.Duration(o.rounds), time.Second)
	fmt.Fprintf(os.Stderr, "wrk: %d rounds of %s per scenario, in turns …\n", o.rounds, round)
	if err := runWrkRounds(ctx, wrk, dir, scs, o.rounds, round, o.profileDir); err != nil {
		return nil, err
	}
	printWrkTable(scs)
	fmt.Printf("wrk 4.1 (Debian), -t2 -c32 unless -c1; %d rounds of %s each, in turns. CPU per request: the proxy from /proc/<pid>/stat (its built-in fake upstream included; the middleware-off proxy pays it too), Redis from INFO cpu, Postgres from its processes in /proc — shared servers, so other clients' work counts too; 'over off' subtracts the middleware-off proxy's CPU per request of the same shape. 429s on the hot org are false 429s: only 32 requests are ever in flight.\n", o.rounds, round)
	return scs, nil
}

// wrkScenario is one row of the wrk table: a URL, the keys its requests take turns with, a body
// and wrk's threads and connections, and the rounds run so far.
type wrkScenario struct {
	name        string
	url         string
	p           *proxyProc // nil: no proxy (the direct row)
	keys        []string
	body        []byte
	threads, cs int
	// off is the middleware-off row of the same shape, which this row's overheads are measured
	// against (nil for the direct row).
	off  *wrkScenario
	runs []wrkRun
}

// coRows is the proxy with coalescing off (ESCROW_COALESCE=false) and its keys, for its rows
// of the wrk table (nil p: none).
type coRows struct {
	p         *proxyProc
	keys, hot []string
}

// wrkScenarios lists the rows: the fake upstream served directly, the middleware-off proxy and
// escrow with JSON and streamed answers, over many orgs, one hot org and one connection; with
// before, the earlier escrow's rows too.
func wrkScenarios(direct string, base, esc *proxyProc, keys, hot []string, before *beforeProxy, co coRows) []*wrkScenario {
	const chat = "/v1/chat/completions"
	none := []string{"sk-none"}
	c1keys := keys[:min(10, len(keys))]
	many := fmt.Sprintf("%d orgs", len(keys))
	c1 := fmt.Sprintf("%d orgs, -c1", len(c1keys))
	offJSON := &wrkScenario{name: "proxy, middleware off, json", url: base.base + chat, p: base, keys: none, body: plainBody, threads: 2, cs: 32}
	offStream := &wrkScenario{name: "proxy, middleware off, stream", url: base.base + chat, p: base, keys: none, body: streamBody, threads: 2, cs: 32}
	offC1 := &wrkScenario{name: "proxy, middleware off, json, -c1", url: base.base + chat, p: base, keys: none, body: plainBody, threads: 1, cs: 1}
	offJSON.off, offStream.off, offC1.off = offJSON, offStream, offC1
	scs := []*wrkScenario{
		{name: "direct upstream, json", url: direct + chat, keys: none, body: plainBody, threads: 2, cs: 32},
		offJSON,
		{name: "escrow, json, " + many, url: esc.base + chat, p: esc, keys: keys, body: plainBody, threads: 2, cs: 32, off: offJSON},
		{name: "escrow, json, 1 hot org", url: esc.base + chat, p: esc, keys: hot, body: plainBody, threads: 2, cs: 32, off: offJSON},
		offStream,
		{name: "escrow, stream, " + many, url: esc.base + chat, p: esc, keys: keys, body: streamBody, threads: 2, cs: 32, off: offStream},
		offC1,
		{name: "escrow, json, " + c1, url: esc.base + chat, p: esc, keys: c1keys, body: plainBody, threads: 1, cs: 1, off: offC1},
	}
	if co.p != nil {
		scs = append(scs,
			&wrkScenario{name: "escrow, coalesce off, json, " + many, url: co.p.base + chat, p: co.p, keys: co.keys, body: plainBody, threads: 2, cs: 32, off: offJSON},
			&wrkScenario{name: "escrow, coalesce off, json, 1 hot org", url: co.p.base + chat, p: co.p, keys: co.hot, body: plainBody, threads: 2, cs: 32, off: offJSON},
			&wrkScenario{name: "escrow, coalesce off, json, " + c1, url: co.p.base + chat, p: co.p, keys: co.keys[:len(c1keys)], body: plainBody, threads: 1, cs: 1, off: offC1},
		)
	}
	if before != nil {
		bp := before.p
		scs = append(scs,
			&wrkScenario{name: "before: escrow, json, " + many, url: bp.base + chat, p: bp, keys: before.keys, body: plainBody, threads: 2, cs: 32, off: offJSON},
			&wrkScenario{name: "before: escrow, json, 1 hot org", url: bp.base + chat, p: bp, keys: before.hot, body: plainBody, threads: 2, cs: 32, off: offJSON},
			&wrkScenario{name: "before: escrow, json, " + c1, url: bp.base + chat, p: bp, keys: before.keys[:len(c1keys)], body: plainBody, threads: 1, cs: 1, off: offC1},
		)
	}
	return scs
}

// filterScenarios keeps the rows whose name matches the regexp expr, and the middleware-off row
// each of them is measured against, in their order.
func filterScenarios(scs []*wrkScenario, expr string) ([]*wrkScenario, error) {
	re, err := regexp.Compile(expr)
	if err != nil {
		return nil, fmt.Errorf("-wrk-run: %w", err)
	}
	keep := map[*wrkScenario]bool{}
	for _, s := range scs {
		if re.MatchString(s.name) {
			keep[s] = true
			if s.off != nil {
				keep[s.off] = true
			}
		}
	}
	if len(keep) == 0 {
		return nil, fmt.Errorf("-wrk-run %q matches no wrk row", expr)
	}
	out := scs[:0:0]
	for _, s := range scs {
		if keep[s] {
			out = append(out, s)
		}
	}
	return out, nil
}

// runWrkRounds warms every scenario up for a second, then runs rounds rounds of round each,
// the scenarios taking turns.
//
// With profDir, each round of a row whose proxy serves pprof (the escrow proxy under -profile)
// also takes a CPU profile of that proxy, into profDir/wrk-<row>-<round>.pprof (merge a row's
// rounds with go tool pprof).
func runWrkRounds(ctx context.Context, wrk, dir string, scs []*wrkScenario, rounds int, round time.Duration, profDir string) error {
	for _, s := range scs { // warm-up: connections, caches, orgs warm in Redis
		if _, err := runWrk(ctx, wrk, dir, s.name+" (warm-up)", s.url, s.keys, s.body, s.threads, s.cs, time.Second, s.p); err != nil {
			return err
		}
	}
	for i := range rounds {
		for _, s := range scs {
			var prof chan error
			if addr := s.p.pprofAddr(); profDir != "" && addr != "" {
				prof = make(chan error, 1)
				file := filepath.Join(profDir, fmt.Sprintf("wrk-%s-%d.pprof", profName(s.name), i+1))
				go func() { prof <- fetchProfile(ctx, addr, round-200*time.Millisecond, file) }()
			}
			r, err := runWrk(ctx, wrk, dir, s.name, s.url, s.keys, s.body, s.threads, s.cs, round, s.p)
			if prof != nil {
				err = errors.Join(err, <-prof)
			}
			if err != nil {
				return err
			}
			s.runs = append(s.runs, r)
		}
	}
	return nil
}

// notFileName matches what profName turns into dashes.
var notFileName = regexp.MustCompile(`[^a-z0-9]+`)

// profName makes a wrk row's name a file name part.
func profName(row string) string {
	return strings.Trim(notFileName.ReplaceAllString(strings.ToLower(row), "-"), "-")
}

// fetchProfile saves a CPU profile of d from the pprof server at addr into file.
func fetchProfile(ctx context.Context, addr string, d time.Duration, file string) error {
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return err
	}
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, max(int(d.Seconds()), 1))
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("profile: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("profile: %s", resp.Status)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// total sums the scenario's rounds; its latencies are the medians of the rounds'.
func (s *wrkScenario) total() wrkRun {
	t := wrkRun{name: s.name}
	var p50s, p99s []time.Duration
	for _, r := range s.runs {
		t.requests += r.requests
		t.non2xx += r.non2xx
		t.n429 += r.n429
		t.elapsed += r.elapsed
		t.proxy += r.proxy
		t.redis += r.redis
		t.pgCPU += r.pgCPU
		p50s, p99s = append(p50s, r.p50), append(p99s, r.p99)
	}
	t.p50, t.p99 = median(p50s), median(p99s)
	return t
}

// overOff is a row against its middleware-off row: CPU per request over it (proxy, Redis and
// Postgres), the req/s ratio and the p50 over it.
type overOff struct {
	cpu   time.Duration
	ratio float64
	p50   time.Duration
}

// vsOff compares the row with its middleware-off row; false for a row without a proxy or rounds.
func (s *wrkScenario) vsOff() (overOff, bool) {
	if s == nil || s.p == nil || s.off == nil || len(s.runs) == 0 || len(s.off.runs) == 0 {
		return overOff{}, false
	}
	r, off := s.total(), s.off.total()
	if off.rps() == 0 {
		return overOff{}, false
	}
	return overOff{cpu: r.per(r.proxy+r.redis+r.pgCPU) - off.per(off.proxy+off.redis+off.pgCPU),
		ratio: r.rps() / off.rps(), p50: r.p50 - off.p50}, true
}

// printWrkTable prints one line per scenario: throughput, latencies, CPU per request, and for a
// proxied row its overheads over its middleware-off row.
func printWrkTable(scs []*wrkScenario) {
	us := func(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond)) }
	ms := func(d time.Duration) string { return fmt.Sprintf("%.3f ms", float64(d)/float64(time.Millisecond)) }
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\twrk run\treq/s\tp50\tp99\tproxy CPU/req\tredis CPU/req\tpg CPU/req\tCPU/req over off\treq/s ratio\tp50 over off\t429s\tnon-2xx\t")
	for _, s := range scs {
		r := s.total()
		cpu, over, ratio, p50over := "—\t—\t—", "", "", ""
		if v, ok := s.vsOff(); ok {
			cpu = us(r.per(r.proxy)) + "\t" + us(r.per(r.redis)) + "\t" + us(r.per(r.pgCPU))
			over, ratio, p50over = us(v.cpu), fmt.Sprintf("%.2f", v.ratio), "+"+ms(v.p50)
		}
		fmt.Fprintf(w, "\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t\n", r.name, num(r.rps()), ms(r.p50), ms(r.p99), cpu, over, ratio, p50over, r.n429, r.non2xx)
	}
	w.Flush()
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j] < s[i] {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
	return s[len(s)/2]
}
