package pgledger_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
)

// TestPostgresOutboxSameTransaction: when the outbox write fails, the change that triggered it
// is rolled back with it (a credit, an adjustment, the accounting of usage, a revocation): the
// event and its change are one transaction, so neither is ever kept without the other.
func TestPostgresOutboxSameTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, env := testutil.PostgresLedger(t)
	if err := l.CreateOrg(ctx, "o"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, "o", 1_000, "before"); err != nil {
		t.Fatal(err)
	}
	thr := int64(900)
	if err := l.SetLowBalanceThreshold(ctx, "o", &thr); err != nil {
		t.Fatal(err)
	}
	k, _, err := l.CreateKey(ctx, "o")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.CreateWebhook(ctx, "https://example.com/h", ledger.EventTypes); err != nil {
		t.Fatal(err)
	}
	// Every outbox write fails from now on.
	if _, err := env.Pool.Exec(ctx, `ALTER TABLE webhook_events ADD CONSTRAINT test_refuse CHECK (false) NOT VALID`); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, "o", 5, "fails"); err == nil {
		t.Fatal("a credit whose event could not be written was kept")
	}
	if _, _, err := l.Adjust(ctx, "o", -500, "fails-too"); err == nil {
		t.Fatal("an adjustment whose event could not be written was kept")
	}
	if err := l.RevokeKey(ctx, k.ID); err == nil {
		t.Fatal("a revocation whose event could not be written was kept")
	}
	ev := ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: "o", Model: "m", Cost: 200}
	if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.AccountPending(ctx, 10); err == nil {
		t.Fatal("charges whose low-balance event could not be written were kept")
	}
	a, err := l.Account(ctx, "o")
	if err != nil {
		t.Fatal(err)
	}
	if a.Balance != 1_000 || a.LedgerSeq != 1 || a.Pending != 1 {
		t.Fatalf("account %+v; want nothing changed but the pending usage", a)
	}
	var revoked bool
	if err := env.Pool.QueryRow(ctx, `SELECT revoked_at IS NOT NULL FROM api_keys WHERE id = $1`, k.ID).Scan(&revoked); err != nil || revoked {
		t.Fatalf("key revoked = %v (%v); want the revocation rolled back", revoked, err)
	}
	// The outbox writable again: the same calls go through, each with its event.
	if _, err := env.Pool.Exec(ctx, `ALTER TABLE webhook_events DROP CONSTRAINT test_refuse`); err != nil {
		t.Fatal(err)
	}
	if n, err := l.AccountPending(ctx, 10); err != nil || n != 1 {
		t.Fatalf("AccountPending = %d, %v", n, err)
	}
	if err := l.RevokeKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	var events int
	if err := env.Pool.QueryRow(ctx, `SELECT count(*) FROM webhook_events`).Scan(&events); err != nil || events != 2 {
		t.Fatalf("%d events (%v), want balance.low and key.revoked", events, err)
	}
}

// TestPostgresLimitCrossedSameTransaction: a limit.crossed event is written in the transaction
// of the charges that cross (when it cannot be written, the charges and the window's spend are
// rolled back with it), and only the orgs with limits have window rows.
func TestPostgresLimitCrossedSameTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, env := testutil.PostgresLedger(t)
	for _, org := range []string{"o", "bare"} {
		if err := l.CreateOrg(ctx, org); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(ctx, org, 1_000, "pay-"+org); err != nil {
			t.Fatal(err)
		}
	}
	lim, _, err := l.CreateLimit(ctx, "o", balance.Limit{Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Lifetime, Unit: balance.Money, Cap: 100})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.CreateWebhook(ctx, "https://example.com/h", []ledger.EventType{ledger.EventLimitCrossed}); err != nil {
		t.Fatal(err)
	}
	charge := func(org string, cost int64) {
		t.Helper()
		ev := ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: org, Model: "m", Cost: cost, ReservedAt: time.Now()}
		if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
	}
	windows := func() (rows, used int64) {
		t.Helper()
		if err := env.Pool.QueryRow(ctx, `SELECT count(*), coalesce(sum(used), 0) FROM limit_windows`).Scan(&rows, &used); err != nil {
			t.Fatal(err)
		}
		return rows, used
	}
	charge("o", 10)
	charge("bare", 10)
	if n, err := l.AccountPending(ctx, 10); err != nil || n != 2 {
		t.Fatalf("AccountPending = %d, %v", n, err)
	}
	if rows, used := windows(); rows != 1 || used != 10 {
		t.Fatalf("%d window rows with %d used; want o's one with 10 (none for an org without limits)", rows, used)
	}
	if _, err := env.Pool.Exec(ctx, `ALTER TABLE webhook_events ADD CONSTRAINT test_refuse CHECK (false) NOT VALID`); err != nil {
		t.Fatal(err)
	}
	charge("o", 80) // 90: crosses 80 %
	if _, err := l.AccountPending(ctx, 10); err == nil {
		t.Fatal("charges whose limit.crossed event could not be written were kept")
	}
	if a, err := l.Account(ctx, "o"); err != nil || a.Balance != 990 || a.LedgerSeq != 2 || a.Pending != 1 {
		t.Fatalf("account %+v (%v); want the charge rolled back", a, err)
	}
	if rows, used := windows(); rows != 1 || used != 10 {
		t.Fatalf("window spend %d (%d rows); want 10: rolled back with the charge", used, rows)
	}
	if _, err := env.Pool.Exec(ctx, `ALTER TABLE webhook_events DROP CONSTRAINT test_refuse`); err != nil {
		t.Fatal(err)
	}
	if n, err := l.AccountPending(ctx, 10); err != nil || n != 1 {
		t.Fatalf("AccountPending = %d, %v", n, err)
	}
	var body string
	if err := env.Pool.QueryRow(ctx, `SELECT body FROM webhook_events WHERE type = 'limit.crossed'`).Scan(&body); err != nil {
		t.Fatal(err)
	}
	var ev struct {
		Data map[string]any `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &ev); err != nil {
		t.Fatal(err)
	}
	if d := ev.Data; d["limit_id"] != lim.ID || d["threshold"] != 80.0 || d["used"] != 90.0 || d["cap"] != 100.0 || d["window_start"] != nil ||
		d["window"] != "lifetime" || d["scope"] != "org" || d["scope_id"] != "" {
		t.Fatalf("event data %v", d)
	}
}
