package server

import (
	"context"
	"errors"
	"net/http"
	"testing"
)

// TestRoles (issue 36): an admin-role process (no upstream configured) serves only the admin
// API; a proxy-role process on the same Redis and Postgres, with no admin token, serves the
// proxy and mounts no admin route (404, as for any unknown path); requests made through it are
// seen by the admin process. A proxy-role process with a token mounts none either.
func TestRoles(t *testing.T) {
	t.Parallel()
	adm := startTestProxyWith(t, true, nil, func(c *Config) {
		c.Role = RoleAdmin
		c.UpstreamURL = "" // no upstream: the admin role needs none
	})
	key := adm.setup("acme", 10_000, 65)
	shared := adm.app.cfg
	for _, token := range []string{"", testAdmin} {
		px := startTestProxy(t, false, func(c *Config) {
			c.Role, c.AdminToken = RoleProxy, token
			c.RedisURL, c.DatabaseURL, c.Prefix, c.Migrate = shared.RedisURL, shared.DatabaseURL, shared.Prefix, false
		})
		if st, _, b := px.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
			t.Fatalf("proxy role (token %q): %d %s", token, st, b)
		}
		if st, _, b := px.do("GET", "/admin/v1/orgs", testAdmin, nil); st != http.StatusNotFound {
			t.Fatalf("proxy role (token %q) answers the admin API: %d %s", token, st, b)
		}
	}
	if st, _, b := adm.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusNotFound {
		t.Fatalf("admin role serves the proxy: %d %s", st, b)
	}
	if b := adm.settled("acme"); b.LedgerBalance != 10_000-2*20 {
		t.Fatalf("the admin process sees %+v, want the proxy's 2 requests charged", b)
	}
	// Without any upstream (no option either), an admin role starts; a proxy role does not.
	bare := shared
	bare.Addr, bare.UpstreamURL, bare.UpstreamAPIKey, bare.Migrate = "127.0.0.1:0", "", "", false
	srv, err := New(context.Background(), &bare)
	if err != nil {
		t.Fatalf("admin role without an upstream: %v", err)
	}
	t.Cleanup(func() { _ = srv.Stop(context.Background()) })
	bare.Role = RoleProxy
	if _, err := New(context.Background(), &bare); !errors.Is(err, ErrNoUpstream) {
		t.Fatalf("proxy role without an upstream: %v, want ErrNoUpstream", err)
	}
	cfg := DefaultConfig()
	cfg.Role = RoleAdmin
	if err := cfg.validate(); err == nil {
		t.Fatal("an admin role without an admin token was accepted")
	}
	cfg.Role = "console"
	if err := cfg.validate(); err == nil {
		t.Fatal("an unknown role was accepted")
	}
}
