package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/csv"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/server"
)

// cli runs one CLI command in-process against the proxy and returns its output. The CLI's
// globals (stdout, getenv) are swapped, so tests that use it do not run in parallel.
type cli struct {
	t   *testing.T
	env map[string]string
}

func (c *cli) run(args ...string) (string, error) {
	var out bytes.Buffer
	stdout, getenv = &out, func(k string) string { return c.env[k] }
	defer func() { stdout, getenv = nil, nil }()
	err := run(args, io.Discard)
	return out.String(), err
}

func (c *cli) ok(args ...string) string {
	c.t.Helper()
	out, err := c.run(args...)
	if err != nil {
		c.t.Fatalf("escrow %s: %v", strings.Join(args, " "), err)
	}
	return out
}

func (c *cli) json(v any, args ...string) {
	c.t.Helper()
	out := c.ok(append(args, "--json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		c.t.Fatalf("escrow %s --json: %v in %q", strings.Join(args, " "), err, out)
	}
}

type usageRow struct {
	Group      string `json:"group"`
	Requests   int64  `json:"requests"`
	Cost       int64  `json:"cost"`
	Prompt     int64  `json:"prompt_tokens"`
	Completion int64  `json:"completion_tokens"`
}

// startCLIProxy starts the proxy in-process on real Redis and Postgres with the fake upstream
// and returns a CLI pointed at it, and its base URL.
func startCLIProxy(t *testing.T) (*cli, string) {
	t.Helper()
	if testutil.RealRedisURL() == "" || testutil.RealPostgresURL() == "" {
		if testutil.RequireServices() {
			t.Fatal("ESCROW_TEST_REDIS_URL and ESCROW_TEST_DATABASE_URL are required")
		}
		t.Skip("needs real Redis and Postgres (ESCROW_TEST_REDIS_URL, ESCROW_TEST_DATABASE_URL)")
	}
	rd := testutil.RealRedis(t)
	pg := testutil.Postgres(t)
	cfg := server.DefaultConfig()
	cfg.Addr, cfg.AdminToken, cfg.DemoBalance = "127.0.0.1:0", "adm-cli-test", 0
	cfg.RedisURL, cfg.DatabaseURL, cfg.Prefix = rd.URL, pg.URL, rd.Prefix
	cfg.SweepInterval = 100 * time.Millisecond
	cfg.WebhookAllowPrivate = true // the receivers are httptest servers on loopback
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx := context.Background()
	srv, err := server.New(ctx, cfg, server.WithUpstream(fakeupstream.New(fakeupstream.Options{}), "sk-fake"))
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := srv.Stop(sctx); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	base := "http://" + srv.Addr()
	return &cli{t: t, env: map[string]string{"ESCROW_URL": base, "ESCROW_ADMIN_TOKEN": cfg.AdminToken, "USER": "tester"}}, base
}

// startCLIServer is startCLIProxy with its results the other way round.
func startCLIServer(t *testing.T) (string, *cli) {
	c, base := startCLIProxy(t)
	return base, c
}

// TestCLIEndToEnd drives the CLI against the proxy started in-process on real Redis and
// Postgres: an org with a name, two named keys (one in a project), two models priced by PATCH in
// decimals, a credit, a webhook for low balances with its threshold, 50 requests through the
// proxy, then the lists, usage by day, model and key adding up to the ledger, a CSV export, one
// request by its x-request-id, and the webhook receiver's one balance.low delivery, its
// signature checked here on its own.
func TestCLIEndToEnd(t *testing.T) {
	c, base := startCLIProxy(t)

	// Set up: org, keys, prices, credit.
	c.ok("orgs", "create", "acme", "--name", "Acme Inc")
	var k1, k2 struct{ ID, Name, Key string }
	c.json(&k1, "keys", "create", "acme", "--name", "prod")
	c.json(&k2, "keys", "create", "acme", "--name", "staging")
	if k1.Name != "prod" || !strings.HasPrefix(k1.Key, "sk-esc-") {
		t.Fatalf("key: %+v", k1)
	}
	var m struct {
		Input  int64 `json:"input_price"`
		Output int64 `json:"output_price"`
	}
	c.json(&m, "models", "set", "gpt-4o-mini", "--input", "0.15", "--cached-input", "0.075", "--output", "0.6",
		"--max-input-tokens", "128000", "--max-output-tokens", "16384", "--default-hold", "50000")
	if m.Input != 150000 || m.Output != 600000 {
		t.Fatalf("decimal prices in micro-units: %+v", m)
	}
	c.ok("models", "set", "gpt-4o", "--input", "2.5", "--output", "10", "--max-output-tokens", "16384", "--default-hold", "50000")
	c.ok("credit", "acme", "10000000", "--ref", "pay-1")
	c.ok("projects", "create", "acme", "web")
	c.ok("projects", "add-key", k2.ID, "web")

	// A webhook receiver told when acme's balance falls under 9,999,000: a real HTTP server that
	// keeps every delivery as it arrived.
	type delivery struct {
		sig  string
		body []byte
	}
	got := make(chan delivery, 16)
	recv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- delivery{r.Header.Get("X-Escrow-Signature"), b}
	}))
	defer recv.Close()
	var hook struct{ ID, Secret string }
	c.json(&hook, "webhooks", "create", recv.URL+"/escrow", "--events", "balance.low")
	c.ok("orgs", "threshold", "acme", "9999000")

	// Requests through the proxy, alternating keys and models.
	const n = 50
	var ids []string
	for i := range n {
		key, model := k1.Key, "gpt-4o-mini"
		if i%2 == 1 {
			key = k2.Key
		}
		if i%4 == 3 {
			model = "gpt-4o"
		}
		body := fmt.Sprintf(`{"model":%q,"max_tokens":%d,"messages":[{"role":"user","content":"hello there number %d"}]}`, model, 10+i, i)
		resp := postChat(t, base, key, body)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
		ids = append(ids, resp.Header.Get("x-request-id"))
	}

	// The low-balance event arrived once, signed: HMAC-SHA256 of "<t>.<body>" with the secret,
	// computed here on its own.
	select {
	case d := <-got:
		var ts, v1 string
		for _, part := range strings.Split(d.sig, ",") {
			k, v, _ := strings.Cut(part, "=")
			if k == "t" {
				ts = v
			} else if k == "v1" {
				v1 = v
			}
		}
		mac := hmac.New(sha256.New, []byte(hook.Secret))
		mac.Write([]byte(ts + "." + string(d.body)))
		var ev struct{ Type, Org string }
		_ = json.Unmarshal(d.body, &ev)
		if ts == "" || v1 != hex.EncodeToString(mac.Sum(nil)) || ev.Type != "balance.low" || ev.Org != "acme" {
			t.Errorf("webhook delivery %q %s: signature or event wrong", d.sig, d.body)
		}
	case <-time.After(30 * time.Second):
		t.Error("no balance.low webhook within 30 s")
	}

	// Wait for the worker to account every request: 1 credit + n charges in the ledger.
	var org struct {
		ID            string `json:"id"`
		Name          string `json:"name"`
		LedgerBalance int64  `json:"ledger_balance"`
		LedgerSeq     int64  `json:"ledger_seq"`
	}
	deadline := time.Now().Add(time.Minute)
	for c.json(&org, "orgs", "show", "acme"); org.LedgerSeq < 1+n; c.json(&org, "orgs", "show", "acme") {
		if time.Now().After(deadline) {
			t.Fatalf("ledger has %d entries, want %d", org.LedgerSeq, 1+n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	charged := 10000000 - org.LedgerBalance
	if org.Name != "Acme Inc" || charged <= 0 {
		t.Fatalf("org: %+v", org)
	}

	// Lists.
	if out := c.ok("orgs"); !strings.Contains(out, "acme") || !strings.Contains(out, "Acme Inc") || !strings.HasPrefix(out, "ID") {
		t.Fatalf("orgs table:\n%s", out)
	}
	if out := c.ok("keys", "acme"); !strings.Contains(out, k1.ID) || !strings.Contains(out, "prod") || !strings.Contains(out, "staging") {
		t.Fatalf("keys table:\n%s", out)
	}
	if out := c.ok("models"); !strings.Contains(out, "gpt-4o-mini") || !strings.Contains(out, "150000") {
		t.Fatalf("models table:\n%s", out)
	}

	// Usage by day, model and key: each sums to what the ledger charged.
	for by, groups := range map[string]int{"day": 1, "model": 2, "key": 2} {
		var p struct{ Data []usageRow }
		c.json(&p, "usage", "acme", "--by", by)
		var cost, reqs int64
		for _, r := range p.Data {
			cost += r.Cost
			reqs += r.Requests
		}
		if len(p.Data) != groups || cost != charged || reqs != n {
			t.Errorf("usage by %s: %+v; sums to %d in %d requests, ledger charged %d in %d", by, p.Data, cost, reqs, charged, n)
		}
		if by == "key" && (p.Data[0].Requests != n/2 || p.Data[1].Requests != n/2) {
			t.Errorf("usage by key: %+v, want %d each", p.Data, n/2)
		}
	}
	today := time.Now().UTC().Format(time.DateOnly)
	var none struct{ Data []usageRow }
	c.json(&none, "usage", "acme", "--from", time.Now().UTC().AddDate(0, 0, 1).Format(time.DateOnly))
	if len(none.Data) != 0 {
		t.Errorf("usage from tomorrow: %+v", none.Data)
	}

	// CSV export.
	out := c.ok("usage", "acme", "--by", "model", "--csv")
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(rows) != 3 || rows[0][0] != "model" || rows[0][2] != "cost" {
		t.Fatalf("usage CSV: %v %q", err, out)
	}
	var csvCost int64
	for _, r := range rows[1:] {
		v, _ := strconv.ParseInt(r[2], 10, 64)
		csvCost += v
	}
	if csvCost != charged {
		t.Errorf("usage CSV sums to %d, ledger charged %d", csvCost, charged)
	}
	if out := c.ok("usage", "acme"); !strings.Contains(out, today) {
		t.Errorf("usage table by day has no %s:\n%s", today, out)
	}

	// One request by its x-request-id.
	var r struct {
		ID, Org, Model, Status string
		KeyID                  string `json:"key_id"`
		Cost                   int64
		HoldAmount             int64 `json:"hold_amount"`
	}
	c.json(&r, "request", ids[3])
	if r.ID != ids[3] || r.Org != "acme" || r.Model != "gpt-4o" || r.KeyID != k2.ID || r.Status != "accounted" || r.Cost <= 0 || r.HoldAmount < r.Cost {
		t.Fatalf("request %s: %+v", ids[3], r)
	}

	// The ledger and the audit trail.
	var entries []map[string]any
	c.json(&entries, "entries", "acme")
	if len(entries) != 1+n || entries[0]["request_id"] != ids[n-1] || entries[n]["kind"] != "credit" {
		t.Errorf("entries: %d, newest %v, oldest %v", len(entries), entries[0], entries[n])
	}
	if out := c.ok("audit"); !strings.Contains(out, "tester (escrow cli)") || !strings.Contains(out, "POST /admin/v1/orgs/:org/credits") {
		t.Errorf("audit table:\n%s", out)
	}

	// The top spenders: one org, the whole charge.
	var top struct{ Data []map[string]any }
	c.json(&top, "top", "--from", today)
	if len(top.Data) != 1 || top.Data[0]["org"] != "acme" || top.Data[0]["cost"] != float64(charged) {
		t.Errorf("top: %+v, want acme with %d", top.Data, charged)
	}

	// A long export shows a progress line (on a terminal: here a buffer) and still gets every row.
	var prog bytes.Buffer
	pageLimit, progress = "4", &prog
	c.json(&entries, "entries", "acme")
	pageLimit, progress = "1000", nil
	if len(entries) != 1+n || !strings.Contains(prog.String(), "page 2 …") || !strings.Contains(prog.String(), fmt.Sprintf("%d rows in %d pages", 1+n, (1+n+3)/4)) {
		t.Errorf("paged export: %d entries, progress %q", len(entries), prog.String())
	}

	// Webhooks: created with its secret shown once, listed, a revocation delivered to it, deleted.
	var wh struct{ ID, Secret string }
	c.json(&wh, "webhooks", "create", "http://127.0.0.1:1/hook", "--events", "key.revoked,credit.received")
	if !strings.HasPrefix(wh.Secret, "whsec_") {
		t.Fatalf("webhook: %+v", wh)
	}
	if out := c.ok("webhooks"); !strings.Contains(out, wh.ID) || strings.Contains(out, wh.Secret) {
		t.Errorf("webhooks table shows no id or the secret:\n%s", out)
	}
	c.ok("keys", "revoke", k2.ID)
	if out := c.ok("webhooks", "deliveries", wh.ID); !strings.Contains(out, "key.revoked") {
		t.Errorf("deliveries:\n%s", out)
	}
	c.ok("webhooks", "delete", wh.ID)
	if _, err := c.run("webhooks", "create", "http://x"); !errors.As(err, new(*exitError)) {
		t.Errorf("create without --events: %v", err)
	}

	// Reconcile: no drift; the epoch, raised once.
	var d struct {
		Drift int64 `json:"drift"`
		Warm  bool  `json:"warm"`
	}
	c.json(&d, "reconcile", "acme")
	if d.Drift != 0 || !d.Warm {
		t.Errorf("reconcile: %+v", d)
	}
	var e1, e2 struct {
		Generation int64  `json:"generation"`
		ID         string `json:"id"`
	}
	c.json(&e1, "epoch")
	c.json(&e2, "epoch", "raise")
	if e1.Generation < 1 || e2.Generation != e1.Generation+1 || e2.ID == e1.ID {
		t.Errorf("epoch %+v, raised %+v", e1, e2)
	}
	if out := c.ok("orgs", "show", "acme"); !strings.Contains(out, "acme") { // reseeded under the new epoch
		t.Errorf("org after the epoch raise:\n%s", out)
	}

	// Refusals: clear messages and exit codes.
	_, err = c.run("request", "0192f0c4-0000-7000-8000-000000000001")
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitRefused || !strings.Contains(err.Error(), "request_not_found") {
		t.Errorf("unknown request: %v", err)
	}
	_, err = c.run("models", "delete", "gpt-4o")
	if !errors.As(err, &ee) || ee.code != exitRefused || !strings.Contains(err.Error(), "model_in_use") {
		t.Errorf("deleting a used model: %v", err)
	}
	_, err = c.run("credit", "acme", "0.5", "--ref", "x")
	if !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("a fractional credit: %v", err)
	}
	// A wrong method on an admin route: 405 with Allow and a snake_case code.
	req, _ := http.NewRequest("PUT", base+"/admin/v1/orgs/acme", nil)
	req.Header.Set("Authorization", "Bearer "+c.env["ESCROW_ADMIN_TOKEN"])
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 405 || !strings.Contains(resp.Header.Get("Allow"), "GET") || !strings.Contains(string(b), `"code":"method_not_allowed"`) {
		t.Errorf("wrong method: %d Allow=%q %s", resp.StatusCode, resp.Header.Get("Allow"), b)
	}
	select { // the balance crossed the threshold once: one event
	case d := <-got:
		t.Errorf("a second balance.low delivery: %s", d.body)
	default:
	}
}

// TestCLIMigrate: escrow migrate applies every migration to an empty schema, then finds it up to
// date; an unreachable database is exit code 3, a missing URL a usage error.
func TestCLIMigrate(t *testing.T) {
	if testutil.RealPostgresURL() == "" {
		if testutil.RequireServices() {
			t.Fatal("ESCROW_TEST_DATABASE_URL is required")
		}
		t.Skip("needs Postgres (ESCROW_TEST_DATABASE_URL)")
	}
	pg := testutil.Postgres(t)
	c := &cli{t: t, env: map[string]string{"DATABASE_URL": pg.URL}}
	want, err := migrations.All()
	if err != nil {
		t.Fatal(err)
	}
	if out := c.ok("migrate"); !strings.HasPrefix(out, "applied migrations 1 ") || strings.Count(out, " ") != len(want)+1 {
		t.Errorf("first migrate: %q, want all %d", out, len(want))
	}
	if out := c.ok("migrate", "--database-url", pg.URL); out != "the database is up to date\n" {
		t.Errorf("second migrate: %q", out)
	}
	var ee *exitError
	if _, err := c.run("migrate", "--database-url", "postgres://nobody@127.0.0.1:1/x?connect_timeout=1"); !errors.As(err, &ee) || ee.code != exitUnreachable {
		t.Errorf("unreachable database: %v", err)
	}
	c.env = nil
	if _, err := c.run("migrate"); !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("no database URL: %v", err)
	}
}

