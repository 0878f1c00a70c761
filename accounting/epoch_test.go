package accounting_test

import (
	"context"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestRestoreReusesSequences is the directed epoch test: the ledger is restored from a backup
// taken before its last two entries, the epoch generation is raised, and new entries reuse
// sequence numbers that the hot balance's watermark already passed. The old acct must not be
// trusted (its watermark would swallow the new entries as "already applied"): settle answers
// COLD, the org is reseeded, and Redis ends equal to the restored ledger.
func TestRestoreReusesSequences(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	l, err := pgledger.Open(ctx, pg.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	store := newStore(t, env, l, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	if err := l.CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.Credit(ctx, "acme", 1000, "c1"); err != nil { // seq 1
		t.Fatal(err)
	}
	costs := []int64{11, 22, 33} // seq 2, 3, 4
	for _, c := range costs {
		id := newID()
		if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 50}); err != nil {
			t.Fatal(err)
		}
		if err := l.RecordUsage(ctx, []ledger.UsageEvent{{ID: id, Org: "acme", Model: "m", Cost: c, HoldAmount: 50, CreatedAt: time.Now()}}); err != nil {
			t.Fatal(err)
		}
		if err := w.Drain(ctx); err != nil {
			t.Fatal(err)
		}
	}
	old, _ := store.State(ctx, "acme")
	if old.Watermark != 4 || old.Balance != 1000-66 {
		t.Fatalf("before the restore: %+v", old)
	}

	// The restore: the backup ends after seq 2; the last two charges are forgotten.
	for _, q := range []string{
		`DELETE FROM ledger_entries WHERE org_id = 'acme' AND seq > 2`,
		`DELETE FROM usage_events WHERE org_id = 'acme' AND id NOT IN (SELECT hold_id FROM ledger_entries WHERE hold_id IS NOT NULL)`,
		`UPDATE accounts SET balance = 989, ledger_seq = 2, settled_seq = 2 WHERE org_id = 'acme'`,
	} {
		if _, err := pg.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	epoch, err := l.RaiseEpoch(ctx)
	if err != nil || epoch.Gen < 2 {
		t.Fatalf("raise epoch: %+v %v", epoch, err)
	}

	// New entries reuse seq 3 and 4.
	if _, _, err := w.Credit(ctx, "acme", 500, "c2"); err != nil { // seq 3 of the new timeline
		t.Fatal(err)
	}
	id := newID()
	if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: "acme", HoldID: id, Amount: 50}); err != nil {
		t.Fatal(err)
	}
	if err := l.RecordUsage(ctx, []ledger.UsageEvent{{ID: id, Org: "acme", Model: "m", Cost: 7, HoldAmount: 50, CreatedAt: time.Now()}}); err != nil {
		t.Fatal(err)
	}
	if err := w.Drain(ctx); err != nil { // seq 4 of the new timeline
		t.Fatal(err)
	}
	st, _ := store.State(ctx, "acme")
	acct, _ := l.Account(ctx, "acme")
	if st.Epoch != epoch || st.Watermark != 4 || acct.LedgerSeq != 4 || st.Holds != 0 {
		t.Fatalf("after the restore: redis %+v, ledger %+v, epoch %+v", st, acct, epoch)
	}
	if want := int64(989 + 500 - 7); st.Balance != want || acct.Balance != want {
		t.Fatalf("after the restore: redis %d, ledger %d, want %d", st.Balance, acct.Balance, want)
	}
	// A store of another process that still caches the old epoch never writes it back.
	other := newStore(t, env, l, balance.Config{})
	other.ObserveEpoch(balance.Epoch{Gen: 1, ID: "stale"})
	if other.Epoch() != epoch && other.Epoch().Gen < epoch.Gen {
		t.Fatalf("a lower generation replaced the cached epoch: %+v", other.Epoch())
	}
	if seeded, err := other.Seed(ctx, "acme", balance.Snapshot{Epoch: balance.Epoch{Gen: 1, ID: "stale"}, Balance: 1, Seq: 99}); err != nil || seeded {
		t.Fatalf("a seed of an older generation replaced the acct: %v %v", seeded, err)
	}
}

// TestMemoryRaiseEpoch: after RaiseEpoch the hot balance of the old epoch is dropped and
// reseeded with the same money.
func TestMemoryRaiseEpoch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.MiniRedis(t)
	l := memledger.New()
	store := newStore(t, env, l, balance.Config{})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	if err := l.CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.Credit(ctx, "acme", 300, "c1"); err != nil {
		t.Fatal(err)
	}
	before, _ := l.Epoch(ctx)
	after, err := l.RaiseEpoch(ctx)
	if err != nil || after.Gen != before.Gen+1 || after.ID == before.ID {
		t.Fatalf("raise: %+v → %+v %v", before, after, err)
	}
	if _, _, err := w.Credit(ctx, "acme", 200, "c2"); err != nil {
		t.Fatal(err)
	}
	st, _ := store.State(ctx, "acme")
	if st.Epoch != after || st.Balance != 500 {
		t.Fatalf("after raise: %+v, want epoch %+v balance 500", st, after)
	}
}
