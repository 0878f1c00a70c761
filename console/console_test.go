package console_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/console"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

const token = "operator-token"

type fixture struct {
	ops *accounting.Ops
	w   *accounting.Worker
	led *memledger.Ledger
	srv *httptest.Server
}

// newFixture is the console over the memory ledger and a hot balance (miniredis or the real
// Redis), with the admin API it writes through on an Echo of its own, served over HTTP.
func newFixture(tb testing.TB) *fixture {
	tb.Helper()
	env := testutil.Redis(tb)
	led := memledger.New()
	store, err := balance.New(context.Background(), env.Client, &balance.Config{Ledger: led, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		tb.Fatal(err)
	}
	w, err := accounting.NewWorker(led, store, nil)
	if err != nil {
		tb.Fatal(err)
	}
	ops := accounting.NewOps(w)
	api, err := admin.New(ops, &admin.Config{Token: token})
	if err != nil {
		tb.Fatal(err)
	}
	adm := echo.New()
	api.Register(adm.Group("/admin/v1"))
	con, err := console.New(ops, &console.Config{Admin: adm, Token: token})
	if err != nil {
		tb.Fatal(err)
	}
	e := echo.New()
	con.Register(e.Group("/console"))
	srv := httptest.NewServer(e)
	tb.Cleanup(srv.Close)
	return &fixture{ops: ops, w: w, led: led, srv: srv}
}

// seed makes org with a credit, a priced model, a key, and n accounted requests of cost each,
// spread over the last days; it returns the key's secret.
func (f *fixture) seed(tb testing.TB, org string, credit int64, n int, cost int64) string {
	tb.Helper()
	ctx := context.Background()
	if err := f.ops.PutModel(ctx, ledger.Model{Name: "gpt-x", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000}, DefaultHold: 1000}); err != nil {
		tb.Fatal(err)
	}
	if err := f.ops.CreateNamedOrg(ctx, org, ""); err != nil {
		tb.Fatal(err)
	}
	if _, _, err := f.ops.Credit(ctx, org, credit, "init-"+org); err != nil {
		tb.Fatal(err)
	}
	k, secret, err := f.ops.CreateNamedKey(ctx, org, "main")
	if err != nil {
		tb.Fatal(err)
	}
	now := time.Now().UTC()
	evs := make([]ledger.UsageEvent, n)
	for i := range evs {
		at := now.Add(-time.Duration(i%5) * 24 * time.Hour)
		evs[i] = ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: org, KeyID: k.ID, Model: []string{"gpt-x", "gpt-y"}[i%2],
			Usage: pricing.Usage{Prompt: 10, Completion: 20}, Cost: cost, ReservedAt: at, CreatedAt: at}
	}
	for len(evs) > 0 {
		b := evs[:min(len(evs), 500)]
		evs = evs[len(b):]
		if err := f.led.RecordUsage(ctx, b); err != nil {
			tb.Fatal(err)
		}
	}
	for {
		if _, err := f.w.AccountAll(ctx); err != nil {
			tb.Fatal(err)
		}
		acct, err := f.led.Account(ctx, org)
		if err != nil {
			tb.Fatal(err)
		}
		if acct.Pending == 0 {
			break
		}
	}
	return secret
}

// client is a browser-like client: cookies kept, redirects followed.
func (f *fixture) client(tb testing.TB) *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar}
}

var csrfRe = regexp.MustCompile(`name="_csrf" value="([0-9a-f]+)"`)

