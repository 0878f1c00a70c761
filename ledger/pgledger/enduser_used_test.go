package pgledger_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestEndUserUsedAsDataRole: the proxy may run as the data role (RoleGrants), and EndUserUsed is
// the hot balance's read: with exactly the data role's grants it reads the window row, the
// limit and the charges, and answers what the owner does.
func TestEndUserUsedAsDataRole(t *testing.T) {
	t.Parallel()
	owner, env := testutil.PostgresLedger(t)
	ctx := context.Background()
	data, adm := testutil.RandomName("eud_"), testutil.RandomName("eua_")
	for _, r := range []string{data, adm} {
		if _, err := env.Pool.Exec(ctx, "CREATE ROLE "+r+" NOLOGIN"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = env.Pool.Exec(context.Background(), "DROP OWNED BY "+r)
			_, _ = env.Pool.Exec(context.Background(), "DROP ROLE "+r)
		})
	}
	grants, err := pgledger.RoleGrants(env.Schema, data, adm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := env.Pool.Exec(ctx, grants); err != nil {
		t.Fatalf("grants: %v\n%s", err, grants)
	}
	if err := owner.CreateOrg(ctx, "o"); err != nil {
		t.Fatal(err)
	}
	lim, _, err := owner.CreateLimit(ctx, "o", balance.Limit{Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Lifetime,
		Unit: balance.Tokens, Cap: 1_000_000})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		ev := ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: "o", Model: "m", EndUser: "alice", Cost: int64(10 + i), ReservedAt: time.Now()}
		ev.Usage.Prompt = 100
		if err := owner.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
		if _, err := owner.AccountPending(ctx, 10); err != nil {
			t.Fatal(err)
		}
	}
	pc, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	pc.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+data)
		return err
	}
	restricted, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(restricted.Close)
	proxy, err := pgledger.New(restricted, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	for _, upto := range []int64{3, 2} { // the row alone; the row less a tail of one charge
		got, err := proxy.EndUserUsed(ctx, "o", "alice", []balance.Limit{lim}, upto)
		if err != nil {
			t.Fatalf("EndUserUsed as the data role: %v", err)
		}
		want, err := owner.EndUserUsed(ctx, "o", "alice", []balance.Limit{lim}, upto)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) || got[0].Used != upto*100 {
			t.Fatalf("EndUserUsed(upto %d) as the data role = %+v, as the owner %+v; want %d tokens", upto, got, want, upto*100)
		}
	}
}
