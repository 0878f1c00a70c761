package pgledger

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Two Postgres roles for the two planes (issue 36, DESIGN.md "Two planes"): a data role for the
// proxies (record usage, the worker's account pass, settle and reap bookkeeping, webhook
// delivery, reads of keys, models and limits) and an admin role for the admin API (credits,
// adjustments, orgs, keys, limits, projects, freezes, models, webhooks, tokens, the audit trail,
// the epoch). The schema's owner (who runs the migrations) keeps everything; the roles are made
// by the operator, RoleGrants prints what they may do.

// ErrInvalidRole: a role or schema name that is not a plain lower-case SQL identifier.
var ErrInvalidRole = errors.New("pgledger: invalid role or schema name")

var identRe = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// dataTables are the tables the data role reads; dataWrites what it may change in them.
var (
	dataTables = []string{"ledger_meta", "accounts", "models", "api_keys", "usage_events", "usage_pending", "ledger_entries",
		"projects", "limits", "limit_windows", "key_days", "webhook_endpoints", "webhook_events", "webhook_deliveries", "schema_migrations", "jobs", "batch_files", "grants"}
	dataWrites = []string{
		"INSERT, UPDATE ON usage_events",
		"INSERT, UPDATE, DELETE ON usage_pending",
		"INSERT ON ledger_entries", // charges and expire entries only: the row policy below
		// Not INSERT: an org is made by the admin plane (usage of an org without an account, which
		// only a custom OrgFunc can cause, waits for it).
		"UPDATE (balance, ledger_seq, settled_seq, charged) ON accounts",
		"UPDATE (last_used_at, charged) ON api_keys",
		"INSERT, UPDATE ON key_days",              // each key's charges per day, kept by the account pass (migration 021)
		"UPDATE (max_cost, updated_at) ON models", // the learned max
		"INSERT, UPDATE, DELETE ON limit_windows", // each window's spend, kept by the account pass
		"INSERT ON webhook_events",
		"INSERT, UPDATE ON webhook_deliveries",
		"INSERT, UPDATE ON jobs",        // background responses and batches: recorded, polled, settled by the proxies
		"INSERT, UPDATE ON batch_files", // batch files: recorded by the proxies for their org
		// credit grants (migration 024): the account pass spends them, the worker closes an
		// expired one with its expire entry; making a grant is a credit, the admin plane's
		"UPDATE (rest, expired_seq, expired_amount) ON grants",
	}
)

// RoleGrants returns the SQL (one statement a line) that lets dataRole and adminRole, which
// must exist, use the ledger in schema. Run it as the schema's owner after the migrations (and
// again after an upgrade adds tables). It turns on row-level security on ledger_entries, with
// policies for the two roles: the data role inserts only charges and the expire entries of grants, so it can neither
// credit nor adjust. Other roles that are not the owner then see no ledger entries unless given a policy.
func RoleGrants(schema, dataRole, adminRole string) (string, error) {
	for _, n := range []string{schema, dataRole, adminRole} {
		if !identRe.MatchString(n) {
			return "", fmt.Errorf("%w: %q", ErrInvalidRole, n)
		}
	}
	if dataRole == adminRole {
		return "", fmt.Errorf("%w: the data and admin roles must differ", ErrInvalidRole)
	}
	q := func(n string) string { return pgx.Identifier{n}.Sanitize() }
	s, d, a := q(schema), q(dataRole), q(adminRole)
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+";\n", args...) }
	line("GRANT USAGE ON SCHEMA %s TO %s, %s", s, d, a)
	line("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA %s TO %s, %s", s, d, a)
	for _, t := range dataTables {
		line("GRANT SELECT ON %s.%s TO %s", s, t, d)
	}
	for _, w := range dataWrites {
		on, table, _ := strings.Cut(w, " ON ")
		for _, part := range strings.Split(on, "), ") { // "INSERT (org_id), UPDATE (…)": one GRANT each
			if strings.Count(part, "(") > strings.Count(part, ")") {
				part += ")"
			}
			line("GRANT %s ON %s.%s TO %s", part, s, table, d)
		}
	}
	line("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %s TO %s", s, a)
	line("ALTER TABLE %s.ledger_entries ENABLE ROW LEVEL SECURITY", s)
	line("DROP POLICY IF EXISTS %s ON %s.ledger_entries", q("escrow_read_"+dataRole), s)
	line("CREATE POLICY %s ON %s.ledger_entries FOR SELECT TO %s USING (true)", q("escrow_read_"+dataRole), s, d)
	line("DROP POLICY IF EXISTS %s ON %s.ledger_entries", q("escrow_charge_"+dataRole), s)
	line("CREATE POLICY %s ON %s.ledger_entries FOR INSERT TO %s WITH CHECK (kind IN ('charge', 'expire'))", q("escrow_charge_"+dataRole), s, d)
	line("DROP POLICY IF EXISTS %s ON %s.ledger_entries", q("escrow_all_"+adminRole), s)
	line("CREATE POLICY %s ON %s.ledger_entries TO %s USING (true) WITH CHECK (true)", q("escrow_all_"+adminRole), s, a)
	return b.String(), nil
}
