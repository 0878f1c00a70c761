package accounting_test

import (
	"context"
	"testing"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/accounting"
)

// TestPostgresOutboxSameTransaction: when the outbox write fails, the change that triggered it
// is rolled back with it (a credit, an adjustment, the accounting of usage, a revocation): the
// event and its change are one transaction, so neither is ever kept without the other.
func TestPostgresOutboxSameTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, env := newPostgres(t)
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
	if _, _, err := l.CreateWebhook(ctx, "https://example.com/h", accounting.EventTypes); err != nil {
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
	ev := accounting.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: "o", Model: "m", Cost: 200}
	if err := l.RecordUsage(ctx, []accounting.UsageEvent{ev}); err != nil {
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
