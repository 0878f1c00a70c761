package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// The hot path's goals (issue 24), which printGoals reads the run's rows against.
const (
	goalRatio       = 0.45  // wrk holds-on / middleware-off, json, many orgs
	goalPipeline    = 40000 // accounting pipeline, events/s
	goalWALRecords  = 4.0   // WAL records per usage event
	goalLagP99      = 250 * time.Millisecond
	issueRedisPerRq = 2.8 // Redis script calls per request when the work began (the issue's figure)
)

// goalRow is one line of the goals table: what this run measured, what the -before build
// measured in the same wrk rounds ("—" when it has no such row), the goal, and whether it is met
// ("" when this run cannot tell).
type goalRow struct {
	name, now, before, goal, met string
}

// printGoals prints the hot path's goals against this run: the wrk rows side by side with the
// -before build's (when there is one) and the rows only this build runs (the accounting
// pipeline, its WAL, the settle lag, Redis calls per request).
func printGoals(out io.Writer, wrk []*wrkScenario, lim *limits, s *scenarios, lags []lagRun, o options) {
	rows := goalRows(wrk, lim, s, lags, o)
	if len(rows) == 0 {
		return
	}
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\tgoal (hot path)\tnow\tbefore, same run\tgoal\tmet\t")
	for _, r := range rows {
		fmt.Fprintf(w, "\t%s\t%s\t%s\t%s\t%s\t\n", r.name, r.now, r.before, r.goal, r.met)
	}
	w.Flush()
	if o.before == "" {
		fmt.Fprintln(out, "(no -before checkout: the before column is empty; give -before <worktree> to fill it)")
	}
}

// goalRows builds the goals table's rows from what the run measured.
func goalRows(wrk []*wrkScenario, lim *limits, s *scenarios, lags []lagRun, o options) []goalRow {
	row := func(name string) *wrkScenario {
		for _, sc := range wrk {
			if sc.name == name {
				return sc
			}
		}
		return nil
	}
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	us := func(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond)) }
	ms := func(d time.Duration) string { return fmt.Sprintf("%+.3f ms", float64(d)/float64(time.Millisecond)) }
	const dash = "—"

	var rows []goalRow
	orgs := fmt.Sprintf("%d orgs", o.orgs)
	many, hot := "escrow, json, "+orgs, "escrow, json, 1 hot org"
	c1 := fmt.Sprintf("escrow, json, %d orgs, -c1", min(10, o.orgs))
	if now, ok := row(many).vsOff(); ok {
		cpu := goalRow{name: "CPU/request over middleware off, json, " + orgs, now: us(now.cpu), before: dash, goal: "≤ half of before"}
		ratio := goalRow{name: "wrk req/s ratio, json, " + orgs, now: fmt.Sprintf("%.2f", now.ratio), before: dash, goal: fmt.Sprintf("≥ %.2f", goalRatio), met: yes(now.ratio >= goalRatio)}
		if b, ok := row("before: " + many).vsOff(); ok {
			cpu.before, cpu.goal, cpu.met = us(b.cpu), "≤ "+us(b.cpu/2), yes(now.cpu <= b.cpu/2)
			ratio.before = fmt.Sprintf("%.2f", b.ratio)
		}
		rows = append(rows, cpu, ratio)
	}
	if now, ok := row(hot).vsOff(); ok {
		n429 := row(hot).total().n429
		r := goalRow{name: "false 429s, json, 1 hot org (ratio)", now: fmt.Sprintf("%d (%.2f)", n429, now.ratio), before: dash, goal: "0", met: yes(n429 == 0)}
		if b, ok := row("before: " + hot).vsOff(); ok {
			r.before = fmt.Sprintf("%d (%.2f)", row("before: "+hot).total().n429, b.ratio)
		}
		rows = append(rows, r)
	}
	if now, ok := row(c1).vsOff(); ok {
		r := goalRow{name: "p50 over middleware off, one connection", now: ms(now.p50), before: dash, goal: "no worse than before"}
		if b, ok := row("before: " + c1).vsOff(); ok {
			r.before, r.met = ms(b.p50), yes(now.p50 <= b.p50)
		}
		rows = append(rows, r)
	}
	if lim != nil && lim.pipeline > 0 {
		rows = append(rows,
			goalRow{name: "accounting pipeline (record + account + settle)", now: num(lim.pipeline) + " events/s", before: dash, goal: "≥ " + num(goalPipeline), met: yes(lim.pipeline >= goalPipeline)},
			goalRow{name: "WAL records per usage event", now: fmt.Sprintf("%.2f", lim.walRecords), before: dash, goal: fmt.Sprintf("≤ %.0f", goalWALRecords), met: yes(lim.walRecords > 0 && lim.walRecords <= goalWALRecords)})
	}
	if len(lags) > 0 {
		r := goalRow{name: fmt.Sprintf("settle lag p99 at %.0f req/s", o.lagRate), now: lags[0].p99, before: dash, goal: "< " + goalLagP99.String()}
		if d, err := time.ParseDuration(strings.TrimSpace(lags[0].p99)); err == nil {
			r.met = yes(d < goalLagP99)
		}
		rows = append(rows, r)
	}
	if s != nil && s.ePlain.RedisPerReq > 0 {
		rows = append(rows, goalRow{name: "Redis commands per request, the worker's included", now: fmt.Sprintf("%.2f", s.ePlain.RedisPerReq), before: dash,
			goal: fmt.Sprintf("fewer than %.1f (the issue's)", issueRedisPerRq), met: yes(s.ePlain.RedisPerReq < issueRedisPerRq)})
	}
	return rows
}
