package admin_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
)

// TestTopUpRoutes: PUT, GET and DELETE /orgs/:org/topup over accounting.Ops: settings are
// checked (400), need the org (404), read back with their attempts, and deleted.
func TestTopUpRoutes(t *testing.T) {
	t.Parallel()
	e, _, _ := mountAdmin(t, "/admin/v1")
	call := func(method, path, body string) (int, string) {
		rec := tokenCall(e, method, path, "tok", body)
		return rec.Code, rec.Body.String()
	}
	settings := `{"threshold":5000000,"amount":2000,"currency":"USD","customer":"cus_1","payment_method":"pm_1","daily_cap":4000,"monthly_cap":20000}`
	if st, b := call("PUT", "/orgs/acme/topup", settings); st != http.StatusNotFound || !strings.Contains(b, "org_not_found") {
		t.Fatalf("top-up of an unknown org: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs", `{"id":"acme"}`); st != http.StatusCreated {
		t.Fatalf("create org: %d %s", st, b)
	}
	if st, b := call("GET", "/orgs/acme/topup", ""); st != http.StatusNotFound || !strings.Contains(b, "topup_not_found") {
		t.Fatalf("no top-up yet: %d %s", st, b)
	}
	if st, b := call("PUT", "/orgs/acme/topup", strings.Replace(settings, `"daily_cap":4000`, `"daily_cap":1000`, 1)); st != http.StatusBadRequest {
		t.Fatalf("a daily cap below the amount: %d %s", st, b)
	}
	if st, b := call("PUT", "/orgs/acme/topup", `{"threshold":1,"org":"other"}`); st != http.StatusBadRequest || !strings.Contains(b, "invalid_json") {
		t.Fatalf("an unknown field: %d %s", st, b)
	}
	if st, b := call("PUT", "/orgs/acme/topup", settings); st != http.StatusOK || !strings.Contains(b, `"currency":"usd"`) {
		t.Fatalf("put: %d %s", st, b)
	}
	st, b := call("GET", "/orgs/acme/topup", "")
	var got accounting.TopUp
	if err := json.Unmarshal([]byte(b), &got); err != nil || st != http.StatusOK || got.Org != "acme" || got.Amount != 2000 ||
		got.Customer != "cus_1" || got.Attempts == nil || !strings.Contains(b, `"attempts":[]`) {
		t.Fatalf("get: %d %s", st, b)
	}
	if st, b := call("DELETE", "/orgs/acme/topup", ""); st != http.StatusNoContent {
		t.Fatalf("delete: %d %s", st, b)
	}
	if st, b := call("DELETE", "/orgs/acme/topup", ""); st != http.StatusNotFound {
		t.Fatalf("delete twice: %d %s", st, b)
	}
	if st, b := call("GET", "/audit", ""); st != http.StatusOK || !strings.Contains(b, "PUT /admin/v1/orgs/:org/topup") {
		t.Fatalf("audit: %d %s", st, b)
	}
}