// postChat sends a chat completion request (JSON body) with key; it fails the test when no
// answer comes. The caller closes the body.
func postChat(t *testing.T, base, key, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest("POST", base+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// chatStatus sends one chat request with key and returns the status and the error code.
func chatStatus(t *testing.T, base, key string) (int, string) {
	t.Helper()
	resp := postChat(t, base, key, `{"model":"gpt-4o-mini","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}`)
	defer resp.Body.Close()
	var e struct {
		Error struct{ Code string } `json:"error"`
	}
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &e)
	return resp.StatusCode, e.Error.Code
}

// TestCLILimits drives limits, projects and freezes through the CLI against the proxy: a key's
// daily cap refuses the request that would pass it, a project freeze stops its keys and not the
// others, an org freeze stops every key, and each lifts again.
func TestCLILimits(t *testing.T) {
	c, base := startCLIProxy(t)
	c.ok("orgs", "create", "acme")
	c.ok("models", "set", "gpt-4o-mini", "--input", "1", "--output", "1", "--max-input-tokens", "1000", "--max-output-tokens", "100", "--default-hold", "1000")
	c.ok("credit", "acme", "10000000", "--ref", "pay-1")
	var k1, k2 struct{ ID, Key string }
	c.json(&k1, "keys", "create", "acme", "--name", "batch")
	c.json(&k2, "keys", "create", "acme", "--name", "web")
	c.ok("projects", "create", "acme", "staging")
	c.ok("projects", "add-key", k2.ID, "staging")

	// A daily cap on k1: one request passes, then the cap is lowered to what it used, and the
	// next request of k1 is refused while k2's pass.
	var lim struct{ ID string }
	c.json(&lim, "limits", "create", "acme", "--key", k1.ID, "--window", "day", "--cap", "1000000")
	if st, code := chatStatus(t, base, k1.Key); st != 200 {
		t.Fatalf("first request: %d %s", st, code)
	}
	var ls []struct {
		ID, Scope, Window string
		ScopeID           string `json:"scope_id"`
		Cap, Used, Held   int64
	}
	c.json(&ls, "limits", "acme")
	if len(ls) != 1 || ls[0].ID != lim.ID || ls[0].ScopeID != k1.ID || ls[0].Window != "day" || ls[0].Used <= 0 || ls[0].Held > ls[0].Used {
		t.Fatalf("limits after one request: %+v", ls)
	}
	used := ls[0].Used                                                     // the window's counter, holds in flight included
	c.ok("limits", "set-cap", "acme", lim.ID, strconv.FormatInt(used, 10)) // lowered to what is used
	if st, code := chatStatus(t, base, k1.Key); st != 429 || code != "budget_exceeded" {
		t.Errorf("k1 over its cap: %d %s, want 429 budget_exceeded", st, code)
	}
	if st, _ := chatStatus(t, base, k2.Key); st != 200 {
		t.Errorf("k2 has no cap: %d", st)
	}
	c.ok("limits", "delete", "acme", lim.ID)
	if st, _ := chatStatus(t, base, k1.Key); st != 200 {
		t.Errorf("k1 after its limit was deleted: %d", st)
	}

	// Freezes: the project (k2 only), the key, the org; each lifted.
	for _, f := range []struct {
		args       []string
		k1Refused  bool
		k2Refused  bool
		code       string
		unfreezeBy []string
	}{
		{[]string{"acme", "--project", "staging"}, false, true, "key_frozen", nil},
		{[]string{"--key", k1.ID}, true, false, "key_frozen", nil},
		{[]string{"acme"}, true, true, "account_frozen", nil},
	} {
		if out := c.ok(append([]string{"freeze"}, f.args...)...); out != "frozen\n" {
			t.Fatalf("freeze %v: %q", f.args, out)
		}
		for _, k := range []struct {
			key     string
			refused bool
		}{{k1.Key, f.k1Refused}, {k2.Key, f.k2Refused}} {
			st, code := chatStatus(t, base, k.key)
			if k.refused && (st != 403 || code != f.code) || !k.refused && st != 200 {
				t.Errorf("freeze %v: %d %s (refused: %v, want code %s)", f.args, st, code, k.refused, f.code)
			}
		}
		c.ok(append([]string{"unfreeze"}, f.args...)...)
		if st, _ := chatStatus(t, base, k1.Key); st != 200 {
			t.Errorf("after unfreeze %v: %d", f.args, st)
		}
	}
	c.ok("projects", "remove-key", k2.ID)
	var ee *exitError
	if _, err := c.run("freeze", "acme", "--key", k1.ID); !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("freeze with both an org and a key: %v", err)
	}
	if _, err := c.run("limits", "create", "acme", "--window", "fortnight", "--cap", "5"); !errors.As(err, &ee) || ee.code != exitRefused {
		t.Errorf("a window that does not exist: %v", err)
	}
}

