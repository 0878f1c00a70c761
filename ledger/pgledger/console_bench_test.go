package pgledger_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
)

// BenchmarkConsoleLarge measures the operator's reads on a ledger of ESCROW_BENCH_CONSOLE_ROWS
// charges (make bench-console: 10,000,000) spread over 1,000 orgs and ~11 days (one request per
// 0.1 s): the newest page of an org's entries and the page after it, an org's usage report for a
// day and for everything, one request by id, the list of orgs, and the top spenders of an hour.
// Without the variable it does not run (filling 10M rows takes minutes).
func BenchmarkConsoleLarge(b *testing.B) {
	rows, _ := strconv.Atoi(os.Getenv("ESCROW_BENCH_CONSOLE_ROWS"))
	if rows <= 0 {
		b.Skip("set ESCROW_BENCH_CONSOLE_ROWS (make bench-console)")
	}
	const orgs = 1000
	l, env := testutil.PostgresLedger(b)
	ctx := context.Background()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	began := time.Now()
	// Row i belongs to org i mod 1000 with seq i/1000+1 (no gap per org), costs 1..100, and was
	// recorded at t0 + i × 100 ms; each charge has its accounted usage event (same id).
	for _, q := range []string{
		`INSERT INTO accounts (org_id, balance, ledger_seq, settled_seq)
		 SELECT 'org' || k, 0, 0, 0 FROM generate_series(0, 999) k`,
		`INSERT INTO usage_events (id, org_id, model, key_id, endpoint, prompt_tokens, completion_tokens, cost, hold_amount,
		                           status, seq, created_at)
		 SELECT md5(i::text)::uuid, 'org' || (i % 1000), 'm' || (i % 7), 'key_' || (i % 5000), '/v1/chat/completions',
		        100 + i % 50, 20 + i % 30, 1 + i % 100, 5000, 'accounted', i / 1000 + 1, $1::timestamptz + i * interval '100 ms'
		 FROM generate_series(0, $2::bigint - 1) i`,
		`INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id, created_at)
		 SELECT 'org' || (i % 1000), i / 1000 + 1, -(1 + i % 100), 'charge', md5(i::text)::uuid, $1::timestamptz + i * interval '100 ms'
		 FROM generate_series(0, $2::bigint - 1) i`,
		`UPDATE accounts a SET balance = s.b, ledger_seq = s.n, settled_seq = s.n
		 FROM (SELECT org_id, sum(delta) b, max(seq) n FROM ledger_entries GROUP BY org_id) s WHERE s.org_id = a.org_id`,
		// What autosummarize and autovacuum do in a running ledger: the BRIN ranges of the rows
		// just filled are summarized.
		`SELECT brin_summarize_new_values('usage_events_at_brin')`,
		`ANALYZE accounts, api_keys, usage_events, ledger_entries`, // this schema's tables only
	} {
		var err error
		if strings.Contains(q, "$1") {
			_, err = env.Pool.Exec(ctx, q, t0, rows)
		} else {
			_, err = env.Pool.Exec(ctx, q)
		}
		if err != nil {
			b.Fatalf("fill: %v\n%s", err, q)
		}
	}
	b.Logf("filled %d charges over %d orgs in %s", rows, orgs, time.Since(began).Round(time.Second))

	org := "org42"
	first, err := l.ListEntries(ctx, org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Limit: 100}})
	if err != nil || len(first.Data) != 100 || first.Next == "" {
		b.Fatalf("first page: %d rows, next %q, %v", len(first.Data), first.Next, err)
	}
	span := time.Duration(rows) * 100 * time.Millisecond
	mid := t0.Add(span / 2).Truncate(24 * time.Hour)
	id := first.Data[50].HoldID
	for _, c := range []struct {
		name string
		op   func() error
	}{
		{"entries first page", func() error {
			_, err := l.ListEntries(ctx, org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Limit: 100}})
			return err
		}},
		{"entries next page", func() error {
			_, err := l.ListEntries(ctx, org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Limit: 100, Cursor: first.Next}})
			return err
		}},
		{"entries of one day, first page", func() error {
			_, err := l.ListEntries(ctx, org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Limit: 100}, From: mid, To: mid.Add(24 * time.Hour)})
			return err
		}},
		{"usage by model, one day", func() error {
			_, err := l.UsageReport(ctx, org, ledger.UsageQuery{GroupBy: ledger.GroupByModel, From: mid, To: mid.Add(24 * time.Hour)})
			return err
		}},
		{"usage by day, everything", func() error {
			_, err := l.UsageReport(ctx, org, ledger.UsageQuery{GroupBy: ledger.GroupByDay})
			return err
		}},
		{"request by id", func() error { _, err := l.Request(ctx, id); return err }},
		{"orgs first page", func() error {
			_, err := l.ListOrgs(ctx, ledger.ListQuery{Limit: 100})
			return err
		}},
		{"top spenders, one hour", func() error {
			_, err := l.TopSpenders(ctx, ledger.TopQuery{From: mid, To: mid.Add(time.Hour)})
			return err
		}},
	} {
		b.Run(c.name, func(b *testing.B) {
			for range b.N {
				if err := c.op(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
