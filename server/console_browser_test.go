package server

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
)

// The console in a real browser (issue 37): Debian's chromium, headless, driven with chromedp
// over the proxy's own /console/. Each step compares what the page shows with the ledger, and
// each page is kept as a screenshot under consoleArtifacts() (the path is logged).

// chromiumPath finds the browser: $ESCROW_CHROMIUM, else chromium (Debian's package, which
// scripts/services.sh installs), chromium-browser or google-chrome on the PATH.
func chromiumPath() string {
	if p := os.Getenv("ESCROW_CHROMIUM"); p != "" {
		return p
	}
	for _, n := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	return ""
}

// consoleArtifacts is the directory of the screenshots: $ESCROW_TEST_ARTIFACTS/console, by
// default <temp dir>/escrow-test-artifacts/console; emptied by each run.
func consoleArtifacts(t *testing.T) string {
	root := os.Getenv("ESCROW_TEST_ARTIFACTS")
	if root == "" {
		root = filepath.Join(os.TempDir(), "escrow-test-artifacts")
	}
	dir := filepath.Join(root, "console")
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// browser starts a headless chromium with a fresh profile; a missing browser fails the test
// when services are required (make test), else skips it.
func browser(t *testing.T) context.Context {
	t.Helper()
	path := chromiumPath()
	if path == "" {
		if testutil.RequireServices() {
			t.Fatal("chromium is not installed (scripts/services.sh installs it; ESCROW_CHROMIUM names another)")
		}
		t.Skip("chromium is not installed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	actx, acancel := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 1000),
	)
	t.Cleanup(acancel)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(bcancel)
	if err := chromedp.Do(bctx); err != nil { // starts the browser
		t.Fatalf("start chromium (%s): %v", path, err)
	}
	return bctx
}

// tab is one browser tab (its own cookies when fresh) on the proxy, with the test's helpers.
type tab struct {
	t    *testing.T
	ctx  context.Context
	base string
	dir  string
}

func (b *tab) do(what string, steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		// What the page says, and a screenshot of it, for the failure.
		body, _ := chromedp.Run(b.ctx, chromedp.Text(chromedp.CSS("body")))
		if png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100)); err == nil {
			_ = os.WriteFile(filepath.Join(b.dir, "failed.png"), png, 0o644)
		}
		b.t.Fatalf("%s: %v\npage: %s", what, err, body)
	}
}

