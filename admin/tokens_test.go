package admin_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
)

// tokenCall calls the admin API mounted at /admin/v1 with a bearer token.
func tokenCall(e *echo.Echo, method, path, token, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, "/admin/v1"+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+token)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, req)
	return rec
}

// newToken makes a scoped token with the bootstrap token and returns it.
func newToken(t *testing.T, e *echo.Echo, name, scope string) admin.Token {
	t.Helper()
	rec := tokenCall(e, "POST", "/tokens", "tok", `{"name":"`+name+`","scope":"`+scope+`"}`)
	var tok admin.Token
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &tok) != nil || tok.Token == "" {
		t.Fatalf("create %s token: %d %s", scope, rec.Code, rec.Body)
	}
	return tok
}

// adminRoutes is every route of the admin group with its parameters filled in by fill.
func adminRoutes(e *echo.Echo, fill map[string]string) (routes []struct{ method, route, path string }) {
	for _, r := range e.Routes() {
		route, ok := strings.CutPrefix(r.Path, "/admin/v1")
		if !ok || r.Method == echo.RouteNotFound {
			continue
		}
		parts := strings.Split(route, "/")
		for i, p := range parts {
			if name, ok := strings.CutPrefix(p, ":"); ok {
				parts[i] = fill[name]
			}
		}
		routes = append(routes, struct{ method, route, path string }{r.Method, route, strings.Join(parts, "/")})
	}
	return routes
}

// TestReadTokenWritesNothing walks Echo's route table, so a route added later is covered too: a
// read token gets 403 insufficient_scope on every route that is not a GET (before its handler
// runs: nothing is written, nothing audited), and no GET refuses it.
func TestReadTokenWritesNothing(t *testing.T) {
	t.Parallel()
	e, l, _ := mountAdmin(t, "/admin/v1")
	c := context.Background()
	if err := l.CreateOrg(c, "acme"); err != nil {
		t.Fatal(err)
	}
	k, _, err := l.CreateKey(c, "acme")
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"", "root", "org:", "org:a{b}", "ORG:a", "read "} {
		if rec := tokenCall(e, "POST", "/tokens", "tok", `{"scope":"`+bad+`"}`); rec.Code != http.StatusBadRequest {
			t.Errorf("scope %q: %d %s, want 400", bad, rec.Code, rec.Body)
		}
	}
	read := newToken(t, e, "dash", admin.ScopeRead)
	auditBefore := len(mustAudit(t, l))
	var writes, reads int
	for _, r := range adminRoutes(e, map[string]string{"org": "acme", "id": k.ID, "model": "m"}) {
		rec := tokenCall(e, r.method, r.path, read.Token, `{}`)
		if r.method == http.MethodGet {
			reads++
			if rec.Code == http.StatusForbidden || rec.Code == http.StatusUnauthorized {
				t.Errorf("read token on GET %s: %d %s", r.route, rec.Code, rec.Body)
			}
			continue
		}
		writes++
		if rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), `"code":"insufficient_scope"`) {
			t.Errorf("read token on %s %s: %d %s, want 403", r.method, r.route, rec.Code, rec.Body)
		}
	}
	if writes < 25 || reads < 15 {
		t.Fatalf("walked %d write and %d read routes: the route table was not walked", writes, reads)
	}
	if n := len(mustAudit(t, l)); n != auditBefore {
		t.Fatalf("audit grew from %d to %d: a refused write reached its handler", auditBefore, n)
	}
}

func mustAudit(t *testing.T, l ledger.Console) []ledger.AuditRecord {
	t.Helper()
	p, err := l.AuditLog(context.Background(), ledger.ListQuery{Limit: ledger.MaxPageSize})
	if err != nil {
		t.Fatal(err)
	}
	return p.Data
}

