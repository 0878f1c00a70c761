package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
)

// The customer views under load (issue 34, item 1): one org whose ledger holds a million charges
// polls every customer view with many clients while other orgs stream through the same proxy
// (default configuration: the journal on, the views on their own pool and per-key rate). The
// others must not notice: their p99 within goalViewsP99 of the same streams without the
// pollers, no 503, and every stream whose content they saw billed exactly once.
const (
	goalViewsP99 = 3.0
	viewsOrg     = "poll-000"
)

// viewPollPaths are the customer views the pollers call, in turn.
var viewPollPaths = []string{"/api/v1/key", "/api/v1/credits", "/dashboard/billing/subscription", "/dashboard/billing/usage",
	"/v1/dashboard/billing/subscription", "/v1/dashboard/billing/usage"}

// viewsResult is what the views row measured.
type viewsResult struct {
	rows         int64         // charges of the polling org
	fill         time.Duration // how long writing them took
	warm         streamResult  // the warm-up's streams (billed too)
	alone        streamResult  // the other orgs' streams, no pollers
	polled       streamResult  // the same, with the pollers
	polls        loadResult    // the pollers' calls
	charges      int64         // charge entries of the streaming orgs in the ledger
	distinctHold int64         // of which distinct hold ids
	took         time.Duration // the row's measured part (rounds and the settle), without the fill
}

// streamResult is a streaming run: the latencies of complete streams (loadResult) and what the
// clients saw of each answer.
type streamResult struct {
	loadResult
	served   int64 // answers that delivered content (a content chunk reached the client)
	complete int64 // of which ended with data: [DONE]
	s503     int64
}

func (s *streamResult) add(b streamResult) {
	s.loadResult.merge(b.loadResult)
	s.served += b.served
	s.complete += b.complete
	s.s503 += b.s503
}

// views runs the row on a proxy of its own (its own ledger schema and Redis prefix).
func (r *rig) views(ctx context.Context) (*viewsResult, error) {
	o := r.o
	url, err := r.schema(ctx, "_views")
	if err != nil {
		return nil, err
	}
	pfx := r.prefix + "v"
	p, err := startProxy(ctx, r.bin, r.env(url, pfx))
	if err != nil {
		return nil, err
	}
	defer p.stop()
	streamKeys, err := p.provision("strm", o.viewsOrgs)
	if err != nil {
		return nil, fmt.Errorf("views: provision: %w", err)
	}
	pollKeys, keyIDs, err := p.pollerOrg(o.viewsPollers)
	if err != nil {
		return nil, fmt.Errorf("views: poller org: %w", err)
	}
	res := &viewsResult{rows: o.viewsRows}
	fmt.Fprintf(os.Stderr, "views: writing %s charges of %s into its ledger …\n", num(float64(o.viewsRows)), viewsOrg)
	began := time.Now()
	if err := fillCharges(ctx, url, viewsOrg, keyIDs, o.viewsRows); err != nil {
		return nil, fmt.Errorf("views: fill: %w", err)
	}
	res.fill = time.Since(began)
	// The org's hot balance was seeded before the fill: drop it, so the next call seeds from the
	// ledger's account row (a million entries are never replayed into Redis).
	if err := dropOrgKeys(ctx, o.redisURL, pfx, viewsOrg); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "views: %s charges in %s\n", num(float64(o.viewsRows)), res.fill.Round(time.Second))

	stream := func(d time.Duration, name string) streamResult {
		return streamLoad(ctx, p.base+chatPath, streamKeys, o.viewsClients, d, name)
	}
	began = time.Now()
	res.warm = stream(o.warmup, "views: streams (warm-up)")
	round := o.viewsDuration / time.Duration(o.rounds)
	for range o.rounds {
		res.alone.add(stream(round, "streams, no pollers"))
		stop := make(chan struct{})
		polls := make(chan loadResult, 1)
		go func() { polls <- pollViews(p.base, pollKeys, stop) }()
		res.polled.add(stream(round, fmt.Sprintf("streams, %d pollers", len(pollKeys))))
		close(stop)
		res.polls.merge(<-polls)
	}
	waitSettled(p, 60*time.Second)
	if res.charges, res.distinctHold, err = countCharges(ctx, url, "strm-"); err != nil {
		return nil, err
	}
	res.took = time.Since(began)
	return res, nil
}