func (b *tab) text(sel string) string {
	b.t.Helper()
	s, err := chromedp.Run(b.ctx, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		b.t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}

func (b *tab) attr(sel, name string) string {
	b.t.Helper()
	r, err := chromedp.Run(b.ctx, chromedp.AttributeValue(chromedp.CSS(sel), name))
	if err != nil || !r.Exists {
		b.t.Fatalf("attribute %s of %s: %v (exists %v)", name, sel, err, r.Exists)
	}
	return r.Value
}

func (b *tab) micros(sel string) int64 {
	b.t.Helper()
	v, err := strconv.ParseInt(b.attr(sel, "data-micros"), 10, 64)
	if err != nil {
		b.t.Fatalf("data-micros of %s: %v", sel, err)
	}
	return v
}

func (b *tab) open(path, waitFor string) {
	b.t.Helper()
	b.do("open "+path, chromedp.Navigate(b.base+path), chromedp.WaitVisible(chromedp.CSS(waitFor)))
}

// submit fills a form's fields (by name), clicks its button and waits for the message the
// write leaves on the next page (a flash containing want).
func (b *tab) submit(form string, fields map[string]string, want string) {
	b.t.Helper()
	steps := []chromedp.Action[chromedp.Void]{}
	for name, v := range fields {
		steps = append(steps, chromedp.SetValue(chromedp.CSS(form+` [name="`+name+`"]`), v))
	}
	steps = append(steps, chromedp.Click(chromedp.CSS(form+" button")),
		chromedp.WaitVisible(chromedp.Search(`//p[contains(@class,"flash") and contains(., "`+want+`")]`)))
	b.do("submit "+form, steps...)
}

// shot keeps the whole page as name.png.
func (b *tab) shot(name string) {
	b.t.Helper()
	png, err := chromedp.Run(b.ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.t.Fatalf("screenshot %s: %v", name, err)
	}
	if err := os.WriteFile(filepath.Join(b.dir, name+".png"), png, 0o644); err != nil {
		b.t.Fatal(err)
	}
}

// TestConsoleBrowser: an operator logs in, reads the orgs and an org's balance and charts (equal
// to the ledger's and the hot balance's numbers), creates a key (which then works) and revokes
// it (which then stops), sets a limit (the next request is refused) and raises it (served
// again), freezes and unfreezes the org; a customer logs in with its key and sees its own
// numbers (equal to the customer views') and nothing of another org.
func TestConsoleBrowser(t *testing.T) {
	t.Parallel()
	bctx := browser(t)
	real := testutil.RealRedisURL() != "" && os.Getenv("ESCROW_TEST_DATABASE_URL") != ""
	p := startTestProxy(t, real, func(c *Config) { c.KeyCacheTTL = 10 * time.Millisecond })
	ctx := context.Background()
	key := p.setup("acme", 50_000_000, 1000)
	keyBeta := p.setup("beta", 7_000_000, 1000)
	for i := range 3 {
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat(fmt.Sprintf("hello %d", i))); st != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, st, b)
		}
	}
	if st, _, b := p.do("POST", "/v1/chat/completions", keyBeta, chat("beta")); st != http.StatusOK {
		t.Fatalf("beta request: %d %s", st, b)
	}
	p.settled("acme")
	p.settled("beta")

	dir := consoleArtifacts(t)
	t.Logf("console screenshots: %s", dir)
	op := &tab{t: t, ctx: bctx, base: p.base, dir: dir}

	// Log in as the operator.
	op.open("/console/login", "#login-operator")
	op.shot("01-login")
	op.do("log in", chromedp.SendKeys(chromedp.CSS(`#login-operator input[name="secret"]`), testAdmin),
		chromedp.Click(chromedp.CSS("#login-operator button")), chromedp.WaitVisible(chromedp.CSS("#orgs")))
	op.shot("02-orgs")
	acct, err := p.app.ledger.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	if got := op.micros(`tr[data-org="acme"] td.ledger`); got != acct.Balance {
		t.Fatalf("orgs page: acme's ledger balance %d, ledger %d", got, acct.Balance)
	}

	// The org's page: the money and the charts, as the ledger and the hot balance have them.
	op.open("/console/orgs/acme", "#chart-day")
	op.shot("03-org")
	bal := p.balance("acme")
	for sel, want := range map[string]int64{"#available": bal.Available, "#held": bal.Held, "#ledger-balance": bal.LedgerBalance} {
		if got := op.micros(sel); got != want {
			t.Fatalf("org page %s = %d, want %d (balance %+v)", sel, got, want, bal)
		}
	}
	from := time.Now().UTC().Truncate(24*time.Hour).AddDate(0, 0, -29)
	for _, g := range []struct{ group, chart string }{{ledger.GroupByDay, "#chart-day"}, {ledger.GroupByModel, "#chart-model"}} {
		rows, err := p.app.ledger.UsageReport(ctx, "acme", ledger.UsageQuery{From: from, GroupBy: g.group})
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]int64{}
		var total int64
		for _, r := range rows {
			want[r.Group], total = r.Cost, total+r.Cost
		}
		bars, err := chromedp.Run(bctx, chromedp.AttributesAll(chromedp.CSSAll(g.chart+" rect.bar")))
		if err != nil {
			t.Fatal(err)
		}
		var shown int64
		for _, a := range bars {
			c, _ := strconv.ParseInt(a["data-cost"], 10, 64)
			shown += c
			if c != want[a["data-group"]] {
				t.Fatalf("%s bar %s: cost %d, ledger %d", g.chart, a["data-group"], c, want[a["data-group"]])
			}
		}
		if shown != total || total == 0 || (g.group == ledger.GroupByDay && len(bars) != 30) {
			t.Fatalf("%s: %d bars summing to %d, ledger %d", g.chart, len(bars), shown, total)
		}
	}

	// A key made in the console works; revoked in the console, it stops.
	op.submit("#create-key", map[string]string{"name": "browser"}, "Copy its secret now")
	op.shot("04-key-created")
	secret := op.text("#new-key-secret")
	k, err := p.app.ledger.LookupKey(ctx, secret)
	if err != nil || k.Org != "acme" {
		t.Fatalf("the console's new key: %+v %v", k, err)
	}
	if st, _, b := p.do("POST", "/v1/chat/completions", secret, chat("new key")); st != http.StatusOK {
		t.Fatalf("request with the console's key: %d %s", st, b)
	}
	op.submit(`tr[data-key="`+k.ID+`"]`, nil, "Key "+k.ID+" revoked.")
	if s := op.text(`tr[data-key="` + k.ID + `"] td.state`); !strings.HasPrefix(s, "revoked") {
		t.Fatalf("revoked key's state: %q", s)
	}
	op.shot("05-key-revoked")
	waitStatus(t, p, secret, http.StatusUnauthorized, "invalid_api_key")

	// A limit set in the console refuses the next request; raised, it lets requests through.
	op.submit("#create-limit", map[string]string{"scope": "org", "window": "day", "unit": "money", "cap": "0.000001"}, "created.")
	lim := op.attr("#limits tr.limit", "data-limit")
	if c := op.attr(`tr[data-limit="`+lim+`"] input.cap`, "data-cap"); c != "1" {
		t.Fatalf("limit cap shown: %s, want 1 micro-unit", c)
	}
	op.shot("06-limit-set")
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("over the limit")); st != http.StatusTooManyRequests || !strings.Contains(string(b), "budget_exceeded") {
		t.Fatalf("request over the console's limit: %d %s", st, b)
	}
	op.submit(`tr[data-limit="`+lim+`"] form.inline`, map[string]string{"cap": "1000"}, "Limit "+lim+" changed.")
	op.shot("07-limit-raised")
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("under the raised limit")); st != http.StatusOK {
		t.Fatalf("request under the raised limit: %d %s", st, b)
	}

	// Frozen in the console: refused; unfrozen: served.
	op.submit("#status-freeze", nil, "Org frozen")
	op.shot("08-frozen")
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("frozen")); st != http.StatusForbidden || !strings.Contains(string(b), "account_frozen") {
		t.Fatalf("request of a frozen org: %d %s", st, b)
	}
	op.submit("#status-unfreeze", nil, "Org unfrozen")
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("unfrozen")); st != http.StatusOK {
		t.Fatalf("request after unfreeze: %d %s", st, b)
	}

	// The other operator pages; the audit log names the console's writes.
	op.open("/console/models", "#models")
	if got := op.micros(`tr[data-model="m"] td[data-class="output"]`); got != 1_000_000 {
		t.Fatalf("model m's output price on the page: %d", got)
	}
	op.shot("09-models")
	op.open("/console/audit", "#audit")
	if a := op.text("#audit tr.audit td:nth-child(3)"); a != "console" {
		t.Fatalf("latest audit record's actor: %q", a)
	}
	op.shot("10-audit")
	op.open("/console/webhooks", "main")
	op.shot("11-webhooks")

	// A customer (a browser of its own: no operator cookie) sees its org's numbers, as the
	// customer views answer them, and nothing of another org.
	cctx := browser(t)
	cu := &tab{t: t, ctx: cctx, base: p.base, dir: dir}
	cu.open("/console/login", "#login-customer")
	cu.do("customer log in", chromedp.SendKeys(chromedp.CSS(`#login-customer input[name="secret"]`), keyBeta),
		chromedp.Click(chromedp.CSS("#login-customer button")), chromedp.WaitVisible(chromedp.CSS("#credited")))
	cu.shot("12-customer")
	v, err := p.app.esc.Ops().CustomerView(ctx, "beta", "")
	if err != nil {
		t.Fatal(err)
	}
	for sel, want := range map[string]int64{"#available": v.Available, "#credited": v.Credited, "#charged": v.Charged, "#held": v.Held} {
		if got := cu.micros(sel); got != want {
			t.Fatalf("customer page %s = %d, customer view %d", sel, got, want)
		}
	}
	html, err := chromedp.Run(cctx, chromedp.OuterHTML(chromedp.CSS("html")))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(html, "acme") || !strings.Contains(html, "Org beta") {
		t.Fatal("the customer's page names another org, or not its own")
	}
	cu.open("/console/orgs/acme", "body")
	if b := cu.text("body"); !strings.Contains(b, "operators only") || strings.Contains(b, "acme") {
		t.Fatalf("customer on acme's page: %q", b)
	}
	cu.shot("13-customer-forbidden")
}

// waitStatus waits (the key cache's TTL) until a request with key is answered status and code.
func waitStatus(t *testing.T, p *testProxy, key string, status int, code string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		st, _, b := p.do("POST", "/v1/chat/completions", key, chat("after"))
		if st == status && strings.Contains(string(b), code) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("request with key: %d %s, want %d %s", st, b, status, code)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
