package main

import (
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"

	"github.com/llmescrow/escrow/server"
)

// cmdRedisACL: escrow redis-acl [-prefix P] [-data-user U] [-admin-user U] — prints the ACL
// SETUSER commands of the two planes' Redis users (DESIGN.md "Two planes"), with a fresh random
// password each unless given (ESCROW_REDIS_DATA_PASSWORD, ESCROW_REDIS_ADMIN_PASSWORD).
func cmdRedisACL(args []string) error {
	fs := flag.NewFlagSet("redis-acl", flag.ContinueOnError)
	prefix := fs.String("prefix", server.DefaultConfig().Prefix, "the key prefix (ESCROW_PREFIX of the processes)")
	data := fs.String("data-user", "escrow_data", "the proxies' user (REDIS_URL): the scripts, read-write on data keys, read-only on admin keys")
	admin := fs.String("admin-user", "escrow_admin", "the admin API's user (ESCROW_ADMIN_REDIS_URL): also writes limits, freezes, model versions, revocations, the epoch")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return usageErr("usage: escrow redis-acl [-prefix esc] [-data-user escrow_data] [-admin-user escrow_admin]")
	}
	dp, err := password("ESCROW_REDIS_DATA_PASSWORD")
	if err != nil {
		return err
	}
	ap, err := password("ESCROW_REDIS_ADMIN_PASSWORD")
	if err != nil {
		return err
	}
	d, a, err := server.RedisACL(*prefix, *data, dp, *admin, ap)
	if err != nil {
		return err
	}
	out := stdout
	if out == nil {
		out = os.Stdout
	}
	fmt.Fprintf(out, "# Redis >= 7.0 (%%R~ read-only key patterns); run with redis-cli, then\n"+
		"# proxies: REDIS_URL=redis://%s:<data password>@host/0 ESCROW_ROLE=proxy\n"+
		"# admin:   ESCROW_ADMIN_REDIS_URL=redis://%s:<admin password>@host/0 ESCROW_ROLE=admin\n%s\n%s\n", *data, *admin, d, a)
	return nil
}

// password is the environment variable's value, or a fresh random one.
func password(env string) (string, error) {
	if p := os.Getenv(env); p != "" {
		return p, nil
	}
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}