// pollerOrg creates the polling org with n keys (one per poller) and returns the keys and their
// ids.
func (p *proxyProc) pollerOrg(n int) (keys, ids []string, err error) {
	if err := p.adminCall("POST", "/orgs", map[string]string{"id": viewsOrg}, nil); err != nil {
		return nil, nil, err
	}
	if err := p.adminCall("POST", "/orgs/"+viewsOrg+"/credits", map[string]any{"amount": int64(1e13), "reference": viewsOrg + "-funds"}, nil); err != nil {
		return nil, nil, err
	}
	for range n {
		var k struct{ ID, Key string }
		if err := p.adminCall("POST", "/orgs/"+viewsOrg+"/keys", nil, &k); err != nil {
			return nil, nil, err
		}
		keys, ids = append(keys, k.Key), append(ids, k.ID)
	}
	return keys, ids, nil
}

// fillCharges writes rows accounted charges of org into the ledger at url, server-side (INSERT
// … SELECT generate_series, as make bench-console fills its ledger): each with its usage event
// (same id), spread over the org's keys and the last rows × 100 ms, costing 1..100; then the
// account row and the views' totals (migration 021) as the account pass would have left them.
func fillCharges(ctx context.Context, url, org string, keyIDs []string, rows int64) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	var seq0 int64
	if err := pool.QueryRow(ctx, `SELECT ledger_seq FROM accounts WHERE org_id = $1`, org).Scan(&seq0); err != nil {
		return fmt.Errorf("account of %s: %w", org, err)
	}
	t0 := time.Now().Add(-time.Duration(rows) * 100 * time.Millisecond)
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO usage_events (id, org_id, model, key_id, endpoint, prompt_tokens, completion_tokens, cost, hold_amount, status, created_at)
		  SELECT md5('v' || i)::uuid, $1, 'bench-model', ($4::text[])[1 + i % cardinality($4::text[])], '/v1/chat/completions',
		         100 + i % 50, 20 + i % 30, 1 + i % 100, 5000, 'recorded', $2::timestamptz + i * interval '100 ms'
		  FROM generate_series(0, $3::bigint - 1) i`, []any{org, t0, rows, keyIDs}},
		{`INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id, key_id, reserved_at, created_at)
		  SELECT $1, $5::bigint + 1 + i, -(1 + i % 100), 'charge', md5('v' || i)::uuid, ($4::text[])[1 + i % cardinality($4::text[])],
		         $2::timestamptz + i * interval '100 ms', $2::timestamptz + i * interval '100 ms'
		  FROM generate_series(0, $3::bigint - 1) i`, []any{org, t0, rows, keyIDs, seq0}},
		{`UPDATE accounts a SET balance = a.balance + s.d, ledger_seq = s.n, settled_seq = s.n, charged = a.charged - s.d
		  FROM (SELECT sum(delta) FILTER (WHERE seq > $2) d, max(seq) n FROM ledger_entries WHERE org_id = $1) s
		  WHERE a.org_id = $1`, []any{org, seq0}},
		{`UPDATE api_keys k SET charged = k.charged + s.c
		  FROM (SELECT key_id, sum(-delta) c FROM ledger_entries WHERE org_id = $1 AND seq > $2 GROUP BY key_id) s
		  WHERE k.id = s.key_id`, []any{org, seq0}},
		{`INSERT INTO key_days (key_id, day, charged)
		  SELECT key_id, (reserved_at AT TIME ZONE 'UTC')::date, sum(-delta) FROM ledger_entries
		  WHERE org_id = $1 AND seq > $2 GROUP BY 1, 2
		  ON CONFLICT (key_id, day) DO UPDATE SET charged = key_days.charged + EXCLUDED.charged`, []any{org, seq0}},
		{`ANALYZE accounts, api_keys, key_days, usage_events, ledger_entries`, nil},
	} {
		if _, err := pool.Exec(ctx, q.sql, q.args...); err != nil {
			return fmt.Errorf("%w\n%s", err, q.sql)
		}
	}
	return nil
}

// dropOrgKeys deletes org's keys under the Redis prefix pfx (its hot balance and counters), so
// that its next request seeds it from the ledger.
func dropOrgKeys(ctx context.Context, redisURL, pfx, org string) error {
	opt, err := redis.ParseURL(redisURL)
	if err != nil {
		return err
	}
	c := redis.NewClient(opt)
	defer c.Close()
	k := balance.KeysOf(pfx, org)
	return c.Del(ctx, k.Acct, k.Holds, k.Hexp, k.Hfin, k.Gone, k.U).Err()
}

// countCharges counts the charge entries of the orgs whose id starts with orgPrefix, and their
// distinct hold ids (a stream billed twice would have two entries of one hold).
func countCharges(ctx context.Context, url, orgPrefix string) (n, distinct int64, err error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return 0, 0, err
	}
	defer pool.Close()
	err = pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT hold_id) FROM ledger_entries WHERE kind = 'charge' AND starts_with(org_id, $1)`,
		orgPrefix).Scan(&n, &distinct)
	return n, distinct, err
}

