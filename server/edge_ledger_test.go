package server

// Issue 10, items 5, 6 and 10, against the running proxy over HTTP. Each test ends with the
// ledger equal to what the client saw, or a refusal with nothing debited.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
)

// pgBehindFault starts the proxy on real Redis and a fresh Postgres schema reached through a
// fault proxy, so a test can take Postgres away.
func pgBehindFault(t *testing.T, tweak ...func(*Config)) (*testProxy, *testutil.FaultProxy, *testutil.PostgresEnv) {
	t.Helper()
	pg := testutil.Postgres(t)
	u, err := url.Parse(pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	fp := testutil.StartFaultProxy(t, u.Host)
	u.Host = fp.Addr()
	q := u.Query()
	q.Set("connect_timeout", "2")
	u.RawQuery = q.Encode()
	all := append([]func(*Config){func(c *Config) { c.DatabaseURL = u.String() }}, tweak...)
	return startTestProxy(t, true, all...), fp, pg
}

// newKey makes another key for org and returns its id and secret.
func (p *testProxy) newKey(org string) (id, secret string) {
	var k struct{ ID, Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.ID, k.Key
}

// TestEdgeOrgIDs (item 10): the admin API applies the one org-id rule and says what is allowed;
// ids the hot balance or an admin URL could not take never reach the ledger.
func TestEdgeOrgIDs(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		for _, org := range []string{"ÄÖ", "team/a", "..", "-x", "a:b", "a b", strings.Repeat("a", 129)} {
			st, _, body := p.do("POST", "/admin/v1/orgs", testAdmin, map[string]string{"id": org})
			if st != http.StatusBadRequest || !strings.Contains(string(body), `"invalid_org"`) || !strings.Contains(string(body), "A-Z, a-z, 0-9") {
				t.Fatalf("create org %q: %d %s", org, st, body)
			}
			if _, err := p.app.ledger.Account(context.Background(), org); !errors.Is(err, balance.ErrInvalidOrg) {
				t.Fatalf("org %q: %v", org, err)
			}
		}
		for _, path := range []string{"/orgs/-x/balance", "/orgs/%C3%84/credits", "/orgs/a%2Fb/keys"} {
			st, _, body := p.do("POST", "/admin/v1"+path, testAdmin, map[string]any{"amount": 5, "reference": "r"})
			if st != http.StatusBadRequest && st != http.StatusNotFound && st != http.StatusMethodNotAllowed {
				t.Fatalf("%s: %d %s", path, st, body)
			}
		}
		key := p.setup("Team-1.a_b", 1000, 65)
		if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
			t.Fatalf("valid org: %d %s", st, body)
		}
		if b := p.settled("Team-1.a_b"); b.LedgerBalance != 1000-20 {
			t.Fatalf("after settle: %+v", b)
		}
	})
}

// TestEdgeKeyFailuresLimited (item 10): 100 random keys from one client cost at most the
// configured number of failed look-ups, the rest get 429, and a known key still works.
func TestEdgeKeyFailuresLimited(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 1000, 65)
		if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
			t.Fatalf("status %d %s", st, body)
		}
		var unauthorized, limited int
		for i := range 100 {
			st, h, _ := p.do("POST", "/v1/chat/completions", fmt.Sprintf("sk-esc-random%040d", i), chat("hello"))
			switch {
			case st == http.StatusUnauthorized:
				unauthorized++
			case st == http.StatusTooManyRequests && h.Get("Retry-After") != "":
				limited++
			default:
				t.Fatalf("random key %d: %d", i, st)
			}
		}
		if unauthorized != 20 || limited != 80 { // ESCROW_KEY_FAILURES_PER_MINUTE defaults to 20
			t.Fatalf("%d × 401, %d × 429; want 20 and 80", unauthorized, limited)
		}
		if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
			t.Fatalf("known key after the flood: %d %s", st, body)
		}
		if b := p.settled("acme"); b.LedgerBalance != 1000-2*20 {
			t.Fatalf("after settle: %+v", b)
		}
	})
}

// TestEdgeFailOpenColdOrgLedgerDown (item 5): with Postgres unreachable, a cold org gets 503
// with fail-open off and on; once Postgres is back it is served and billed.
func TestEdgeFailOpenColdOrgLedgerDown(t *testing.T) {
	t.Parallel()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", failOpen), func(t *testing.T) {
			t.Parallel()
			p, fp, _ := pgBehindFault(t, func(c *Config) { c.FailOpen = failOpen })
			key := p.setup("acme", 1000, 65)
			if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK { // key cached
				t.Fatalf("status %d %s", st, body)
			}
			p.settled("acme")
			if err := p.app.store.Invalidate(context.Background(), "acme"); err != nil { // cold
				t.Fatal(err)
			}
			fp.Block()
			fp.Cut()
			st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello"))
			if st != http.StatusServiceUnavailable {
				t.Fatalf("cold org, ledger down: %d %s", st, body)
			}
			fp.Unblock()
			// Pooled connections cut by the outage may fail the first tries: a client retries
			// a 503 (each one refused with nothing debited, as the settle below checks).
			deadline := time.Now().Add(time.Minute) // bounds a hang
			for {
				st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello"))
				if st == http.StatusOK {
					break
				}
				if st != http.StatusServiceUnavailable || time.Now().After(deadline) {
					t.Fatalf("ledger back: %d %s", st, body)
				}
				time.Sleep(100 * time.Millisecond)
			}
			if b := p.settled("acme"); b.LedgerBalance != 1000-2*20 {
				t.Fatalf("after settle: %+v, want two requests charged", b)
			}
		})
	}
}

