package main

import (
	"context"

	"fmt"
	"github.com/redis/go-redis/v9"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"
)

// run is `make bench`: the limits of Redis and Postgres, then the proxies side by side (wrk and
// the in-process load generator), then the settle lag, then one table.
func run(ctx context.Context, o options) error {
	began := time.Now()
	r := &rig{o: o}
	defer r.close()
	if o.pgOnly {
		return r.pgOnly(ctx)
	}
	if o.waitOnly {
		w, err := measureWait(ctx, o)
		if err != nil {
			return fmt.Errorf("wait: %w", err)
		}
		printWait(w)
		return nil
	}
	if err := r.build(ctx); err != nil {
		return err
	}
	if o.viewsOnly {
		v, err := r.views(ctx)
		if err != nil {
			return fmt.Errorf("views: %w", err)
		}
		printViews(v, o)
		fmt.Printf("%s\nbench took %s\n", r.machine, time.Since(began).Round(time.Second))
		return nil
	}
	lim := &limits{}
	var wait *waitCost
	var err error
	if !o.wrkOnly {
		fmt.Fprintln(os.Stderr, "limits: Redis (interleaved rounds), then Postgres …")
		if lim, err = measureLimits(ctx, o, o.redisURL, r.limURL, r.prefix+"l"); err != nil {
			return fmt.Errorf("limits: %w", err)
		}
		fmt.Fprintln(os.Stderr, "WAIT for a replica: private master + replica …")
		if wait, err = measureWait(ctx, o); err != nil {
			// The other rows need no redis-server binary: they go on without these.
			fmt.Fprintf(os.Stderr, "WAIT rows skipped: %v\n", err)
			wait = nil
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err := r.startProxies(ctx); err != nil {
		return err
	}
	if o.wrkDuration > 0 {
		if r.wrkRows, err = r.wrk(ctx); err != nil {
			return err
		}
		if o.wrkOnly || ctx.Err() != nil {
			if ctx.Err() == nil {
				printGoals(os.Stdout, r.wrkRows, nil, nil, nil, o)
			}
			return ctx.Err()
		}
	}
	scs, err := r.scenarios(ctx)
	if err != nil {
		return err
	}
	lags := r.lags(ctx)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	var views *viewsResult
	if o.viewsRows > 0 { // after the others: its proxy has the machine to itself
		if views, err = r.views(ctx); err != nil {
			return fmt.Errorf("views: %w", err)
		}
	}
	printTable(lim, scs, lags)
	if wait != nil {
		printWait(wait)
	}
	printGoals(os.Stdout, r.wrkRows, lim, scs, lags, r.o)
	printViews(views, o)
	fmt.Printf("%s\nbench took %s\n", r.machine, time.Since(began).Round(time.Second))
	return nil
}

// rig is what a bench run sets up: the proxy binary, a Postgres schema per proxy, a Redis
// prefix, the three proxies and their keys. close undoes all of it; the shared servers are never
// flushed.
type rig struct {
	o       options
	tmp     string
	bin     string
	machine string
	id      int64
	prefix  string
	undo    []func()

	proxyURL, limURL, coURL, baseURL string

	base, esc, co                     *proxyProc
	keys, hot, coKeys, coHot, fitKeys []string
	wrkRows                           []*wrkScenario // the wrk side by side's rows, once run
}

// close runs the clean-ups in reverse order.
func (r *rig) close() {
	for i := len(r.undo) - 1; i >= 0; i-- {
		r.undo[i]()
	}
}

// schema makes a Postgres schema of its own for one ledger and returns its URL.
func (r *rig) schema(ctx context.Context, suffix string) (string, error) {
	url, drop, err := benchSchema(ctx, r.o.databaseURL, fmt.Sprintf("escbench_%d%s", r.id, suffix))
	if err != nil {
		return "", err
	}
	r.undo = append(r.undo, drop)
	return url, nil
}

// build compiles the proxy and makes the schemas and the prefix.
func (r *rig) build(ctx context.Context) error {
	tmp, err := os.MkdirTemp("", "escrow-bench-")
	if err != nil {
		return err
	}
	r.tmp = tmp
	r.undo = append(r.undo, func() { os.RemoveAll(tmp) })
	r.bin = filepath.Join(tmp, "proxy")
	fmt.Fprintln(os.Stderr, "building the proxy …")
	// examples/proxy is package server with the fake upstream built in (UPSTREAM_URL unset) on the
	// given Redis and Postgres: the proxy's CPU per request includes the upstream's, as in every
	// earlier table. (cmd/escrow, the production binary, carries no fake upstream.)
	build := exec.CommandContext(ctx, "go", "build", "-o", r.bin, "./examples/proxy")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("build proxy: %w", err)
	}
	o := r.o
	r.machine = describeMachine(ctx, o)
	fmt.Fprintf(os.Stderr, "%s\nclosed-loop scenarios: %s each (%d rounds, in turns) after a %s warm-up, %d clients; settle lag: %.0f req/s for %s\n",
		r.machine, o.duration, o.rounds, o.warmup, o.concurrency, o.lagRate, o.lagDuration)

	// Everything the bench writes lives under its own Redis prefix and Postgres schemas.
	r.id = time.Now().UnixNano() % 1e9
	r.prefix = fmt.Sprintf("escbench%d", r.id)
	r.undo = append(r.undo, func() { cleanRedis(o.redisURL, r.prefix) })
	// Each proxy has a ledger (schema) and key prefix of its own, so that each worker works only
	// for its own proxy's traffic (a worker answers every NOTIFY of its ledger).
	for _, s := range []struct {
		url    *string
		suffix string
	}{{&r.proxyURL, ""}, {&r.limURL, "_lim"}, {&r.coURL, "_co"}, {&r.baseURL, "_base"}} {
		if *s.url, err = r.schema(ctx, s.suffix); err != nil {
			return err
		}
	}
	return nil
}

// env is a proxy's environment on ledger dbURL and Redis prefix pfx.
func (r *rig) env(dbURL, pfx string, more ...string) []string {
	common := []string{"REDIS_URL=" + r.o.redisURL, "ESCROW_MAX_IN_FLIGHT=100000", "DATABASE_URL=" + dbURL, "ESCROW_PREFIX=" + pfx}
	return append(slices.Clone(common), more...)
}

// startProxies starts three proxies on the same Redis and Postgres — the baseline (middleware
// off), escrow, and escrow with reserve coalescing — which take the load in turns, and gives
// the two escrow proxies their orgs and keys.
func (r *rig) startProxies(ctx context.Context) error {
	start := func(env []string) (*proxyProc, error) {
		p, err := startProxy(ctx, r.bin, env)
		if err == nil {
			r.undo = append(r.undo, p.stop)
		}
		return p, err
	}
	var err error
	if r.base, err = start(r.env(r.baseURL, r.prefix+"b", "ESCROW_BENCH_BASELINE=true")); err != nil {
		return err
	}
	escEnv := r.env(r.proxyURL, r.prefix)
	if r.o.profileDir != "" {
		escEnv = append(escEnv, "ESCROW_PPROF_ADDR="+freeAddr())
	}
	if r.esc, err = start(escEnv); err != nil {
		return err
	}
	if r.co, err = start(r.env(r.coURL, r.prefix+"c", "ESCROW_COALESCE=false")); err != nil {
		return err
	}
	for _, k := range []struct {
		p    *proxyProc
		dst  *[]string
		name string
		n    int
	}{{r.esc, &r.keys, "org", r.o.orgs}, {r.esc, &r.hot, "hot", 1}, {r.co, &r.coKeys, "org", r.o.orgs}, {r.co, &r.coHot, "hot", 1}} {
		if *k.dst, err = k.p.provision(k.name, k.n); err != nil {
			return fmt.Errorf("provision: %w", err)
		}
	}
	if r.fitKeys, err = r.esc.provisionFit("fit", r.o.orgs); err != nil {
		return fmt.Errorf("provision: %w", err)
	}
	return nil
}

// wrk runs the wrk side-by-side, with the -before build when one was given.
func (r *rig) wrk(ctx context.Context) ([]*wrkScenario, error) {
	var before *beforeProxy
	if r.o.before != "" {
		bfURL, err := r.schema(ctx, "_before")
		if err != nil {
			return nil, err
		}
		env := r.env(bfURL, r.prefix+"p")
		if r.o.profileDir != "" { // its wrk rounds are profiled too, for the before/after of the profiles
			env = append(env, "ESCROW_PPROF_ADDR="+freeAddr())
		}
		if before, err = startBefore(ctx, r.o.before, r.tmp, env, r.o.orgs); err != nil {
			return nil, fmt.Errorf("before: %w", err)
		}
		r.undo = append(r.undo, before.p.stop)
	}
	return wrkSideBySide(ctx, r.o, r.base, r.esc, r.keys, r.hot, before, coRows{r.co, r.coKeys, r.coHot})
}

const chatPath = "/v1/chat/completions"

// scenarios are the closed-loop runs, in rounds and in turns, after a warm-up each.
type scenarios struct {
	bPlain, ePlain, cPlain, eHot, cHot, bStream, eStream, eFit loadResult
	orgs                                                       int
}

func (r *rig) scenarios(ctx context.Context) (*scenarios, error) {
	o := r.o
	type scenario struct {
		p    *proxyProc
		name string
		keys []string
		body []byte
		dst  *loadResult
	}
	var res scenarios
	res.orgs = o.orgs
	many := fmt.Sprintf("%d orgs", o.orgs)
	scs := []scenario{
		{r.base, "baseline json", []string{"sk-none"}, plainBody, &res.bPlain},
		{r.esc, "escrow json, " + many, r.keys, plainBody, &res.ePlain},
		{r.co, "escrow, coalesce off, json, " + many, r.coKeys, plainBody, &res.cPlain},
		{r.esc, "escrow json, 1 hot org", r.hot, plainBody, &res.eHot},
		{r.co, "escrow, coalesce off, json, 1 hot org", r.coHot, plainBody, &res.cHot},
		{r.base, "baseline stream", []string{"sk-none"}, streamBody, &res.bStream},
		{r.esc, "escrow stream, " + many, r.keys, streamBody, &res.eStream},
		{r.esc, "escrow json fitted, " + many, r.fitKeys, fitBody, &res.eFit},
	}
	spec := func(sc scenario, d time.Duration) loadSpec {
		return loadSpec{Name: sc.name, URL: sc.p.base + chatPath, Keys: sc.keys, Body: sc.body, Concurrency: o.concurrency, Duration: d}
	}
	fmt.Fprintf(os.Stderr, "proxies: %d rounds of %s per scenario, in turns …\n", o.rounds, o.duration/time.Duration(o.rounds))
	for _, sc := range scs {
		_ = runLoad(ctx, spec(sc, o.warmup)) // warm-up: connections, caches, orgs warm in Redis
	}
	for range o.rounds {
		for _, sc := range scs {
			sc.dst.merge(sc.p.measure(ctx, spec(sc, o.duration/time.Duration(o.rounds))))
		}
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if o.profileDir != "" {
		if err := r.esc.profile(ctx, o, r.esc.base+chatPath, r.keys); err != nil {
			return nil, fmt.Errorf("profile: %w", err)
		}
	}
	return &res, nil
}

// lagRun is one open-loop run and the settle lag it saw.
type lagRun struct {
	r                  loadResult
	p50, p99           string
	n                  int64
	pending, unsettled float64
	drain              time.Duration
}

// lags measures the settle lag at a steady rate (open loop), on each escrow proxy in turn (the
// histograms of both processes are summed; only the loaded one moves): the goal's rate on both
// proxies, then half of it (what this machine sustains with room to spare, when the goal's rate
// is past its capacity).
func (r *rig) lags(ctx context.Context) []lagRun {
	r.base.stop()
	waitSettled(r.esc, 60*time.Second)
	waitSettled(r.co, 60*time.Second)
	on := func(p *proxyProc, name string, rate float64, keys []string) lagRun {
		var l lagRun
		b1, b2 := scrapeHistogram(r.esc, "escrow_settle_lag_seconds"), scrapeHistogram(r.co, "escrow_settle_lag_seconds")
		l.r = p.measure(ctx, loadSpec{Name: fmt.Sprintf("%s json, open loop %.0f/s", name, rate), URL: p.base + chatPath, Keys: keys, Body: plainBody, Rate: rate, Concurrency: 4096, Duration: r.o.lagDuration})
		l.pending = scrapeGauge(p, "escrow_worker_pending_events")
		l.unsettled = scrapeGauge(p, "escrow_worker_unsettled_entries")
		l.drain = waitSettled(p, 60*time.Second)
		a1, a2 := scrapeHistogram(r.esc, "escrow_settle_lag_seconds"), scrapeHistogram(r.co, "escrow_settle_lag_seconds")
		l.p50, l.p99, l.n = lagQuantiles(b1.plus(b2), a1.plus(a2))
		return l
	}
	lags := []lagRun{on(r.esc, "escrow", r.o.lagRate, r.keys), on(r.co, "escrow, coalesce off,", r.o.lagRate, r.coKeys), on(r.esc, "escrow", r.o.lagRate/2, r.keys)}
	r.esc.stop()
	r.co.stop()
	return lags
}

// printTable prints the run's table and its notes.
func printTable(lim *limits, s *scenarios, lags []lagRun) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\trun\tthroughput/s\tp50\tp99\tproxy CPU/req\tproxy CPU\tloadgen CPU/req\tredis CPU/req\tpg CPU/req\tmachine busy\tratio\tratio of\t")
	row := func(group, name string, tput float64, p50, p99 string, r *loadResult, ratio float64, of string) {
		cpuReq, cpu, lg, busy := "\t", "", "\t\t", ""
		if r != nil {
			cpuReq, cpu = r.cpuPerReq(r.ProxyCPU), fmt.Sprintf("%.0f%%", 100*r.ProxyCPU.Seconds()/r.Elapsed.Seconds())
			lg, busy = r.cpuPerReq(r.LoadCPU)+"\t"+r.cpuPerReq(r.RedisCPU)+"\t"+r.cpuPerReq(r.PostgresCPU), fmt.Sprintf("%.0f%%", 100*r.MachineBusy)
			cpuReq += "\t" + cpu
		}
		rs := ""
		if ratio > 0 {
			rs = fmt.Sprintf("%.2f", ratio)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", group, name, num(tput), p50, p99, cpuReq, lg, busy, rs, of)
	}
	us := func(d time.Duration) string { return d.Round(time.Microsecond).String() }
	row("limit", fmt.Sprintf("redis: raw EVALSHA reserve script, %d conns", lim.conns), lim.rawEvalsha, us(lim.p50Raw), "", nil, 0, "")
	row("limit", fmt.Sprintf("redis: raw EVALSHA, pipelined %d deep", evalPipeDepth), lim.rawPipelined, "", "", nil, ratio(lim.rawPipelined, lim.rawEvalsha), "/ raw EVALSHA")
	row("limit", "redis: Store.Reserve, NoCoalesce", lim.reserve, us(lim.p50Reserve), "", nil, ratio(lim.reserve, lim.rawEvalsha), "reserve / raw EVALSHA")
	row("limit", "redis: Store.Reserve, coalesced", lim.coalesced, us(lim.p50Coalesced), "", nil, ratio(lim.coalesced, lim.rawEvalsha), "coalesced / raw EVALSHA")
	row("limit", "redis: Store.Reserve, NoCoalesce, end-user+requests+tokens limits", lim.reserveUnits, us(lim.p50Units), "", nil,
		ratio(lim.reserveUnits, lim.reserve), "reserve with end-user+requests+tokens limits / reserve with none (goal ≥ 0.8)")
	row("limit", "pg: usage events, 1 row/tx (16 conns)", lim.pgSingle, "", "", nil, 0, "")
	row("limit", "pg: usage events, 100 rows/tx (4 conns)", lim.pgBatch, "", "", nil, 0, "")
	row("limit", "pg: Recorder group commit (256 callers)", lim.recorder, "", "", nil, 0, "")
	row("limit", "accounting: record+account+settle", lim.pipeline, "", "", nil, 0, "")
	row("limit", fmt.Sprintf("  WAL per event: %.2f records, %.0f bytes", lim.walRecords, lim.walBytes), 0, "", "", nil, 0, "pg_stat_wal, whole cluster")
	lr := func(group string, r loadResult, base *loadResult, of string) {
		rt := 0.0
		if base != nil {
			rt = ratio(r.Throughput, base.Throughput)
		}
		row(group, r.Name, r.Throughput, us(r.P50), us(r.P99), &r, rt, of)
	}
	lr("baseline", s.bPlain, nil, "")
	lr("escrow", s.ePlain, &s.bPlain, "/ baseline json")
	lr("co off", s.cPlain, &s.bPlain, "/ baseline json")
	lr("escrow", s.eHot, &s.bPlain, "/ baseline json")
	lr("co off", s.cHot, &s.bPlain, "/ baseline json")
	lr("baseline", s.bStream, nil, "")
	lr("escrow", s.eStream, &s.bStream, "/ baseline stream")
	lr("fit", s.eFit, &s.bPlain, "/ baseline json")
	for _, l := range lags {
		lr("lag", l.r, nil, "")
		row("lag", fmt.Sprintf("  settle lag (%d entries)", l.n), 0, l.p50, l.p99, nil, 0, "recorded → in Redis")
		fmt.Fprintf(w, "lag\t  backlog at the end of the run\t\t%.0f events\t%.0f entries\t\t\t\t\t\t\t\t%s to drain\t\n", l.pending, l.unsettled, l.drain.Round(time.Millisecond))
	}
	w.Flush()
	all := []loadResult{s.bPlain, s.bStream, s.ePlain, s.eStream, s.eHot, s.cPlain, s.cHot, s.eFit}
	for _, l := range lags {
		all = append(all, l.r)
	}
	for _, r := range all {
		if r.Non2xx+r.Errors > 0 {
			fmt.Printf("note: %s: %d non-2xx %v, %d transport errors\n", r.Name, r.Non2xx, r.Codes, r.Errors)
		}
	}
	fmt.Printf("redis commands per request (escrow json, %d orgs): %.2f (%s)\n", s.orgs, s.ePlain.RedisPerReq, s.ePlain.RedisCmds)
	fmt.Printf("redis commands per request (escrow json fitted, %d orgs: every request refused, then fitted): %.2f (%s); proxy CPU per request %s vs %s unfitted\n",
		s.orgs, s.eFit.RedisPerReq, s.eFit.RedisCmds, s.eFit.cpuPerReq(s.eFit.ProxyCPU), s.ePlain.cpuPerReq(s.ePlain.ProxyCPU))
	fmt.Printf("p50 of the limit rows: one caller at a time. CPU per request: the proxy process (with its built-in fake upstream) and this load generator from /proc/<pid>/stat; Redis from INFO cpu and Postgres from its processes in /proc (both shared servers: other clients' work counts too); machine busy from /proc/stat (every process).\n")
}

// pgOnly is -pg-only: the Postgres limit rows alone, -pg-runs times, each in a schema of its
// own, with the accounting pipeline's WAL per event.
func (r *rig) pgOnly(ctx context.Context) error {
	o := r.o
	r.id = time.Now().UnixNano() % 1e9
	r.prefix = fmt.Sprintf("escbench%d", r.id)
	r.undo = append(r.undo, func() { cleanRedis(o.redisURL, r.prefix) })
	opt, err := redis.ParseURL(o.redisURL)
	if err != nil {
		return err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "run\tpg 1 row/tx\tpg 100 rows/tx\tRecorder\tpipeline events/s\tevents\tWAL records/event\tWAL bytes/event\t")
	for i := range max(o.pgRuns, 1) {
		url, err := r.schema(ctx, fmt.Sprintf("_pg%d", i))
		if err != nil {
			return err
		}
		lim := &limits{}
		if err := pgLimits(ctx, o, lim, url, rdb, fmt.Sprintf("%s%d", r.prefix, i)); err != nil {
			return err
		}
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%d\t%.2f\t%.0f\t\n", i+1, num(lim.pgSingle), num(lim.pgBatch), num(lim.recorder),
			num(lim.pipeline), lim.pipelineEvents, lim.walRecords, lim.walBytes)
	}
	return w.Flush()
}
