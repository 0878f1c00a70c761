package admin_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger/grant"
)

// TestGrantRoutes: POST /orgs/:org/credits with expires_at and priority makes a grant with those
// terms (checked: 400), the same reference with other terms is a 409, and GET /orgs/:org/grants
// lists them in spending order.
func TestGrantRoutes(t *testing.T) {
	t.Parallel()
	e, _, _ := mountAdmin(t, "/admin/v1")
	call := func(method, path, body string) (int, string) {
		rec := tokenCall(e, method, path, "tok", body)
		return rec.Code, rec.Body.String()
	}
	if st, b := call("POST", "/orgs", `{"id":"acme"}`); st != http.StatusCreated {
		t.Fatalf("create org: %d %s", st, b)
	}
	at := time.Now().Add(24 * time.Hour).UTC().Truncate(time.Millisecond).Format(time.RFC3339Nano)
	if st, b := call("POST", "/orgs/acme/credits", `{"amount":500,"reference":"paid-1"}`); st != http.StatusCreated {
		t.Fatalf("plain credit: %d %s", st, b)
	}
	promo := `{"amount":300,"reference":"promo-1","priority":0,"expires_at":"` + at + `"}`
	if st, b := call("POST", "/orgs/acme/credits", promo); st != http.StatusCreated {
		t.Fatalf("promotional credit: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", promo); st != http.StatusOK {
		t.Fatalf("the same credit again: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", `{"amount":300,"reference":"promo-1","priority":100}`); st != http.StatusConflict {
		t.Fatalf("the same reference, other terms: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", `{"amount":1,"reference":"old","expires_at":"2001-01-01T00:00:00Z"}`); st != http.StatusBadRequest || !strings.Contains(b, "invalid_value") {
		t.Fatalf("an expiry in the past: %d %s", st, b)
	}
	if st, b := call("POST", "/orgs/acme/credits", `{"amount":1,"reference":"p","priority":1001}`); st != http.StatusBadRequest {
		t.Fatalf("a priority out of range: %d %s", st, b)
	}
	st, b := call("GET", "/orgs/acme/grants", "")
	var got admin.Page[grant.Grant]
	if err := json.Unmarshal([]byte(b), &got); err != nil || st != http.StatusOK || len(got.Data) != 2 ||
		got.Data[0].Reference != "promo-1" || got.Data[0].ExpiresAt.Format(time.RFC3339Nano) != at || got.Data[0].Rest != 300 ||
		got.Data[1].Reference != "paid-1" || got.Data[1].Priority != grant.PriorityPaid {
		t.Fatalf("grants: %d %s", st, b)
	}
	if st, b := call("GET", "/orgs/nobody/grants", ""); st != http.StatusNotFound {
		t.Fatalf("grants of an unknown org: %d %s", st, b)
	}
}