// TestEdgeRecordStall (item 6, issue 34): Postgres stalls the usage insert — before the row is
// written, or after it is written but before the commit — on a trigger that waits for an advisory
// lock the test holds, so the record times out at any machine speed and the insert goes on only
// when the test lets it. Stalled before: a JSON body (held until its record) gets 503 and the
// late insert charges nothing; a stream, whose content was served, is billed once all the same
// (served ⇒ billed). Stalled after: the void waits for the insert, finds it, and the client gets
// its 200, charged once.
func TestEdgeRecordStall(t *testing.T) {
	t.Parallel()
	p, _, pg := pgBehindFault(t, func(c *Config) { c.RecordTimeout, c.voidTimeout = 300*time.Millisecond, time.Minute })
	ctx := context.Background()
	const lockKey = 34034
	for _, sql := range []string{
		`CREATE TABLE stall (phase text PRIMARY KEY)`,
		`CREATE FUNCTION stall_before() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.status = 'recorded' AND EXISTS (SELECT 1 FROM stall WHERE phase = 'before') THEN PERFORM pg_advisory_xact_lock_shared(34034); END IF;
	RETURN NEW;
END $$`,
		`CREATE FUNCTION stall_after() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.status = 'recorded' AND EXISTS (SELECT 1 FROM stall WHERE phase = 'after') THEN PERFORM pg_advisory_xact_lock_shared(34034); END IF;
	RETURN NULL;
END $$`,
		`CREATE TRIGGER stall_before BEFORE INSERT ON usage_events FOR EACH ROW EXECUTE FUNCTION stall_before()`,
		`CREATE TRIGGER stall_after AFTER INSERT ON usage_events FOR EACH ROW EXECUTE FUNCTION stall_after()`,
	} {
		if _, err := pg.Pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// stall sets the phase and holds the lock the trigger waits for; the returned func clears
	// the phase and lets the stalled insert go on.
	var lockPID int32 // the backend that holds the lock
	stall := func(phase string) (release func()) {
		conn, err := pg.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&lockPID); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
			t.Fatal(err)
		}
		if _, err := pg.Pool.Exec(ctx, `INSERT INTO stall VALUES ($1)`, phase); err != nil {
			t.Fatal(err)
		}
		return func() {
			if _, err := pg.Pool.Exec(ctx, `DELETE FROM stall`); err != nil {
				t.Fatal(err)
			}
			if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockKey); err != nil {
				t.Fatal(err)
			}
			conn.Release()
		}
	}
	key := p.setup("acme", 1000, 65)

	// Stalled before the row is written. A JSON body: told it failed, never charged.
	release := stall("before")
	st, _, out := p.do("POST", "/v1/chat/completions", key, chat("hello"))
	if st != http.StatusServiceUnavailable || !strings.Contains(string(out), "billing_unavailable") {
		t.Fatalf("stalled before the write: %d %s", st, out)
	}
	release() // the stalled insert lands now, as a no-op: it meets the voided row
	if b := p.settled("acme"); b.LedgerBalance != 1000 {
		t.Fatalf("after a request the client was told failed: %+v, want nothing charged", b)
	}
	// A stream: its content was served before the record, so it ends as it should and is billed
	// once, when the stalled insert (or a retry, or the journal's replay) lands.
	release = stall("before")
	st, _, out = p.do("POST", "/v1/chat/completions", key, map[string]any{"model": "m", "stream": true, "messages": []map[string]string{{"role": "user", "content": "hi"}}})
	if st != http.StatusOK || !strings.Contains(string(out), "[DONE]") || strings.Contains(string(out), "billing_unavailable") {
		t.Fatalf("stream stalled before the write: %d %s", st, out)
	}
	if b := p.balance("acme"); b.Holds != 1 {
		t.Fatalf("while the ledger stalls: %+v, want the served stream's hold kept", b)
	}
	release()
	if b := p.settled("acme"); b.LedgerBalance != 1000-20 {
		t.Fatalf("after a stream served while the ledger stalled: %+v, want 20 charged once", b)
	}

	// Written, but the commit waits: the void waits for the insert; once it goes on, the void
	// finds the event and the client sees success, charged exactly once.
	release = stall("after")
	done := make(chan struct{})
	go func() {
		defer close(done)
		st, _, out = p.do("POST", "/v1/chat/completions", key, chat("hello"))
	}()
	// The void's insert of the same id waits on the stalled insert, which waits on the lock:
	// once a backend is blocked by one that the lock blocks, let it go.
	for {
		var waiting int
		if err := pg.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity a
			WHERE EXISTS (SELECT 1 FROM unnest(pg_blocking_pids(a.pid)) b WHERE $1 = ANY(pg_blocking_pids(b)))`, lockPID).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		select {
		case <-done:
			t.Fatalf("answered before the void reached the ledger: %d %s", st, out)
		case <-time.After(10 * time.Millisecond):
		}
	}
	release()
	<-done
	if st != http.StatusOK || !strings.Contains(string(out), `"usage"`) {
		t.Fatalf("stalled after the write: %d %s", st, out)
	}
	if b := p.settled("acme"); b.LedgerBalance != 1000-40 {
		t.Fatalf("after a request the client saw succeed: %+v, want 20 more charged once", b)
	}
}

// TestEdgeRevokedKeyLedgerDown (item 10): a key revoked through the admin API stops within the
// key cache's TTL although Postgres is unreachable from then on, while another key of the org
// keeps working (its usage journaled and replayed).
func TestEdgeRevokedKeyLedgerDown(t *testing.T) {
	t.Parallel()
	const ttl = 300 * time.Millisecond
	p, fp, _ := pgBehindFault(t, func(c *Config) { c.KeyCacheTTL, c.JournalDir = ttl, t.TempDir() })
	key := p.setup("acme", 1000, 65)
	_, key2 := p.newKey("acme")
	for _, k := range []string{key, key2} {
		if st, _, body := p.do("POST", "/v1/chat/completions", k, chat("hello")); st != http.StatusOK {
			t.Fatalf("status %d %s", st, body)
		}
	}
	revokeID, key := p.newKey("acme") // a third key, cached, then revoked
	if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
		t.Fatalf("status %d %s", st, body)
	}
	p.admin("DELETE", "/keys/"+revokeID, nil, http.StatusNoContent, nil)
	fp.Block()
	fp.Cut()
	time.Sleep(ttl + 100*time.Millisecond)
	if st, _, body := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusUnauthorized {
		t.Fatalf("revoked key, ledger down: %d %s", st, body)
	}
	if st, _, body := p.do("POST", "/v1/chat/completions", key2, chat("hello")); st != http.StatusOK {
		t.Fatalf("other key, ledger down: %d %s", st, body)
	}
	fp.Unblock()
	if b := p.settled("acme"); b.LedgerBalance != 1000-4*20 {
		t.Fatalf("after settle: %+v, want the four served requests charged", b)
	}
}

// TestEdgeTrustedProxies (issue 22 item 3): behind a trusted proxy (ESCROW_TRUSTED_PROXIES),
// unknown keys are counted per client as X-Forwarded-For names it, so one client trying random
// keys does not lock out the others behind the same proxy; a key that exists is served even
// from the limited client; and X-Forwarded-For from a peer that is not trusted (loopback here,
// which Echo would trust by default) is ignored.
func TestEdgeTrustedProxies(t *testing.T) {
	t.Parallel()
	from := func(p *testProxy, xff, key string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hello"}]}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("X-Forwarded-For", xff)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	random := func(i int) string { return fmt.Sprintf("sk-esc-random%040d", i) }

	p := startTestProxy(t, true, func(c *Config) { c.TrustedProxies = "127.0.0.1/32, ::1" })
	p.setup("acme", 1000, 65)
	for i := range 20 { // ESCROW_KEY_FAILURES_PER_MINUTE defaults to 20
		if st := from(p, "198.51.100.9, 203.0.113.7", random(i)); st != http.StatusUnauthorized {
			t.Fatalf("random key %d: %d, want 401", i, st)
		}
	}
	if st := from(p, "203.0.113.7", random(20)); st != http.StatusTooManyRequests {
		t.Fatalf("21st random key of 203.0.113.7: %d, want 429", st)
	}
	if st := from(p, "203.0.113.8", random(21)); st != http.StatusUnauthorized {
		t.Fatalf("random key of another client behind the proxy: %d, want 401", st)
	}
	_, fresh := p.newKey("acme")
	if st := from(p, "203.0.113.7", fresh); st != http.StatusOK {
		t.Fatalf("a fresh valid key of the limited client: %d, want 200", st)
	}
	if b := p.settled("acme"); b.LedgerBalance != 1000-20 {
		t.Fatalf("after settle: %+v", b)
	}

	untrusted := startTestProxy(t, true, func(c *Config) { c.TrustedProxies = "192.0.2.1/32" })
	for i := range 20 {
		if st := from(untrusted, fmt.Sprintf("203.0.113.%d", i), random(i)); st != http.StatusUnauthorized {
			t.Fatalf("random key %d: %d, want 401", i, st)
		}
	}
	if st := from(untrusted, "203.0.113.99", random(20)); st != http.StatusTooManyRequests {
		t.Fatalf("X-Forwarded-For of an untrusted peer was believed: %d, want 429", st)
	}
}
