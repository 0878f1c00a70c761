package server

import "github.com/llmescrow/escrow/ledger/pgledger"

// PostgresRoleGrants is the SQL that gives a data role (the proxies) and an admin role (the admin
// API) what each plane may do in the ledger's schema (pgledger.RoleGrants; `escrow pg-roles`).
func PostgresRoleGrants(schema, dataRole, adminRole string) (string, error) {
	return pgledger.RoleGrants(schema, dataRole, adminRole)
}