// TestCLIEndUsers (issue 26): limits of each end user apart (--each-end-user) and of one end
// user (--end-user) are created through the CLI, the list shows the end-user count of the
// former, `limits end-users` lists its end users (none yet: requests here carry no end user,
// and an end-user limit never counts a request without one), a limit that is not of each end
// user apart is refused there, and `usage --by end_user` groups the requests (no end user: "").
func TestCLIEndUsers(t *testing.T) {
	c, base := startCLIProxy(t)
	c.ok("orgs", "create", "acme")
	c.ok("models", "set", "gpt-4o-mini", "--input", "1", "--output", "1", "--max-input-tokens", "1000", "--max-output-tokens", "100", "--default-hold", "1000")
	c.ok("credit", "acme", "10000000", "--ref", "pay-1")
	var k struct{ ID, Key string }
	c.json(&k, "keys", "create", "acme")
	var each, one struct {
		ID, Scope string
		ScopeID   string `json:"scope_id"`
	}
	c.json(&each, "limits", "create", "acme", "--each-end-user", "--window", "day", "--unit", "requests", "--cap", "1")
	c.json(&one, "limits", "create", "acme", "--end-user", "alice", "--window", "day", "--cap", "5")
	if each.Scope != "end_user" || each.ScopeID != "" || one.Scope != "end_user" || one.ScopeID != "alice" {
		t.Fatalf("created %+v and %+v", each, one)
	}
	for range 2 { // past the per-end-user cap of 1: requests without an end user are not counted
		if st, code := chatStatus(t, base, k.Key); st != 200 {
			t.Fatalf("a request without an end user: %d %s", st, code)
		}
	}
	var ls []struct {
		ID       string
		EndUsers *int `json:"end_users"`
	}
	c.json(&ls, "limits", "acme")
	if len(ls) != 2 || ls[0].ID != each.ID || ls[0].EndUsers == nil || *ls[0].EndUsers != 0 || ls[1].EndUsers != nil {
		t.Fatalf("limits: %+v, want the end-user count of the first only (0)", ls)
	}
	if out := c.ok("limits", "end-users", "acme", each.ID, "--csv"); out != "end_user,used,held\n" {
		t.Fatalf("end users: %q", out)
	}
	var ee *exitError
	if _, err := c.run("limits", "end-users", "acme", one.ID); !errors.As(err, &ee) || ee.code != exitRefused {
		t.Errorf("end users of a limit of one end user: %v", err)
	}
	if _, err := c.run("limits", "create", "acme", "--each-end-user", "--key", k.ID, "--window", "day", "--cap", "5"); !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("a limit of both a key and each end user: %v", err)
	}
	if _, err := c.run("limits", "create", "acme", "--end-user", "bob", "--require-end-user", "--window", "day", "--cap", "5"); !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("--require-end-user on a limit of one end user: %v", err)
	}
	var org struct {
		LedgerSeq int64 `json:"ledger_seq"`
	}
	deadline := time.Now().Add(time.Minute) // the worker accounts both requests: 1 credit + 2 charges
	for c.json(&org, "orgs", "show", "acme"); org.LedgerSeq < 3; c.json(&org, "orgs", "show", "acme") {
		if time.Now().After(deadline) {
			t.Fatalf("ledger has %d entries, want 3", org.LedgerSeq)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var p struct{ Data []usageRow }
	c.json(&p, "usage", "acme", "--by", "end_user")
	if len(p.Data) != 1 || p.Data[0].Group != "" || p.Data[0].Requests != 2 {
		t.Fatalf("usage by end user: %+v", p.Data)
	}
}

// TestCLICSVFormulaCells (issue 22 item 5): --csv quotes the cells a spreadsheet would run as
// formulas and leaves numbers as they are.
func TestCLICSVFormulaCells(t *testing.T) {
	var out bytes.Buffer
	stdout = &out
	defer func() { stdout = nil }()
	rows := [][]string{{"=HYPERLINK(\"http://evil.example\")", i64(-5)}, {"@SUM(1)", i64(3)}}
	if err := (output{csv: true}).print(nil, []string{"reference", "delta"}, rows); err != nil {
		t.Fatal(err)
	}
	got, err := csv.NewReader(&out).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{{"reference", "delta"}, {`'=HYPERLINK("http://evil.example")`, "-5"}, {"'@SUM(1)", "3"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("CSV %q, want %q", got, want)
	}
}
