package main

import (
	"errors"
	"strings"
	"testing"
)

// TestCLITokens: a read token made with `escrow tokens create` lists orgs and is refused a
// write; an org token credits its own org and not another; a rotation leaves both tokens valid
// for the overlap; a revoked token is refused; `escrow tokens` lists them without secrets.
func TestCLITokens(t *testing.T) {
	c, _ := startCLIProxy(t)
	c.ok("orgs", "create", "acme")
	c.ok("orgs", "create", "other")
	var read, org struct{ ID, Token, Scope string }
	c.json(&read, "tokens", "create", "--scope", "read", "--name", "dashboard")
	c.json(&org, "tokens", "create", "--scope", "org:acme")
	if read.Scope != "read" || !strings.HasPrefix(read.Token, "esc-adm-") || org.Scope != "org:acme" {
		t.Fatalf("created %+v %+v", read, org)
	}
	as := func(token string) *cli {
		env := map[string]string{}
		for k, v := range c.env {
			env[k] = v
		}
		env["ESCROW_ADMIN_TOKEN"] = token
		return &cli{t: t, env: env}
	}
	if out := as(read.Token).ok("orgs"); !strings.Contains(out, "acme") {
		t.Fatalf("read token lists orgs: %q", out)
	}
	var ee *exitError
	if _, err := as(read.Token).run("credit", "acme", "100", "--ref", "r1"); !errors.As(err, &ee) || !strings.Contains(err.Error(), "insufficient_scope") {
		t.Fatalf("read token credits: %v", err)
	}
	as(org.Token).ok("credit", "acme", "100", "--ref", "o1")
	if _, err := as(org.Token).run("credit", "other", "100", "--ref", "o2"); err == nil {
		t.Fatal("an org token credited another org")
	}
	var next struct{ ID, Token string }
	c.json(&next, "tokens", "rotate", read.ID, "--overlap", "1h")
	as(read.Token).ok("orgs")
	as(next.Token).ok("orgs")
	c.ok("tokens", "revoke", read.ID)
	if _, err := as(read.Token).run("orgs"); err == nil || !strings.Contains(err.Error(), "invalid_admin_token") {
		t.Fatalf("revoked token: %v", err)
	}
	out := c.ok("tokens")
	if !strings.Contains(out, read.ID) || !strings.Contains(out, next.ID) || strings.Contains(out, next.Token) {
		t.Fatalf("tokens list: %q", out)
	}
	var key struct{ ID string }
	c.json(&key, "keys", "create", "acme")
	if out := as(org.Token).ok("keys", "models", key.ID, "gpt-4o*,m"); !strings.Contains(out, "gpt-4o*,m") {
		t.Fatalf("keys models: %q", out)
	}
	// The key list and the audit trail show them in their JSON (their tables, in the README's
	// sessions, keep their columns).
	if out := c.ok("keys", "acme", "--json"); !strings.Contains(out, `"gpt-4o*"`) {
		t.Fatalf("the key list shows no models: %q", out)
	}
	if out := c.ok("audit", "--json"); !strings.Contains(out, `"token": "`+org.ID+`"`) {
		t.Fatalf("the audit trail does not name the org token: %q", out)
	}
}