// streamLoad is a closed loop of conc clients streaming streamBody for d, the keys in turn. A
// 2xx answer that delivered a content chunk is served (it must be billed), complete when it
// ended with data: [DONE]; latencies are those of complete streams.
func streamLoad(ctx context.Context, url string, keys []string, conc int, d time.Duration, name string) streamResult {
	c := newClient(conc)
	defer c.CloseIdleConnections()
	rec := &recorder{status: map[int]int64{}, codes: map[string]int64{}}
	var served, complete, s503, n atomic.Int64
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := n.Add(1)
				t0 := time.Now()
				st, code, content, done, err := streamOne(c, url, keys[int(i)%len(keys)])
				if content {
					served.Add(1)
				}
				if done {
					complete.Add(1)
				}
				if st == http.StatusServiceUnavailable {
					s503.Add(1)
				}
				if err == nil && st/100 == 2 && !done {
					st, code = 299, "no [DONE]" // served, but not a complete stream: not a latency sample
				}
				rec.add(time.Since(t0), st, code, err)
			}
		})
	}
	wg.Wait()
	r := loadResult{Name: name, Sent: rec.sent.Load(), OK: rec.ok.Load(), Non2xx: rec.bad.Load(), Errors: rec.errs.Load(),
		Status: rec.status, Codes: rec.codes, Elapsed: time.Since(start), samples: rec.samples}
	r.summarize()
	fmt.Fprintf(os.Stderr, "  %s  served %d, complete %d, 503 %d\n", r.String(), served.Load(), complete.Load(), s503.Load())
	return streamResult{loadResult: r, served: served.Load(), complete: complete.Load(), s503: s503.Load()}
}

// streamOne sends one streaming request and reads its answer to the end.
func streamOne(c *http.Client, url, key string) (status int, code string, content, done bool, err error) {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(streamBody))
	if err != nil {
		return 0, "", false, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", false, false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		_, after, _ := strings.Cut(string(b), `"code":"`)
		code, _, _ = strings.Cut(after, `"`)
		return resp.StatusCode, code, false, false, nil
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "data: [DONE]":
			done = true
		case strings.HasPrefix(line, "data: ") && strings.Contains(line, `"content"`):
			content = true
		}
	}
	return resp.StatusCode, "", content, done, sc.Err()
}

