package admin_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger"
)

// TestWebhookRoutes: create (secret once), list (no secret), the org's low-balance threshold by
// PATCH, deliveries listed in pages, delete; and the refusals.
func TestWebhookRoutes(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	var w struct {
		ID     string   `json:"id"`
		URL    string   `json:"url"`
		Events []string `json:"events"`
		Secret string   `json:"secret"`
	}
	c.ok(http.MethodPost, "/webhooks", `{"url":"https://example.com/h","events":["key.revoked","balance.low","credit.received"]}`, http.StatusCreated, &w)
	if !strings.HasPrefix(w.Secret, ledger.SecretPrefix) || w.ID == "" || w.URL != "https://example.com/h" || len(w.Events) != 3 {
		t.Fatalf("created %+v", w)
	}
	rec := c.do(http.MethodGet, "/webhooks", "")
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), w.ID) || strings.Contains(rec.Body.String(), w.Secret) || strings.Contains(rec.Body.String(), "secret") {
		t.Fatalf("list: %d %s", rec.Code, rec.Body)
	}
	if rec := c.do(http.MethodGet, "/webhooks?format=csv", ""); !strings.HasPrefix(rec.Body.String(), "id,url,events,created_at\n"+w.ID+",https://example.com/h,balance.low credit.received key.revoked,") {
		t.Fatalf("csv: %s", rec.Body)
	}
	for body, code := range map[string]string{
		`{"url":"ftp://x","events":["key.revoked"]}`:         "invalid_value",
		`{"url":"https://x.example","events":[]}`:            "invalid_value",
		`{"url":"https://x.example","events":["limit.80"]}`:  "invalid_value",
		`{"url":"https://x.example","events":["key.revoked"`: "invalid_json",
		`{"url":"https://x.example","secret":"mine"}`:        "invalid_json",
	} {
		if rec := c.do(http.MethodPost, "/webhooks", body); rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), `"code":"`+code+`"`) {
			t.Errorf("POST %s: %d %s", body, rec.Code, rec.Body)
		}
	}

	c.ok(http.MethodPost, "/orgs", `{"id":"acme"}`, http.StatusCreated, nil)
	var org struct {
		Threshold *int64 `json:"low_balance_threshold"`
		Name      string `json:"name"`
	}
	c.ok(http.MethodPatch, "/orgs/acme", `{"low_balance_threshold":1000}`, http.StatusOK, &org)
	if org.Threshold == nil || *org.Threshold != 1000 {
		t.Fatalf("after PATCH: %+v", org)
	}
	c.ok(http.MethodGet, "/orgs/acme", "", http.StatusOK, &org)
	if org.Threshold == nil || *org.Threshold != 1000 {
		t.Fatalf("GET: %+v", org)
	}
	for body, want := range map[string]int{
		`{"low_balance_threshold":"lots"}`:              http.StatusBadRequest,
		`{"low_balance_threshold":1.5}`:                 http.StatusBadRequest,
		`{"low_balance_threshold":1000000000000000000}`: http.StatusBadRequest,
		`{}`: http.StatusBadRequest,
	} {
		if rec := c.do(http.MethodPatch, "/orgs/acme", body); rec.Code != want {
			t.Errorf("PATCH %s: %d %s", body, rec.Code, rec.Body)
		}
	}
	if rec := c.do(http.MethodPatch, "/orgs/nobody", `{"low_balance_threshold":5}`); rec.Code != http.StatusNotFound {
		t.Errorf("PATCH of a missing org: %d %s", rec.Code, rec.Body)
	}

	// Events: three credits and a key revoked; the threshold is crossed by an adjustment.
	for i, ref := range []string{"a", "b", "c"} {
		c.ok(http.MethodPost, "/orgs/acme/credits", `{"amount":`+string(rune('1'+i))+`000,"reference":"`+ref+`"}`, http.StatusCreated, nil)
	}
	c.ok(http.MethodPost, "/orgs/acme/adjustments", `{"amount":-5500,"reference":"fix"}`, http.StatusCreated, nil)
	var key struct{ ID string }
	c.ok(http.MethodPost, "/orgs/acme/keys", "", http.StatusCreated, &key)
	c.ok(http.MethodDelete, "/keys/"+key.ID, "", http.StatusNoContent, nil)
	var all []ledger.Delivery
	path := "/webhooks/" + w.ID + "/deliveries?limit=2"
	for pages := 0; ; pages++ {
		var p list[ledger.Delivery]
		c.ok(http.MethodGet, path, "", http.StatusOK, &p)
		all = append(all, p.Data...)
		if p.Next == nil {
			break
		}
		path = "/webhooks/" + w.ID + "/deliveries?limit=2&cursor=" + *p.Next
		if pages > 10 {
			t.Fatal("pages never end")
		}
	}
	var types []string
	for _, d := range all {
		if d.Status != ledger.DeliveryPending || d.Attempts != 0 || d.NextAttemptAt == nil || d.Org != "acme" {
			t.Fatalf("delivery %+v", d)
		}
		types = append(types, string(d.EventType))
	}
	if got := strings.Join(types, " "); got != "key.revoked balance.low credit.received credit.received credit.received" {
		t.Fatalf("deliveries, newest first: %s", got)
	}
	if rec := c.do(http.MethodGet, "/webhooks/"+w.ID+"/deliveries?format=csv", ""); !strings.HasPrefix(rec.Body.String(), "id,webhook_id,event_id,event_type,org,status,attempts,") ||
		strings.Count(rec.Body.String(), "\n") != 6 {
		t.Fatalf("deliveries csv: %s", rec.Body)
	}
	// Clearing the threshold.
	c.ok(http.MethodPatch, "/orgs/acme", `{"low_balance_threshold":null,"name":"Acme"}`, http.StatusOK, &org)
	if t2, _ := c.ledger.LowBalanceThreshold(context.Background(), "acme"); t2 != nil || org.Name != "Acme" {
		t.Fatalf("after clearing: %v, %+v", t2, org)
	}

	c.ok(http.MethodDelete, "/webhooks/"+w.ID, "", http.StatusNoContent, nil)
	for _, r := range [][2]string{{http.MethodDelete, "/webhooks/" + w.ID}, {http.MethodGet, "/webhooks/" + w.ID + "/deliveries"}} {
		if rec := c.do(r[0], r[1], ""); rec.Code != http.StatusNotFound || !strings.Contains(rec.Body.String(), `"code":"webhook_not_found"`) {
			t.Errorf("%s %s after delete: %d %s", r[0], r[1], rec.Code, rec.Body)
		}
	}
	// The audit trail records the creation, without the secret (which is only in the answer).
	rec = c.do(http.MethodGet, "/audit", "", admin.ActorHeader, "alice")
	if !strings.Contains(rec.Body.String(), "POST /admin/v1/webhooks") || strings.Contains(rec.Body.String(), w.Secret) {
		t.Fatalf("audit: %s", rec.Body)
	}
}
