package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
)

// TestMountedGroup: the admin API mounted on a group of a program's own Echo, over the memory
// ledger and a hot balance, creates an org, credits it (the credit is in the hot balance when
// the call returns) and reads the balance back; a wrong token is refused.
func TestMountedGroup(t *testing.T) {
	t.Parallel()
	if _, err := admin.New(&accounting.Ops{}, &admin.Config{}); !errors.Is(err, admin.ErrNoToken) {
		t.Fatalf("New without a token: %v, want ErrNoToken", err)
	}
	e, _, store := mountAdmin(t, "/ops/admin")
	call := func(method, path, token, body string) (int, string) {
		req := httptest.NewRequest(method, "/ops/admin"+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, req)
		return rec.Code, rec.Body.String()
	}
	if st, b := call("POST", "/orgs", "wrong", `{"id":"acme"}`); st != http.StatusUnauthorized || !strings.Contains(b, `"code":"invalid_admin_token"`) {
		t.Fatalf("wrong token: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs", "tok", `{"id":"acme"}`); st != http.StatusCreated {
		t.Fatalf("create org: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", "tok", `{"amount":700,"reference":"pay-1"}`); st != http.StatusCreated {
		t.Fatalf("credit: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", "tok", `{"amount":-1,"reference":"pay-2"}`); st != http.StatusBadRequest {
		t.Fatalf("negative credit: %d %s", st, b)
	}
	hot, err := store.State(context.Background(), "acme")
	if err != nil || !hot.Exists || hot.Balance != 700 {
		t.Fatalf("hot balance right after the credit: %+v %v, want 700", hot, err)
	}
	st, b := call("GET", "/orgs/acme/balance", "tok", "")
	var got accounting.Balance
	if err := json.Unmarshal([]byte(b), &got); err != nil || st != http.StatusOK ||
		got != (accounting.Balance{Org: "acme", LedgerBalance: 700, Available: 700, LedgerSeq: 1, SettledSeq: 1, Watermark: 1}) {
		t.Fatalf("balance: %d %s", st, b)
	}
	if st, b := call("GET", "/orgs/nobody/balance", "tok", ""); st != http.StatusNotFound || !strings.Contains(b, `"code":"org_not_found"`) {
		t.Fatalf("unknown org: %d %s", st, b)
	}
}