// TestOrgTokenScope: an org:a token reaches org a's keys, limits, usage and credits; on every
// route of org b (and on b's keys) it gets 404, and on every route outside its scope 403. The
// walk covers every route of the table.
func TestOrgTokenScope(t *testing.T) {
	t.Parallel()
	e, l, _ := mountAdmin(t, "/admin/v1")
	c := context.Background()
	keys := map[string]string{}
	for _, org := range []string{"a", "b"} {
		if err := l.CreateOrg(c, org); err != nil {
			t.Fatal(err)
		}
		k, _, err := l.CreateKey(c, org)
		if err != nil {
			t.Fatal(err)
		}
		keys[org] = k.ID
	}
	tok := newToken(t, e, "tenant-a", "org:a")
	var inScope int
	for _, r := range adminRoutes(e, map[string]string{"org": "b", "id": keys["b"], "model": "m"}) {
		rec := tokenCall(e, r.method, r.path, tok.Token, `{}`)
		want := http.StatusForbidden
		if strings.HasPrefix(r.route, "/orgs/:org") || strings.HasPrefix(r.route, "/keys/:id") {
			// Org b's routes and b's keys: 404 where an org token may go, 403 elsewhere.
			if rec.Code == http.StatusNotFound {
				inScope++
				continue
			}
		}
		if rec.Code != want {
			t.Errorf("org:a token on %s %s (org b): %d %s", r.method, r.route, rec.Code, rec.Body)
		}
	}
	if inScope < 10 {
		t.Fatalf("only %d routes answered 404 for org b", inScope)
	}
	for _, step := range []struct {
		method, path, body string
		want               int
	}{
		{"GET", "/orgs/a", "", 200},
		{"GET", "/orgs/a/balance", "", 200},
		{"POST", "/orgs/a/credits", `{"amount":500,"reference":"pay-a"}`, 201},
		{"GET", "/orgs/a/entries", "", 200},
		{"GET", "/orgs/a/usage", "", 200},
		{"POST", "/orgs/a/keys", `{"name":"ci"}`, 201},
		{"GET", "/orgs/a/keys", "", 200},
		{"POST", "/orgs/a/limits", `{"scope":"org","window":"day","cap":100}`, 201},
		{"GET", "/orgs/a/limits", "", 200},
		{"PATCH", "/keys/" + keys["a"], `{"name":"renamed"}`, 200},
		{"DELETE", "/keys/" + keys["a"], "", 204},
		{"POST", "/orgs/b/credits", `{"amount":500,"reference":"pay-b"}`, 404},
		{"DELETE", "/keys/" + keys["b"], "", 404},
		{"DELETE", "/keys/key_nope", "", 404},
		{"POST", "/orgs/a/adjustments", `{"amount":500,"reference":"adj-a"}`, 403},
		{"POST", "/orgs/a/freeze", "", 403},
		{"POST", "/orgs/a/unfreeze", "", 403},
		{"GET", "/orgs", "", 403},
		{"GET", "/models", "", 403},
		{"POST", "/tokens", `{"scope":"admin"}`, 403},
	} {
		if rec := tokenCall(e, step.method, step.path, tok.Token, step.body); rec.Code != step.want {
			t.Errorf("org:a %s %s: %d %s, want %d", step.method, step.path, rec.Code, rec.Body, step.want)
		}
	}
	if a, _ := l.Account(c, "a"); a.Balance != 500 {
		t.Fatalf("org a's balance %d, want the org token's credit 500", a.Balance)
	}
	if b, _ := l.Account(c, "b"); b.Balance != 0 {
		t.Fatalf("org b's balance %d, want 0", b.Balance)
	}
}

// TestTokenRotationAndRevocation: a rotated token and its successor both work during the
// overlap; a rotation without overlap ends the old one at once; a revoked token is refused at
// once; the audit trail names the token of each write.
func TestTokenRotationAndRevocation(t *testing.T) {
	t.Parallel()
	e, l, _ := mountAdmin(t, "/admin/v1")
	first := newToken(t, e, "ci", admin.ScopeAdmin)
	works := func(secret string) bool {
		return tokenCall(e, "GET", "/orgs", secret, "").Code == http.StatusOK
	}
	if !works(first.Token) {
		t.Fatal("new token refused")
	}
	rec := tokenCall(e, "POST", "/tokens/"+first.ID+"/rotate", first.Token, `{"overlap_seconds":3600}`)
	var second admin.Token
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &second) != nil || second.Scope != admin.ScopeAdmin {
		t.Fatalf("rotate: %d %s", rec.Code, rec.Body)
	}
	if !works(first.Token) || !works(second.Token) {
		t.Fatal("during the overlap both tokens must work")
	}
	if rec := tokenCall(e, "POST", "/orgs", second.Token, `{"id":"acme"}`); rec.Code != http.StatusCreated {
		t.Fatalf("write with the successor: %d %s", rec.Code, rec.Body)
	}
	rec = tokenCall(e, "POST", "/tokens/"+second.ID+"/rotate", "tok", `{"overlap_seconds":0}`)
	var third admin.Token
	if rec.Code != http.StatusCreated || json.Unmarshal(rec.Body.Bytes(), &third) != nil {
		t.Fatalf("rotate without overlap: %d %s", rec.Code, rec.Body)
	}
	if works(second.Token) || !works(third.Token) || !works(first.Token) {
		t.Fatal("after a rotation without overlap: the old token must end, the new one and the first (still in its overlap) work")
	}
	if rec := tokenCall(e, "DELETE", "/tokens/"+first.ID, third.Token, ""); rec.Code != http.StatusNoContent {
		t.Fatalf("revoke: %d %s", rec.Code, rec.Body)
	}
	if works(first.Token) {
		t.Fatal("a revoked token still works")
	}
	if rec := tokenCall(e, "GET", "/orgs", first.Token, ""); rec.Code != http.StatusUnauthorized {
		t.Fatalf("revoked: %d, want 401", rec.Code)
	}
	rec = tokenCall(e, "GET", "/tokens", "tok", "")
	var list struct {
		Data []access.Token `json:"data"`
	}
	if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &list) != nil || len(list.Data) != 3 || list.Data[0].RevokedAt == nil ||
		strings.Contains(rec.Body.String(), third.Token) {
		t.Fatalf("list: %d %s", rec.Code, rec.Body)
	}
	// The audit trail: the org made with the successor names it; the bootstrap writes name none.
	var sawSecond, sawBootstrap bool
	for _, r := range mustAudit(t, l) {
		switch {
		case r.Action == "POST /admin/v1/orgs" && r.Token == second.ID && strings.Contains(r.Actor, second.ID):
			sawSecond = true
		case r.Action == "POST /admin/v1/tokens" && r.Token == "" && r.Actor == "admin":
			sawBootstrap = true
		}
		if strings.Contains(r.Detail, access.TokenPrefix) {
			t.Fatalf("a secret in the audit trail: %+v", r)
		}
	}
	if !sawSecond || !sawBootstrap {
		t.Fatalf("audit does not name the tokens: %+v", mustAudit(t, l))
	}
}
