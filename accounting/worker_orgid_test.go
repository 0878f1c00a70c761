package accounting_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestWorkerSkipsOrgIDsBeforeTheRule: rows written before the one org-id rule ("ÄÖ",
// "team/a") are left alone with one log line each, instead of failing every settle pass (issue
// 10: "settle pass failed" 252 times), and the other orgs settle normally.
func TestWorkerSkipsOrgIDsBeforeTheRule(t *testing.T) {
	t.Parallel()
	l, env := testutil.PostgresLedger(t)
	ctx := context.Background()
	for _, org := range []string{"ÄÖ", "team/a"} { // as an older version wrote them
		if _, err := env.Pool.Exec(ctx, `INSERT INTO accounts (org_id, balance, ledger_seq) VALUES ($1, 5, 1)`, org); err != nil {
			t.Fatal(err)
		}
		if _, err := env.Pool.Exec(ctx, `INSERT INTO ledger_entries (org_id, seq, delta, kind, ref) VALUES ($1, 1, 5, 'credit', $1)`, org); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.CreateOrg(ctx, "good"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, "good", 7, "pay-good"); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	w := newWorker(t, l, newStore(t, testutil.RealRedis(t), l, balance.Config{}), &accounting.WorkerConfig{Logger: log})
	for range 3 {
		if err := w.Drain(ctx); err != nil {
			t.Fatalf("Drain: %v", err)
		}
	}
	if a, err := l.Account(ctx, "good"); err != nil || a.SettledSeq != 1 {
		t.Fatalf("good org: %+v, %v", a, err)
	}
	if n := strings.Count(logs.String(), "breaks the org-id rule"); n != 2 {
		t.Fatalf("%d log lines about bad org ids, want one per org:\n%s", n, logs.String())
	}
}
