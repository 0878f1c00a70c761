package server

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/pricing"
)

// pgRole creates a login role with a unique name, dropped (with its grants) when the test ends:
// roles are global to the cluster.
func pgRole(t *testing.T, owner *testutil.PostgresEnv, prefix string) string {
	t.Helper()
	name := testutil.RandomName(prefix)
	ctx := context.Background()
	if _, err := owner.Pool.Exec(ctx, "CREATE ROLE "+name+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if _, err := owner.Pool.Exec(ctx, "DROP OWNED BY "+name); err != nil {
			t.Errorf("drop owned by %s: %v", name, err)
		}
		if _, err := owner.Pool.Exec(ctx, "DROP ROLE "+name); err != nil {
			t.Errorf("drop role %s: %v", name, err)
		}
	})
	return name
}

// asRole is owner's connection string with another user.
func asRole(t *testing.T, owner, role string) string {
	u, err := url.Parse(owner)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// TestPostgresRoles (issue 36): with the GRANTs of pgledger.RoleGrants (what `escrow pg-roles`
// prints) on a migrated schema, the admin role sets up an org (org, credit, model, key, limit)
// and the proxy runs on the data role alone (no migrations): requests are served, recorded,
// accounted and settled to the exact balance. The data role is refused every admin write: a
// credit (row policy), an adjustment, an org, a key, a revocation, a limit, a freeze, a model
// price, an exemption, an admin token, a webhook endpoint, the epoch. The admin API runs on the
// admin role.
func TestPostgresRoles(t *testing.T) {
	t.Parallel()
	if testutil.RealPostgresURL() == "" {
		if testutil.RequireServices() {
			t.Fatal("ESCROW_TEST_DATABASE_URL is required")
		}
		t.Skip("needs Postgres")
	}
	ctx := context.Background()
	owner := testutil.Postgres(t)
	if _, err := Migrate(ctx, owner.URL); err != nil {
		t.Fatal(err)
	}
	data, adm := pgRole(t, owner, "escd_"), pgRole(t, owner, "esca_")
	grants, err := PostgresRoleGrants(owner.Schema, data, adm) // what `escrow pg-roles` prints
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Pool.Exec(ctx, grants); err != nil {
		t.Fatalf("grants: %v\n%s", err, grants)
	}
	noMigrate := &pgledger.Config{SkipMigrations: true}
	admL, err := pgledger.Open(ctx, asRole(t, owner.URL, adm), noMigrate)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admL.Close)
	must := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("admin role: %s: %v", what, err)
		}
	}
	must("org", admL.CreateOrg(ctx, "acme"))
	_, _, err = admL.Credit(ctx, "acme", 10_000, "pay-1")
	must("credit", err)
	must("model", admL.PutModel(ctx, ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Output: 1_000_000}, MaxInputTokens: 100_000, MaxOutputTokens: 65, MaxCost: 65, DefaultHold: 65}))
	k, secret, err := admL.CreateKey(ctx, "acme")
	must("key", err)
	_, _, err = admL.CreateLimit(ctx, "acme", balance.Limit{Scope: balance.Scope{Kind: balance.ScopeKey, ID: k.ID}, Window: balance.Day, Cap: 1_000_000})
	must("limit", err)

	p := startTestProxy(t, true, func(c *Config) {
		c.DatabaseURL, c.Migrate = asRole(t, owner.URL, data), false
	})
	for i := range 10 {
		if st, _, b := p.do("POST", "/v1/chat/completions", secret, chat("hello")); st != http.StatusOK {
			t.Fatalf("request %d as the data role: %d %s", i, st, b)
		}
	}
	b := p.settled("acme")
	acct, err := admL.Account(ctx, "acme")
	if err != nil || b.LedgerBalance != 10_000-10*20 || acct.Balance != 10_000-10*20 || acct.SettledSeq != acct.LedgerSeq {
		t.Fatalf("after 10 requests as the data role: %+v, ledger %+v %v", b, acct, err)
	}

	dataL, err := pgledger.Open(ctx, asRole(t, owner.URL, data), noMigrate)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dataL.Close)
	refused := func(what string, err error) {
		t.Helper()
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42501" { // insufficient_privilege (also a row policy's refusal)
			t.Errorf("data role: %s: %v, want permission denied", what, err)
		}
	}
	_, _, err = dataL.Credit(ctx, "acme", 1_000_000, "steal")
	refused("credit", err)
	_, _, err = dataL.Adjust(ctx, "acme", 1_000_000, "steal-adj")
	refused("adjustment", err)
	refused("org", dataL.CreateOrg(ctx, "mine"))
	_, _, err = dataL.CreateKey(ctx, "acme")
	refused("key", err)
	refused("revoke key", dataL.RevokeKey(ctx, k.ID))
	_, _, err = dataL.CreateLimit(ctx, "acme", balance.Limit{Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Day, Cap: 5})
	refused("limit", err)
	_, err = dataL.SetFrozen(ctx, "acme", balance.Scope{Kind: balance.ScopeOrg}, true)
	refused("freeze", err)
	refused("model price", dataL.PutModel(ctx, ledger.Model{Name: "m", Prices: pricing.Prices{pricing.Output: 1}}))
	refused("exempt", dataL.SetOrgExempt(ctx, "acme", true))
	_, _, err = dataL.CreateAdminToken(ctx, "x", "admin")
	refused("admin token", err)
	_, err = dataL.RaiseEpoch(ctx)
	refused("epoch", err)
	conn, err := pgx.Connect(ctx, asRole(t, owner.URL, data))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, `INSERT INTO webhook_endpoints (id, url, secret, events) VALUES ('wh_x', 'http://x', 's', '{credit.received}')`)
	refused("webhook endpoint", err)
	_, err = conn.Exec(ctx, `UPDATE accounts SET balance = balance + 1000000, exempt = true WHERE org_id = 'acme'`)
	refused("account flags", err)
	if a, _ := admL.Account(ctx, "acme"); a.Balance != acct.Balance {
		t.Fatalf("the data role's refused writes moved the balance: %d, want %d", a.Balance, acct.Balance)
	}
	// The admin API on the admin role: an org, a credit, a key, a limit and a freeze.
	ap := startTestProxy(t, true, func(c *Config) {
		c.DatabaseURL, c.Migrate = asRole(t, owner.URL, adm), false
	})
	ap.admin("POST", "/orgs", map[string]string{"id": "beta"}, http.StatusCreated, nil)
	ap.admin("POST", "/orgs/beta/credits", map[string]any{"amount": 500, "reference": "pay-beta"}, http.StatusCreated, nil)
	ap.admin("POST", "/orgs/beta/keys", nil, http.StatusCreated, nil)
	ap.admin("POST", "/orgs/beta/limits", map[string]any{"scope": "org", "window": "day", "cap": 100}, http.StatusCreated, nil)
	ap.admin("POST", "/orgs/beta/freeze", nil, http.StatusOK, nil)
	ap.admin("POST", "/orgs/acme/adjustments", map[string]any{"amount": -5, "reference": "adj-1"}, http.StatusCreated, nil)
	if !strings.Contains(grants, "kind IN ('charge', 'expire')") {
		t.Fatal("the grants lack the charge and expire policy")
	}
}
