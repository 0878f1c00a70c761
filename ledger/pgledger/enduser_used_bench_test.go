package pgledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
)

// BenchmarkEndUserUsed: one end user with 100,000 charges (and 10,000 of other end users, in a
// schema of its own), a lifetime limit of each end user apart whose window row the account pass
// made: EndUserUsed as of 5 charges before the end (the row less a short tail) against the full
// sum of the end user's charges up to there (what a seed, or EndUserUsed without a row, reads).
// It runs only under -bench (filling the rows takes seconds).
func BenchmarkEndUserUsed(b *testing.B) {
	l, env := testutil.PostgresLedger(b)
	ctx := context.Background()
	const org, many, others = "bench-eu", 100_000, 10_000
	if err := l.CreateOrg(ctx, org); err != nil {
		b.Fatal(err)
	}
	lim, _, err := l.CreateLimit(ctx, org, balance.Limit{Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Lifetime,
		Unit: balance.Money, Cap: balance.MaxAmount})
	if err != nil {
		b.Fatal(err)
	}
	// Charges 1 … many+others: every 11th of another end user; then the account row.
	if _, err := env.Pool.Exec(ctx, `
INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id, end_user, reserved_at, tokens)
SELECT $1, g, -(1 + g % 97), 'charge', gen_random_uuid(), CASE WHEN g % 11 = 0 THEN 'other' || (g % 1000) ELSE 'alice' END,
       now() - interval '1 hour', 10 + g % 13
FROM generate_series(1, $2::bigint) g`, org, many+others); err != nil {
		b.Fatal(err)
	}
	if _, err := env.Pool.Exec(ctx, `UPDATE accounts a SET ledger_seq = s.n, balance = s.d, charged = -s.d
FROM (SELECT count(*) AS n, sum(delta) AS d FROM ledger_entries WHERE org_id = $1) s WHERE a.org_id = $1`, org); err != nil {
		b.Fatal(err)
	}
	// 10 more charges of alice through the account pass: it makes her window row from the ledger.
	var evs []ledger.UsageEvent
	for range 10 {
		evs = append(evs, ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: org, Model: "m", EndUser: "alice", Cost: 5, ReservedAt: time.Now()})
	}
	if err := l.RecordUsage(ctx, evs); err != nil {
		b.Fatal(err)
	}
	for {
		n, err := l.AccountPending(ctx, 100)
		if err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			break
		}
	}
	for _, t := range []string{"ledger_entries", "limit_windows"} {
		if _, err := env.Pool.Exec(ctx, "VACUUM ANALYZE "+t); err != nil {
			b.Fatal(err)
		}
	}
	a, err := l.Account(ctx, org)
	if err != nil {
		b.Fatal(err)
	}
	upto := a.LedgerSeq - 5
	var want int64
	if err := env.Pool.QueryRow(ctx, `SELECT sum(-delta) FROM ledger_entries WHERE org_id = $1 AND kind = 'charge' AND end_user = 'alice' AND seq <= $2`,
		org, upto).Scan(&want); err != nil {
		b.Fatal(err)
	}
	var rows int64
	if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM limit_windows WHERE end_user = 'alice'`).Scan(&rows); err != nil || rows != 1 {
		b.Fatalf("alice's window rows: %d, %v; want the pass's one", rows, err)
	}
	b.Run("EndUserUsed", func(b *testing.B) {
		for b.Loop() {
			got, err := l.EndUserUsed(ctx, org, "alice", []balance.Limit{lim}, upto)
			if err != nil || len(got) != 1 || got[0].Used != want {
				b.Fatalf("EndUserUsed = %+v, %v; want %d", got, err, want)
			}
		}
	})
	full := func(b *testing.B, q interface {
		QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	}) {
		for b.Loop() {
			var got int64
			err := q.QueryRow(ctx, `SELECT coalesce(sum(-delta), 0) FROM ledger_entries
WHERE org_id = $1 AND kind = 'charge' AND end_user = $2 AND seq <= $3`, org, "alice", upto).Scan(&got)
			if err != nil || got != want {
				b.Fatalf("full sum = %d, %v; want %d", got, err, want)
			}
		}
	}
	// The planner's choice here (the schema holds one org: a sequential scan), then the index
	// (an index-only scan of the end user's 100,000 charges: what a ledger of many orgs gets).
	b.Run("FullSum", func(b *testing.B) { full(b, env.Pool) })
	b.Run("FullSumIndexOnly", func(b *testing.B) {
		conn, err := env.Pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Release()
		if _, err := conn.Exec(ctx, "SET enable_seqscan = off"); err != nil {
			b.Fatal(err)
		}
		defer func() { _, _ = conn.Exec(ctx, "RESET enable_seqscan") }()
		full(b, conn)
	})
}
