package ledgertest

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
)

var adminTokenTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"AdminTokens", testAdminTokens},
	{"AdminTokenRotation", testAdminTokenRotation},
	{"KeyModels", testKeyModels},
	{"OrgExempt", testOrgExempt},
}

// testOrgExempt: off by default, set and cleared, seen in the org views and with the org's keys.
func testOrgExempt(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	of, ok := l.(access.OrgFlags)
	if !ok {
		t.Fatalf("%T has no org flags", l)
	}
	must0(l.CreateOrg(c, "o"))
	_, secret := must2(l.CreateKey(c, "o"))
	if must(l.Org(c, "o")).Exempt || must(l.LookupKey(c, secret)).Exempt {
		t.Fatal("exempt by default")
	}
	must0(of.SetOrgExempt(c, "o", true))
	if !must(l.Org(c, "o")).Exempt || !must(l.LookupKey(c, secret)).Exempt || !must(l.ListOrgs(c, ledger.ListQuery{})).Data[0].Exempt {
		t.Fatal("the flag is not in the views")
	}
	must0(of.SetOrgExempt(c, "o", false))
	if must(l.Org(c, "o")).Exempt {
		t.Fatal("cleared flag still set")
	}
	if err := of.SetOrgExempt(c, "nope", true); !errors.Is(err, ledger.ErrUnknownOrg) {
		t.Fatalf("unknown org: %v", err)
	}
}

// testKeyModels: a key's allow-list is set, read back with the key (LookupKey, ListKeys) and
// cleared; bad lists and unknown keys are refused.
func testKeyModels(t *testing.T, l ledger.Ledger) {
	c := ctx(t)
	km, ok := l.(access.KeyModels)
	if !ok {
		t.Fatalf("%T has no key models", l)
	}
	must0(l.CreateOrg(c, "o"))
	k, secret := must2(l.CreateKey(c, "o"))
	if got := must(l.LookupKey(c, secret)); len(got.Models) != 0 {
		t.Fatalf("a new key's models: %v", got.Models)
	}
	must0(km.SetKeyModels(c, k.ID, []string{"gpt-4o-mini", "claude-*"}))
	if got := must(l.LookupKey(c, secret)); strings.Join(got.Models, ",") != "gpt-4o-mini,claude-*" {
		t.Fatalf("lookup models: %v", got.Models)
	}
	if p := must(l.ListKeys(c, "o", ledger.ListQuery{})); len(p.Data) != 1 || strings.Join(p.Data[0].Models, ",") != "gpt-4o-mini,claude-*" {
		t.Fatalf("listed: %+v", p.Data)
	}
	for _, bad := range [][]string{{""}, {"a b"}, {"gp*t"}, {strings.Repeat("m", 201)}} {
		if err := km.SetKeyModels(c, k.ID, bad); !errors.Is(err, ledger.ErrInvalidQuery) {
			t.Errorf("models %q: %v", bad, err)
		}
	}
	if err := km.SetKeyModels(c, "key_nope", []string{"x"}); !errors.Is(err, ledger.ErrUnknownKey) {
		t.Fatalf("unknown key: %v", err)
	}
	must0(km.SetKeyModels(c, k.ID, nil))
	if got := must(l.LookupKey(c, secret)); len(got.Models) != 0 {
		t.Fatalf("cleared models: %v", got.Models)
	}
}

func adminTokens(t *testing.T, l ledger.Ledger) access.Tokens {
	t.Helper()
	at, ok := l.(access.Tokens)
	if !ok {
		t.Fatalf("%T keeps no admin tokens", l)
	}
	return at
}

