package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// wrkRows builds a wrk table of one middleware-off row and the escrow rows named, each with one
// round of 1,000 requests in a second and the CPU given (proxy only) per request.
func wrkRows(offCPU time.Duration, rows map[string]time.Duration, n429 int64, p50 map[string]time.Duration) []*wrkScenario {
	run := func(name string, cpu time.Duration) wrkRun {
		return wrkRun{name: name, requests: 1000, elapsed: time.Second, proxy: 1000 * cpu, p50: p50[name], n429: n429}
	}
	off := &wrkScenario{name: "proxy, middleware off, json", p: &proxyProc{}, runs: []wrkRun{run("off", offCPU)}}
	off.off = off
	scs := []*wrkScenario{off}
	for name, cpu := range rows {
		r := run(name, cpu)
		r.requests = int64(1000 * offCPU / cpu) // throughput falls as CPU per request rises
		r.proxy = time.Duration(r.requests) * cpu
		scs = append(scs, &wrkScenario{name: name, p: &proxyProc{}, off: off, runs: []wrkRun{r}})
	}
	return scs
}

func TestGoalRowsAgainstBefore(t *testing.T) {
	t.Parallel()
	o := options{orgs: 100, lagRate: 2000, before: "/before"}
	scs := wrkRows(200*time.Microsecond, map[string]time.Duration{
		"escrow, json, 100 orgs":             500 * time.Microsecond, // 300 over off
		"before: escrow, json, 100 orgs":     800 * time.Microsecond, // 600 over off
		"escrow, json, 10 orgs, -c1":         400 * time.Microsecond,
		"before: escrow, json, 10 orgs, -c1": 400 * time.Microsecond,
		"escrow, json, 1 hot org":            400 * time.Microsecond,
		"before: escrow, json, 1 hot org":    400 * time.Microsecond,
	}, 0, map[string]time.Duration{
		"escrow, json, 10 orgs, -c1":         2 * time.Millisecond,
		"before: escrow, json, 10 orgs, -c1": 3 * time.Millisecond,
	})
	lim := &limits{pipeline: 41000, walRecords: 3.2}
	s := &scenarios{}
	s.ePlain.RedisPerReq = 1.9
	lags := []lagRun{{p99: "148ms"}}
	got := map[string]goalRow{}
	for _, r := range goalRows(scs, lim, s, lags, o) {
		got[r.name] = r
	}
	want := map[string][2]string{ // row → now, met
		"CPU/request over middleware off, json, 100 orgs":   {"300 µs", "yes"}, // exactly half of 600
		"wrk req/s ratio, json, 100 orgs":                   {"0.40", "no"},
		"false 429s, json, 1 hot org (ratio)":               {"0 (0.50)", "yes"},
		"p50 over middleware off, one connection":           {"+2.000 ms", "yes"},
		"accounting pipeline (record + account + settle)":   {"41,000 events/s", "yes"},
		"WAL records per usage event":                       {"3.20", "yes"},
		"settle lag p99 at 2000 req/s":                      {"148ms", "yes"},
		"Redis commands per request, the worker's included": {"1.90", "yes"},
	}
	for name, w := range want {
		r, ok := got[name]
		if !ok {
			t.Errorf("no row %q (rows %v)", name, got)
			continue
		}
		if r.now != w[0] || r.met != w[1] {
			t.Errorf("%s: now %q met %q, want %q %q", name, r.now, r.met, w[0], w[1])
		}
	}
	if r := got["CPU/request over middleware off, json, 100 orgs"]; r.before != "600 µs" || r.goal != "≤ 300 µs" {
		t.Errorf("CPU row against before: %+v", r)
	}
	if r := got["p50 over middleware off, one connection"]; r.before != "+3.000 ms" {
		t.Errorf("one-connection row against before: %+v", r)
	}
}

func TestGoalRowsWithoutBefore(t *testing.T) {
	t.Parallel()
	o := options{orgs: 100, lagRate: 2000}
	scs := wrkRows(200*time.Microsecond, map[string]time.Duration{"escrow, json, 100 orgs": 400 * time.Microsecond}, 3, nil)
	rows := goalRows(scs, &limits{pipeline: 20000, walRecords: 5}, nil, []lagRun{{p99: "> 10s"}}, o)
	got := map[string]goalRow{}
	for _, r := range rows {
		got[r.name] = r
	}
	if r := got["CPU/request over middleware off, json, 100 orgs"]; r.before != "—" || r.met != "" {
		t.Errorf("without a before build the CPU goal cannot be judged: %+v", r)
	}
	if r := got["wrk req/s ratio, json, 100 orgs"]; r.now != "0.50" || r.met != "yes" {
		t.Errorf("ratio row: %+v", r)
	}
	if r := got["accounting pipeline (record + account + settle)"]; r.met != "no" {
		t.Errorf("pipeline row: %+v", r)
	}
	if r := got["WAL records per usage event"]; r.met != "no" {
		t.Errorf("WAL row: %+v", r)
	}
	if r := got["settle lag p99 at 2000 req/s"]; r.met != "" {
		t.Errorf("a lag past the histogram's range is not judged: %+v", r)
	}
	if _, ok := got["false 429s, json, 1 hot org (ratio)"]; ok {
		t.Errorf("a hot-org row from a run without one: %+v", got)
	}
	var out bytes.Buffer
	printGoals(&out, scs, nil, nil, nil, o)
	if !strings.Contains(out.String(), "no -before checkout") {
		t.Errorf("the table does not say why the before column is empty:\n%s", out.String())
	}
}