// pollViews calls the customer views with one client per key, back to back, until stop.
func pollViews(base string, keys []string, stop <-chan struct{}) loadResult {
	c := newClient(len(keys))
	defer c.CloseIdleConnections()
	rec := &recorder{status: map[int]int64{}, codes: map[string]int64{}}
	start := time.Now()
	var wg sync.WaitGroup
	for w, key := range keys {
		wg.Go(func() {
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				t0 := time.Now()
				req, _ := http.NewRequest(http.MethodGet, base+viewPollPaths[i%len(viewPollPaths)], nil)
				req.Header.Set("Authorization", "Bearer "+key)
				resp, err := c.Do(req)
				if err != nil {
					rec.add(time.Since(t0), 0, "", err)
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				code := ""
				if resp.StatusCode/100 != 2 {
					_, after, _ := strings.Cut(string(b), `"code":"`)
					code, _, _ = strings.Cut(after, `"`)
				}
				rec.add(time.Since(t0), resp.StatusCode, code, nil)
			}
		})
	}
	wg.Wait()
	r := loadResult{Name: "views", Sent: rec.sent.Load(), OK: rec.ok.Load(), Non2xx: rec.bad.Load(), Errors: rec.errs.Load(),
		Status: rec.status, Codes: rec.codes, Elapsed: time.Since(start), samples: rec.samples}
	r.summarize()
	return r
}

// printViews prints the views row and its goals.
func printViews(v *viewsResult, o options) {
	if v == nil {
		return
	}
	us := func(d time.Duration) string { return d.Round(time.Microsecond).String() }
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(w, "views\t%d orgs streaming, %d clients; 1 org of %s charges polling the views\tstreams/s\tp50\tp99\tserved\t[DONE]\t503\t\n",
		o.viewsOrgs, o.viewsClients, num(float64(v.rows)))
	for _, s := range []streamResult{v.alone, v.polled} {
		fmt.Fprintf(w, "views\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t\n", s.Name, num(s.Throughput), us(s.P50), us(s.P99), s.served, s.complete, s.s503)
	}
	codes := []string{}
	for k, n := range v.polls.Codes {
		codes = append(codes, fmt.Sprintf("%s ×%d", k, n))
	}
	fmt.Fprintf(w, "views\t%d pollers (a key each), %s\t%s calls/s\t%s\t%s\t%d ok\t\t%d\t\n", o.viewsPollers, strings.Join(codes, ", "),
		num(float64(v.polls.Sent)/v.polls.Elapsed.Seconds()), us(v.polls.P50), us(v.polls.P99), v.polls.OK, v.polls.Status[http.StatusServiceUnavailable])
	w.Flush()
	ratio := 0.0
	if v.alone.P99 > 0 {
		ratio = float64(v.polled.P99) / float64(v.alone.P99)
	}
	served := v.warm.served + v.alone.served + v.polled.served
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	w = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "\tgoal (views under load)\tnow\tgoal\tmet\t")
	fmt.Fprintf(w, "\tothers' stream p99 with the pollers / without\t%.2f (%s / %s)\t≤ %.0f\t%s\t\n", ratio, us(v.polled.P99), us(v.alone.P99), goalViewsP99, yes(ratio > 0 && ratio <= goalViewsP99))
	n503 := v.warm.s503 + v.alone.s503 + v.polled.s503
	fmt.Fprintf(w, "\tothers' 503s\t%d\t0\t%s\t\n", n503, yes(n503 == 0))
	fmt.Fprintf(w, "\tserved streams billed once (charges / distinct holds / streams served, warm-up included)\t%d / %d / %d\tall equal\t%s\t\n",
		v.charges, v.distinctHold, served, yes(v.charges == v.distinctHold && v.charges == served))
	w.Flush()
	fmt.Printf("views row: fill %s (not in the row), measured %s\n", v.fill.Round(time.Second), v.took.Round(time.Second))
}
