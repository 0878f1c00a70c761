package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/llmescrow/escrow/server"
)

// cmdPGRoles: escrow pg-roles [-schema S] [-data-role R] [-admin-role R] — prints the GRANTs of
// the two Postgres roles (the roles themselves are made by the operator: CREATE ROLE … LOGIN).
func cmdPGRoles(args []string) error {
	fs := flag.NewFlagSet("pg-roles", flag.ContinueOnError)
	schema := fs.String("schema", "public", "the ledger's schema")
	data := fs.String("data-role", "escrow_data", "the proxies' role: record usage, account, settle, read keys, models and limits")
	admin := fs.String("admin-role", "escrow_admin", "the admin API's role: credits, adjustments, orgs, keys, limits, models, webhooks, tokens")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return usageErr("usage: escrow pg-roles [-schema public] [-data-role escrow_data] [-admin-role escrow_admin]")
	}
	sql, err := server.PostgresRoleGrants(*schema, *data, *admin)
	if err != nil {
		return err
	}
	out := stdout
	if out == nil {
		out = os.Stdout
	}
	fmt.Fprintf(out, "-- run as the schema's owner, after the migrations (and again after an upgrade)\n%s", sql)
	return nil
}
