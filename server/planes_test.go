package server

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestPlanesRedisUsers (issue 36, "Two planes in Redis"): on a real Redis with the users `escrow
// redis-acl` prints, a proxy-role process on the data user (and no admin credential) serves,
// and an admin-role process writes through the admin user: limits, freezes, model changes and
// revocations made in the admin API reach the proxy; a Redis data loss of an org's limits alone
// is answered 503 by the proxy until the admin process's reconciler pushes them again.
func TestPlanesRedisUsers(t *testing.T) {
	t.Parallel()
	env := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	d, a, err := RedisACL(env.Prefix, testutil.RandomName("data"), testutil.RandomName("pw"), testutil.RandomName("admin"), testutil.RandomName("pw"))
	if err != nil {
		t.Fatal(err)
	}
	urls := testutil.RedisUsers(t, env, d, a)
	dataURL, adminURL := urls[0], urls[1]

	adm := startTestProxyWith(t, false, nil, func(c *Config) {
		c.Role, c.UpstreamURL = RoleAdmin, ""
		c.RedisURL, c.AdminRedisURL, c.DatabaseURL, c.Prefix = dataURL, adminURL, pg.URL, env.Prefix
		c.ReconcileEvery = 50 * time.Millisecond
	})
	key := adm.setup("acme", 10_000, 20)
	px := startTestProxy(t, false, func(c *Config) {
		c.Role, c.AdminToken = RoleProxy, ""
		c.RedisURL, c.DatabaseURL, c.Prefix, c.Migrate = dataURL, pg.URL, env.Prefix, false
		c.KeyCacheTTL = 50 * time.Millisecond
	})
	if !px.app.store.Config().DataOnly {
		t.Fatal("a proxy without an admin Redis URL is not data-only")
	}
	chatOK := func(what string) {
		t.Helper()
		if st, _, b := px.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
			t.Fatalf("%s: %d %s", what, st, b)
		}
	}
	chatOK("first request")
	chatOK("second request")
	if b := adm.settled("acme"); b.LedgerBalance != 10_000-2*20 {
		t.Fatalf("the admin process sees %+v, want 2 requests charged", b)
	}

	// A freeze made by the admin user reaches the proxy at once; so does the unfreeze.
	adm.admin("POST", "/orgs/acme/freeze", nil, http.StatusOK, nil)
	if st, _, b := px.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusForbidden {
		t.Fatalf("frozen: %d %s", st, b)
	}
	adm.admin("POST", "/orgs/acme/unfreeze", nil, http.StatusOK, nil)
	chatOK("unfrozen")
	// A limit: one more request of 20 fits the cap, the next is refused.
	adm.settled("acme")
	adm.admin("POST", "/orgs/acme/limits", map[string]any{"scope": "org", "window": "lifetime", "cap": 80}, http.StatusCreated, nil) // 60 spent
	chatOK("within the limit")
	if st, _, b := px.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusTooManyRequests {
		t.Fatalf("over the limit: %d %s", st, b)
	}

	// A Redis data loss of the org's limits alone: the proxy may not rebuild them (503, never a
	// request without its limits); the admin process's reconciler pushes them again.
	if err := env.Client.Del(context.Background(), balance.KeysOf(env.Prefix, "acme").Lim).Err(); err != nil {
		t.Fatal(err)
	}
	// (The admin process's own worker, which holds both credentials, may push them back before
	// the proxy's first request: then that request already meets the limit. Either way no
	// request passes without them; balance's TestDataOnlyStore holds the 503 of the data user.)
	deadline := time.Now().Add(30 * time.Second)
	for {
		st, _, b := px.do("POST", "/v1/chat/completions", key, chat("hello"))
		if st == http.StatusTooManyRequests { // the limit is back, and still refuses
			break
		}
		if st != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("after the limits' loss: %d %s, want 503 until the admin plane pushes them, then the limit's 429", st, b)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// A model change and a key revocation, both admin-plane writes.
	adm.admin("PUT", "/models/m", map[string]any{"input_price": 0, "cached_input_price": 0, "output_price": 2_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 20, "max_cost": 40, "default_hold": 40}, http.StatusOK, nil)
	var k struct{ ID, Key string }
	adm.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &k)
	adm.admin("DELETE", "/keys/"+k.ID, nil, http.StatusNoContent, nil)
	for deadline := time.Now().Add(30 * time.Second); ; {
		st, _, b := px.do("POST", "/v1/chat/completions", k.Key, chat("hello"))
		if st == http.StatusUnauthorized {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("revoked key: %d %s", st, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