// testAdminTokens: created with a valid scope only, looked up by secret (never by anything else),
// listed without the secret, revoked at once.
func testAdminTokens(t *testing.T, l ledger.Ledger) {
	c, at := ctx(t), adminTokens(t, l)
	for _, bad := range []string{"", strings.Repeat("s", 201)} {
		if _, _, err := at.CreateAdminToken(c, "x", bad); !errors.Is(err, ledger.ErrInvalidQuery) {
			t.Errorf("scope %q: %v, want ErrInvalidQuery", bad, err)
		}
	}
	tok, secret, err := at.CreateAdminToken(c, "dashboard", "read")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(secret, access.TokenPrefix) || tok.ID == "" || tok.Scope != "read" || tok.Name != "dashboard" {
		t.Fatalf("created %+v, secret %q", tok, secret)
	}
	orgTok, orgSecret := must2(at.CreateAdminToken(c, "", "org:acme"))
	got := must(at.LookupAdminToken(c, secret))
	if got.ID != tok.ID || got.Scope != "read" {
		t.Fatalf("lookup: %+v, want %+v", got, tok)
	}
	if got := must(at.LookupAdminToken(c, orgSecret)); got.Scope != "org:acme" || got.Name != "" {
		t.Fatalf("org token: %+v", got)
	}
	for _, wrong := range []string{"", tok.ID, secret + "x", strings.ToUpper(secret)} {
		if _, err := at.LookupAdminToken(c, wrong); !errors.Is(err, access.ErrUnknownToken) {
			t.Errorf("lookup %q: %v, want ErrUnknownAdminToken", wrong, err)
		}
	}
	list := must(at.ListAdminTokens(c))
	if len(list) != 2 || list[0].ID != tok.ID || list[1].ID != orgTok.ID {
		t.Fatalf("list: %+v", list)
	}
	if err := at.RevokeAdminToken(c, tok.ID); err != nil {
		t.Fatal(err)
	}
	if err := at.RevokeAdminToken(c, tok.ID); err != nil {
		t.Fatalf("revoking twice: %v", err)
	}
	if _, err := at.LookupAdminToken(c, secret); !errors.Is(err, access.ErrUnknownToken) {
		t.Fatalf("revoked token still resolves: %v", err)
	}
	if err := at.RevokeAdminToken(c, "adm_nope"); !errors.Is(err, access.ErrUnknownToken) {
		t.Fatalf("revoke unknown: %v", err)
	}
	list = must(at.ListAdminTokens(c))
	if list[0].RevokedAt == nil || list[1].RevokedAt != nil {
		t.Fatalf("after revoke: %+v", list)
	}
	if _, err := at.LookupAdminToken(c, orgSecret); err != nil {
		t.Fatalf("the other token: %v", err)
	}
	must0(l.CreateOrg(c, "acme"))
	k, _ := must2(l.CreateKey(c, "acme"))
	if org := must(at.KeyOrg(c, k.ID)); org != "acme" {
		t.Fatalf("key org %q", org)
	}
	if _, err := at.KeyOrg(c, "key_nope"); !errors.Is(err, ledger.ErrUnknownKey) {
		t.Fatalf("unknown key org: %v", err)
	}
}

// testAdminTokenRotation: a rotation with an overlap leaves both secrets valid; with none, the
// old one ends at once; a revoked or expired token is not rotated.
func testAdminTokenRotation(t *testing.T, l ledger.Ledger) {
	c, at := ctx(t), adminTokens(t, l)
	old, oldSecret := must2(at.CreateAdminToken(c, "ci", "admin"))
	next, nextSecret, err := at.RotateAdminToken(c, old.ID, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if next.ID == old.ID || next.Scope != "admin" || next.Name != "ci" || nextSecret == oldSecret {
		t.Fatalf("successor %+v", next)
	}
	for _, s := range []string{oldSecret, nextSecret} {
		if _, err := at.LookupAdminToken(c, s); err != nil {
			t.Fatalf("during the overlap: %v", err)
		}
	}
	list := must(at.ListAdminTokens(c))
	if list[0].RotatedTo != next.ID || list[0].ExpiresAt == nil || list[1].ExpiresAt != nil {
		t.Fatalf("after rotation: %+v", list)
	}
	// A second rotation of the old token with a longer overlap never extends it.
	exp := *list[0].ExpiresAt
	_, _ = must2(at.RotateAdminToken(c, old.ID, 48*time.Hour))
	if list = must(at.ListAdminTokens(c)); !list[0].ExpiresAt.Equal(exp) {
		t.Fatalf("expiry moved from %v to %v", exp, list[0].ExpiresAt)
	}
	// No overlap: the old secret ends at once, the new one works.
	third, thirdSecret := must2(at.RotateAdminToken(c, next.ID, 0))
	if _, err := at.LookupAdminToken(c, nextSecret); !errors.Is(err, access.ErrUnknownToken) {
		t.Fatalf("rotated without overlap, old secret: %v", err)
	}
	if got := must(at.LookupAdminToken(c, thirdSecret)); got.ID != third.ID {
		t.Fatalf("third: %+v", got)
	}
	if _, _, err := at.RotateAdminToken(c, next.ID, time.Hour); !errors.Is(err, access.ErrUnknownToken) {
		t.Fatalf("rotating an expired token: %v", err)
	}
	must0(at.RevokeAdminToken(c, third.ID))
	if _, _, err := at.RotateAdminToken(c, third.ID, time.Hour); !errors.Is(err, access.ErrUnknownToken) {
		t.Fatalf("rotating a revoked token: %v", err)
	}
}

func must0(err error) {
	if err != nil {
		panic(failure{err})
	}
}
