package server

import (
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// PostgresRoleGrants is the SQL that gives a data role (the proxies) and an admin role (the admin
// API) what each plane may do in the ledger's schema (pgledger.RoleGrants; `escrow pg-roles`).
func PostgresRoleGrants(schema, dataRole, adminRole string) (string, error) {
	return pgledger.RoleGrants(schema, dataRole, adminRole)
}

// RedisACL is the two ACL SETUSER commands of the Redis users of the two planes under prefix
// (balance.ACLRules; `escrow redis-acl`): the data user for REDIS_URL of the proxies, the admin
// user for ESCROW_ADMIN_REDIS_URL.
func RedisACL(prefix, dataUser, dataPassword, adminUser, adminPassword string) (data, admin string, err error) {
	return balance.ACLRules(prefix, dataUser, dataPassword, adminUser, adminPassword)
}
