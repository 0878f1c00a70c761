package main

import (
	"strings"
	"testing"
)

// TestCLIPGRoles: `escrow pg-roles` prints the grants of the two roles for a schema (applied and
// exercised on Postgres by server's TestPostgresRoles), and refuses a name that is not a plain
// identifier.
func TestCLIPGRoles(t *testing.T) {
	c := &cli{t: t, env: map[string]string{}}
	out := c.ok("pg-roles", "-schema", "ledger", "-data-role", "px", "-admin-role", "ops")
	for _, want := range []string{
		`GRANT USAGE ON SCHEMA "ledger" TO "px", "ops";`,
		`GRANT INSERT ON "ledger".ledger_entries TO "px";`,
		`FOR INSERT TO "px" WITH CHECK (kind IN ('charge', 'expire'));`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "ledger" TO "ops";`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("pg-roles lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, `ON "ledger".limits TO "px"`) && !strings.Contains(out, `GRANT SELECT ON "ledger".limits TO "px"`) {
		t.Error("the data role may write limits")
	}
	if _, err := c.run("pg-roles", "-data-role", `x"; DROP TABLE accounts; --`); err == nil {
		t.Fatal("a role name with SQL in it was accepted")
	}
}
