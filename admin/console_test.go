package admin_test

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

type console struct {
	t      *testing.T
	e      *echo.Echo
	ledger *memledger.Ledger
}

func newConsole(t *testing.T) *console {
	t.Helper()
	e, ledger, _ := mountAdmin(t, "/admin/v1")
	return &console{t: t, e: e, ledger: ledger}
}

// mountAdmin mounts the admin API (token "tok") at prefix on a new Echo, over the memory ledger
// and a hot balance on the test Redis.
func mountAdmin(t *testing.T, prefix string) (*echo.Echo, *memledger.Ledger, *balance.Store) {
	t.Helper()
	env := testutil.Redis(t)
	ledger := memledger.New()
	store, err := balance.New(context.Background(), env.Client, &balance.Config{Ledger: ledger, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	w, err := accounting.NewWorker(ledger, store, nil)
	if err != nil {
		t.Fatal(err)
	}
	api, err := admin.New(accounting.NewOps(w), &admin.Config{Token: "tok"})
	if err != nil {
		t.Fatal(err)
	}
	e := echo.New()
	api.Register(e.Group(prefix))
	return e, ledger, store
}

func (c *console) do(method, path, body string, hdr ...string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, "/admin/v1"+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer tok")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	c.e.ServeHTTP(rec, req)
	return rec
}

// ok calls and decodes a 2xx JSON answer into v.
func (c *console) ok(method, path, body string, want int, v any) {
	c.t.Helper()
	rec := c.do(method, path, body, admin.ActorHeader, "alice")
	if rec.Code != want {
		c.t.Fatalf("%s %s: %d %s, want %d", method, path, rec.Code, rec.Body, want)
	}
	if v != nil {
		if err := json.Unmarshal(rec.Body.Bytes(), v); err != nil {
			c.t.Fatalf("%s %s: %v in %s", method, path, err, rec.Body)
		}
	}
}

type list[T any] struct {
	Data []T     `json:"data"`
	Next *string `json:"next"`
}

// TestConsoleAPI drives the read and write routes over the memory ledger: named orgs and keys,
// a model priced by PATCH in decimals, lists in pages, JSON and CSV, entries, usage, one
// request, model deletion and the audit trail of every write.
func TestConsoleAPI(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	if rec := c.do("GET", "/models", ""); rec.Code != 200 || strings.TrimSpace(rec.Body.String()) != `{"data":[],"next":null}` {
		t.Fatalf("no models: %d %s", rec.Code, rec.Body)
	}
	var org map[string]string
	c.ok("POST", "/orgs", `{"id":"acme","name":"Acme <Corp>"}`, 201, &org)
	if org["id"] != "acme" || org["name"] != "Acme <Corp>" {
		t.Fatalf("created org: %v", org)
	}
	c.ok("POST", "/orgs", `{"id":"beta"}`, 201, nil)
	c.ok("PATCH", "/orgs/beta", `{"name":"Beta"}`, 200, nil)
	var key1, key2 map[string]string
	c.ok("POST", "/orgs/acme/keys", `{"name":"prod"}`, 201, &key1)
	c.ok("POST", "/orgs/acme/keys", "", 201, &key2)
	if key1["name"] != "prod" || !strings.HasPrefix(key1["key"], ledger.KeyPrefix) {
		t.Fatalf("key: %v", key1)
	}
	c.ok("PATCH", "/keys/"+key2["id"], `{"name":"staging"}`, 200, nil)

	var m ledger.Model
	c.ok("PATCH", "/models/gpt-x", `{"input_per_1m":"0.15","cached_input_per_1m":0.075,"output_per_1m":"0.6","default_hold":5000}`, 200, &m)
	if m.Prices[pricing.Input] != 150000 || m.Prices[pricing.CachedInput] != 75000 || m.Prices[pricing.Output] != 600000 || m.DefaultHold != 5000 {
		t.Fatalf("decimal prices: %+v", m)
	}
	c.ok("PATCH", "/models/gpt-x", `{"max_output_tokens":100}`, 200, &m)
	if m.Prices[pricing.Input] != 150000 || m.MaxOutputTokens != 100 || m.DefaultHold != 5000 {
		t.Fatalf("a partial update changed other fields: %+v", m)
	}
	if rec := c.do("GET", "/models?format=csv", ""); !strings.Contains(rec.Body.String(), "model,input_price,cached_input_price,cache_write_input_price,cache_write_1h_input_price,output_price,max_input_tokens,max_output_tokens,max_cost,default_hold\ngpt-x,150000,75000,150000,300000,600000,0,100,0,5000") {
		t.Fatalf("models as CSV: %s", rec.Body)
	}
	c.ok("GET", "/models/gpt-x", "", 200, &m)
	if m.Prices[pricing.Output] != 600000 {
		t.Fatalf("GET model: %+v", m)
	}
	rec := c.do("PATCH", "/models/gpt-x", `{"input_per_1m":"0.0000001"}`)
	if rec.Code != 400 || !strings.Contains(rec.Body.String(), "whole number of micro-units") {
		t.Fatalf("7 decimals: %d %s", rec.Code, rec.Body)
	}

	// Usage: three requests recorded and accounted.
	ctx := context.Background()
	c.ok("POST", "/orgs/acme/credits", `{"amount":1000000,"reference":"pay-1"}`, 201, nil)
	var ids []string
	for i, cost := range []int64{100, 200, 300} {
		ev := ledger.UsageEvent{ID: ledgertest.NewEventID(), Org: "acme", KeyID: key1["id"], Model: "gpt-x",
			Usage: pricing.Usage{Prompt: 10, Completion: int64(i)}, Cost: cost, HoldAmount: 5000}
		ids = append(ids, ev.ID)
		if err := c.ledger.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.ledger.AccountPending(ctx, 100); err != nil {
		t.Fatal(err)
	}

	var orgs list[accounting.OrgView]
	c.ok("GET", "/orgs?limit=1", "", 200, &orgs)
	if len(orgs.Data) != 1 || orgs.Data[0].ID != "acme" || orgs.Data[0].Name != "Acme <Corp>" || orgs.Next == nil {
		t.Fatalf("first page of orgs: %+v", orgs)
	}
	c.ok("GET", "/orgs?limit=1&cursor="+*orgs.Next, "", 200, &orgs)
	if len(orgs.Data) != 1 || orgs.Data[0].ID != "beta" || orgs.Data[0].Name != "Beta" || orgs.Next != nil {
		t.Fatalf("second page of orgs: %+v", orgs)
	}
	var one accounting.OrgView
	c.ok("GET", "/orgs/acme", "", 200, &one)
	if one.Balance != 1000000-600 || one.Available == nil || *one.Available != 1000000 {
		// Available is the hot balance: the credit is in (Credit settles it); the charges are
		// settled by the worker, which does not run here.
		t.Fatalf("org acme: %+v", one)
	}
	if rec := c.do("GET", "/orgs", "", "Accept", "text/csv"); rec.Code != 200 || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/csv") ||
		!strings.Contains(rec.Body.String(), "acme,Acme <Corp>,999400,1000000,0,") {
		t.Fatalf("orgs as CSV: %d %q", rec.Code, rec.Body)
	}
	var keys list[ledger.KeyInfo]
	c.ok("GET", "/orgs/acme/keys", "", 200, &keys)
	if len(keys.Data) != 2 || keys.Data[0].Name != "prod" || keys.Data[1].Name != "staging" {
		t.Fatalf("keys: %+v", keys)
	}
	var entries list[ledger.EntryInfo]
	c.ok("GET", "/orgs/acme/entries?kind=charge", "", 200, &entries)
	if len(entries.Data) != 3 || entries.Data[0].Request == nil || entries.Data[0].Request.ID != ids[2] || entries.Data[0].Request.Cost != 300 {
		t.Fatalf("charges: %+v", entries)
	}
	var usage list[ledger.UsageRow]
	c.ok("GET", "/orgs/acme/usage?group_by=model", "", 200, &usage)
	if len(usage.Data) != 1 || !usage.Data[0].Equal(ledger.UsageRow{Group: "gpt-x", Requests: 3, Cost: 600, Prompt: 30, Completion: 3}) {
		t.Fatalf("usage by model: %+v", usage)
	}
	rec = c.do("GET", "/orgs/acme/usage?group_by=key&format=csv", "")
	rows, err := csv.NewReader(rec.Body).ReadAll()
	if err != nil || len(rows) != 2 || rows[0][0] != "key" || rows[1][0] != key1["id"] || rows[1][2] != "600" {
		t.Fatalf("usage by key as CSV: %v %v", rows, err)
	}
	var top list[map[string]any]
	c.ok("GET", "/usage/top?limit=5", "", 200, &top)
	if len(top.Data) != 1 || top.Data[0]["org"] != "acme" || top.Data[0]["cost"] != 600.0 || top.Data[0]["requests"] != 3.0 || top.Data[0]["group"] != nil {
		t.Fatalf("top spenders: %+v", top)
	}
	if rec := c.do("GET", "/usage/top?format=csv&from=2000-01-01", ""); !strings.Contains(rec.Body.String(), "org,requests,cost,") || !strings.Contains(rec.Body.String(), "\nacme,3,600,30,0,3,0") {
		t.Fatalf("top spenders as CSV: %q", rec.Body)
	}
	var req ledger.RequestInfo
	c.ok("GET", "/requests/"+ids[1], "", 200, &req)
	if req.Cost != 200 || req.Status != ledger.RequestAccounted || req.HoldAmount != 5000 || req.KeyID != key1["id"] {
		t.Fatalf("request: %+v", req)
	}

	// Errors: OpenAI-shaped, snake_case, unescaped, saying what is allowed.
	for _, tc := range []struct {
		method, path, body string
		status             int
		code, msg          string
	}{
		{"GET", "/requests/" + ledgertest.NewEventID(), "", 404, "request_not_found", "no request"},
		{"GET", "/orgs/a%7Bb", "", 400, "invalid_org", "an org id is 1 to 128 characters"},
		{"POST", "/orgs", `{"id":"a b"}`, 400, "invalid_org", "an org id is 1 to 128 characters"},
		{"POST", "/orgs/acme/credits", `{"amount":-1,"reference":"x"}`, 400, "invalid_value", "amount (> 0"},
		{"GET", "/orgs?cursor=zzz", "", 400, "invalid_cursor", "cursor"},
		{"GET", "/orgs/acme/usage?group_by=week", "", 400, "invalid_value", "group_by must be day, model, key or end_user"},
		{"GET", "/orgs/acme/usage?from=yesterday", "", 400, "invalid_value", "from must be an RFC 3339 time"},
		{"GET", "/usage/top?limit=0", "", 400, "invalid_value", "limit must be an integer from 1"},
		{"GET", "/usage/top?from=2026-02-01&to=2026-01-01", "", 400, "invalid_value", "to must be after from"},
		{"DELETE", "/models/gpt-x", "", 409, "model_in_use", "has recorded usage"},
		{"DELETE", "/models/nope", "", 404, "model_not_found", "no such model"},
	} {
		rec := c.do(tc.method, tc.path, tc.body)
		var body struct {
			Error struct{ Message, Type, Code string }
		}
		_ = json.Unmarshal(rec.Body.Bytes(), &body)
		if rec.Code != tc.status || body.Error.Code != tc.code || !strings.Contains(body.Error.Message, tc.msg) ||
			strings.Contains(rec.Body.String(), `\u003e`) || strings.Contains(body.Error.Message, "accounting:") {
			t.Errorf("%s %s: %d %s; want %d %s containing %q", tc.method, tc.path, rec.Code, rec.Body, tc.status, tc.code, tc.msg)
		}
	}
	if rec := c.do("PUT", "/orgs/acme", ""); rec.Code != http.StatusMethodNotAllowed || !strings.Contains(rec.Header().Get("Allow"), "PATCH") {
		t.Errorf("wrong method: %d, Allow %q", rec.Code, rec.Header().Get("Allow"))
	}
	c.ok("PATCH", "/models/unused", `{"input_price":1,"default_hold":10}`, 200, nil)
	c.ok("DELETE", "/models/unused", "", 204, nil)

	// The audit trail: every write, newest first, with who and what.
	var audit list[ledger.AuditRecord]
	c.ok("GET", "/audit?limit=1000", "", 200, &audit)
	if len(audit.Data) < 10 {
		t.Fatalf("audit: %d records", len(audit.Data))
	}
	last := audit.Data[0]
	if last.Action != "DELETE /admin/v1/models/:model" || last.Target != "unused" || last.Actor != "alice" || last.Status != 204 ||
		time.Since(last.At) > time.Minute {
		t.Fatalf("last audit record: %+v", last)
	}
	for _, r := range audit.Data {
		if strings.HasPrefix(r.Action, "GET") {
			t.Fatalf("a read was audited: %+v", r)
		}
	}
	first := audit.Data[len(audit.Data)-1]
	if first.Action != "POST /admin/v1/orgs" || first.Detail != `{"id":"acme","name":"Acme <Corp>"}` || first.Status != 201 {
		t.Fatalf("first audit record: %+v", first)
	}
}

func TestDecimalMicros(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]int64{
		`"0.15"`: 150000, `0.6`: 600000, `"2"`: 2000000, `1.000000`: 1000000, `"0.0000010"`: 1, `"100000000"`: 100000000000000,
	} {
		if got, err := admin.DecimalMicros(json.RawMessage(in)); err != nil || got != want {
			t.Errorf("%s: %d %v, want %d", in, got, err, want)
		}
	}
	for _, in := range []string{`"0.0000001"`, `1e-7`, `"-1"`, `"abc"`, `"100000000.000001"`, `""`, `true`, `"1,5"`} {
		if got, err := admin.DecimalMicros(json.RawMessage(in)); err == nil {
			t.Errorf("%s: %d, want an error", in, got)
		}
	}
}