func get(tb testing.TB, c *http.Client, u string) (int, string, http.Header) {
	tb.Helper()
	resp, err := c.Get(u)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

func post(tb testing.TB, c *http.Client, u string, form url.Values) (int, string) {
	tb.Helper()
	resp, err := c.PostForm(u, form)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// login logs c in with secret as kind and returns the session's CSRF token.
func (f *fixture) login(tb testing.TB, c *http.Client, kind, secret string) (int, string) {
	tb.Helper()
	_, page, _ := get(tb, c, f.srv.URL+"/console/login")
	m := csrfRe.FindStringSubmatch(page)
	if m == nil {
		tb.Fatalf("no CSRF token on the login page: %s", page)
	}
	st, body := post(tb, c, f.srv.URL+"/console/login", url.Values{"_csrf": {m[1]}, "kind": {kind}, "secret": {secret}})
	if m := csrfRe.FindStringSubmatch(body); m != nil {
		return st, m[1]
	}
	return st, ""
}

// TestConsoleSecurity: the headers, the cookie's flags, a wrong token, a write without or with
// a wrong CSRF token or from another origin, and a customer's reach (its own org only).
func TestConsoleSecurity(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	secretA := f.seed(t, "acme", 5_000_000, 4, 1000)
	f.seed(t, "other", 1_000_000, 2, 1000)

	c := f.client(t)
	st, _, h := get(t, c, f.srv.URL+"/console/login")
	if st != http.StatusOK || !strings.Contains(h.Get("Content-Security-Policy"), "default-src 'none'") ||
		strings.Contains(h.Get("Content-Security-Policy"), "unsafe") || h.Get("X-Frame-Options") != "DENY" {
		t.Fatalf("login page: %d, headers %v", st, h)
	}
	if st, _ := f.login(t, c, "operator", "wrong"); st != http.StatusUnauthorized {
		t.Fatalf("wrong admin token: %d, want 401", st)
	}
	// A login post without the login cookie's token is refused.
	if st, _ := post(t, f.client(t), f.srv.URL+"/console/login", url.Values{"kind": {"operator"}, "secret": {token}}); st != http.StatusForbidden {
		t.Fatalf("login without CSRF: %d, want 403", st)
	}
	st, csrf := f.login(t, c, "operator", token)
	if st != http.StatusOK || csrf == "" {
		t.Fatalf("operator login: %d", st)
	}
	u, _ := url.Parse(f.srv.URL + "/console/")
	var sess *http.Cookie
	for _, ck := range c.Jar.Cookies(u) {
		if ck.Name == console.CookieName {
			sess = ck
		}
	}
	if sess == nil {
		t.Fatal("no session cookie")
	}
	// The jar hides the flags: read them from a fresh login's Set-Cookie.
	{
		c2 := f.client(t)
		_, page, _ := get(t, c2, f.srv.URL+"/console/login")
		m := csrfRe.FindStringSubmatch(page)
		req, _ := http.NewRequest("POST", f.srv.URL+"/console/login", strings.NewReader(url.Values{"_csrf": {m[1]}, "kind": {"operator"}, "secret": {token}}.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for _, ck := range c2.Jar.Cookies(u) {
			req.AddCookie(ck)
		}
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		var found bool
		for _, ck := range resp.Cookies() {
			if ck.Name == console.CookieName {
				found = true
				if !ck.HttpOnly || ck.SameSite != http.SameSiteStrictMode || ck.Path != "/console/" {
					t.Fatalf("session cookie flags: %+v", ck)
				}
			}
		}
		if !found {
			t.Fatalf("no session cookie set: %v", resp.Header)
		}
	}

	// Writes without the CSRF token, with another session's, or from another origin: refused,
	// and nothing reaches the admin API (no audit record).
	keys := func() int {
		p, err := f.led.ListKeys(context.Background(), "acme", ledger.ListQuery{})
		if err != nil {
			t.Fatal(err)
		}
		return len(p.Data)
	}
	before := keys()
	if st, _ := post(t, c, f.srv.URL+"/console/orgs/acme/keys", url.Values{"name": {"x"}}); st != http.StatusForbidden {
		t.Fatalf("write without CSRF: %d", st)
	}
	if st, _ := post(t, c, f.srv.URL+"/console/orgs/acme/keys", url.Values{"name": {"x"}, "_csrf": {strings.Repeat("0", 64)}}); st != http.StatusForbidden {
		t.Fatalf("write with a wrong CSRF: %d", st)
	}
	req, _ := http.NewRequest("POST", f.srv.URL+"/console/orgs/acme/keys", strings.NewReader(url.Values{"name": {"x"}, "_csrf": {csrf}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", "https://evil.example")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden || keys() != before {
		t.Fatalf("cross-origin write: %d, keys %d → %d", resp.StatusCode, before, keys())
	}
	// The right token: the key is made through the admin API, which audits it.
	st, body := post(t, c, f.srv.URL+"/console/orgs/acme/keys", url.Values{"name": {"ci"}, "_csrf": {csrf}})
	if st != http.StatusOK || !strings.Contains(body, `id="new-key-secret"`) || keys() != before+1 {
		t.Fatalf("create key: %d, keys %d → %d\n%s", st, before, keys(), body)
	}
	audit, err := f.led.AuditLog(context.Background(), ledger.ListQuery{})
	if err != nil || len(audit.Data) == 0 || audit.Data[0].Actor != "console" || audit.Data[0].Action != "POST /admin/v1/orgs/:org/keys" {
		t.Fatalf("audit after the console's write: %+v %v", audit.Data, err)
	}

	// A customer sees its own org and nothing of the operator's pages.
	cc := f.client(t)
	if st, _ := f.login(t, cc, "customer", "sk-wrong"); st != http.StatusUnauthorized {
		t.Fatalf("wrong key: %d", st)
	}
	st, _ = f.login(t, cc, "customer", secretA)
	if st != http.StatusOK {
		t.Fatalf("customer login: %d", st)
	}
	for _, p := range []string{"/console/orgs", "/console/orgs/other", "/console/orgs/acme", "/console/audit", "/console/models"} {
		if st, body, _ := get(t, cc, f.srv.URL+p); st != http.StatusForbidden || strings.Contains(body, "other") {
			t.Fatalf("customer GET %s: %d", p, st)
		}
	}
	if st, _ := post(t, cc, f.srv.URL+"/console/orgs/other/freeze", url.Values{}); st != http.StatusForbidden {
		t.Fatalf("customer write: %d", st)
	}
	st, body, _ = get(t, cc, f.srv.URL+"/console/me")
	if st != http.StatusOK || !strings.Contains(body, "Org acme") || strings.Contains(body, "data-org") {
		t.Fatalf("customer page: %d\n%s", st, body)
	}
	v, err := f.ops.CustomerView(context.Background(), "acme", "")
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]int64{"available": v.Available, "credited": v.Credited, "charged": v.Charged} {
		if !strings.Contains(body, fmt.Sprintf(`id="%s" data-micros="%d"`, id, want)) {
			t.Fatalf("customer page lacks %s = %d:\n%s", id, want, body)
		}
	}
}

// TestMoney: amounts are exact decimals.
func TestMoney(t *testing.T) {
	t.Parallel()
	for in, want := range map[int64]string{0: "0", 1: "0.000001", 1950810: "1.95081", -5: "-0.000005", 12_000_000: "12", -1_500_000: "-1.5"} {
		if got := console.Money(in); got != want {
			t.Errorf("Money(%d) = %q, want %q", in, got, want)
		}
	}
}

// BenchmarkPages: the cost of each page on the memory ledger, for an org of 2,000 accounted
// requests (the org page reads two usage reports over 30 days, a page of entries, the keys and
// the limits; the customer page adds CustomerView, which sums every charge of the org).
func BenchmarkPages(b *testing.B) {
	f := newFixture(b)
	secret := f.seed(b, "acme", 1_000_000_000, 2000, 1000)
	op, cu := f.client(b), f.client(b)
	if st, _ := f.login(b, op, "operator", token); st != http.StatusOK {
		b.Fatal("operator login", st)
	}
	if st, _ := f.login(b, cu, "customer", secret); st != http.StatusOK {
		b.Fatal("customer login", st)
	}
	for _, p := range []struct {
		name string
		c    *http.Client
		path string
	}{{"orgs", op, "/console/orgs"}, {"org", op, "/console/orgs/acme"}, {"models", op, "/console/models"},
		{"audit", op, "/console/audit"}, {"me", cu, "/console/me"}} {
		b.Run(p.name, func(b *testing.B) {
			for b.Loop() {
				if st, _, _ := get(b, p.c, f.srv.URL+p.path); st != http.StatusOK {
					b.Fatal(p.path, st)
				}
			}
		})
	}
}

// TestModelsPage: the models page shows a column per price class some model prices (defaults
// applied), each cell the model's price of that class.
func TestModelsPage(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.seed(t, "acme", 1_000_000, 1, 1000) // prices gpt-x: input 1, output 2 per token
	c := f.client(t)
	if st, _ := f.login(t, c, "operator", token); st != http.StatusOK {
		t.Fatalf("operator login: %d", st)
	}
	st, body, _ := get(t, c, f.srv.URL+"/console/models")
	for _, want := range []string{`data-model="gpt-x"`, `data-class="input" data-micros="1000000"`, `data-class="output" data-micros="2000000"`,
		`data-class="cached_input" data-micros="1000000"`} {
		if st != http.StatusOK || !strings.Contains(body, want) {
			t.Fatalf("models page: %d, lacks %s:\n%s", st, want, body)
		}
	}
}
