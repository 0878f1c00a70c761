package admin_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

type limitsRig struct {
	t      *testing.T
	e      *echo.Echo
	store  *balance.Store
	ledger ledger.Ledger
	redis  *testutil.RedisEnv
}

// eachLedger runs fn over the memory ledger with miniredis and over Postgres with real Redis.
func eachLedger(t *testing.T, fn func(t *testing.T, r *limitsRig)) {
	for _, name := range []string{"memory", "postgres"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var env *testutil.RedisEnv
			var ledger ledger.Ledger
			if name == "memory" {
				env, ledger = testutil.MiniRedis(t), memledger.New()
			} else {
				pg := testutil.Postgres(t)
				l, err := pgledger.Open(ctx, pg.URL, nil)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(l.Close)
				env, ledger = testutil.RealRedis(t), l
			}
			// The limit clock at noon of a fixed day: no window rolls over during the test.
			noon := time.Date(2030, 6, 14, 12, 0, 0, 0, time.UTC)
			store, err := balance.New(ctx, env.Client, &balance.Config{Ledger: ledger, Prefix: env.Prefix, AllowEviction: true, ClockOffset: time.Until(noon)})
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
			api.Register(e.Group("/admin/v1"))
			fn(t, &limitsRig{t: t, e: e, store: store, ledger: ledger, redis: env})
		})
	}
}

// call sends a request and checks the status; the answer is decoded into v when v is not nil.
func (r *limitsRig) call(method, path, body string, want int, v any) string {
	r.t.Helper()
	req := httptest.NewRequest(method, "/admin/v1"+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer tok")
	req.Header.Set(admin.ActorHeader, "alice")
	rec := httptest.NewRecorder()
	r.e.ServeHTTP(rec, req)
	if rec.Code != want {
		r.t.Fatalf("%s %s %s: %d %s, want %d", method, path, body, rec.Code, rec.Body, want)
	}
	if v != nil {
		if err := json.Unmarshal(rec.Body.Bytes(), v); err != nil {
			r.t.Fatalf("%s %s: %v in %s", method, path, err, rec.Body)
		}
	}
	return rec.Body.String()
}

// refused checks an OpenAI-shaped refusal with its code.
func (r *limitsRig) refused(method, path, body string, status int, code string) {
	r.t.Helper()
	if b := r.call(method, path, body, status, nil); !strings.Contains(b, `"code":"`+code+`"`) {
		r.t.Fatalf("%s %s: %s, want code %s", method, path, b, code)
	}
}

func (r *limitsRig) reserve(key string, amount int64) error {
	_, err := r.store.Reserve(context.Background(), balance.ReserveRequest{Org: "acme", HoldID: uuid.Must(uuid.NewV7()).String(), Amount: amount, KeyID: key})
	return err
}

type limitRow struct {
	ID       string     `json:"id"`
	Scope    string     `json:"scope"`
	ScopeID  string     `json:"scope_id"`
	Window   string     `json:"window"`
	Cap      int64      `json:"cap"`
	Used     int64      `json:"used"`
	Held     int64      `json:"held"`
	ResetsAt *time.Time `json:"resets_at"`
}

// TestLimitRoutes drives every limits route on both ledgers: projects, a key's project, limits
// (create, list with used/held/resets_at, patch, delete) and freezes of the org, a project and a
// key, each taking effect on the next reserve; unknown ids are 404s, malformed input 400s, and
// every write is in the audit trail.
func TestLimitRoutes(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, r *limitsRig) {
		r.call("POST", "/orgs", `{"id":"acme"}`, 201, nil)
		r.call("POST", "/orgs/acme/credits", `{"amount":1000000,"reference":"pay-1"}`, 201, nil)
		var key map[string]string
		r.call("POST", "/orgs/acme/keys", "", 201, &key)
		k := key["id"]

		if b := r.call("GET", "/orgs/acme/limits", "", 200, nil); !strings.HasPrefix(b, `{"data":[]`) {
			t.Fatalf("no limits yet: %s", b)
		}
		r.refused("GET", "/orgs/nobody/limits", "", 404, "org_not_found")

		// Projects and a key's project.
		var proj map[string]string
		r.call("POST", "/orgs/acme/projects", `{"id":"staging"}`, 201, &proj)
		if proj["id"] != "staging" {
			t.Fatalf("created project %v", proj)
		}
		r.refused("POST", "/orgs/acme/projects", `{"id":"staging"}`, 409, "project_exists")
		r.refused("POST", "/orgs/acme/projects", `{"id":"a:b"}`, 400, "invalid_value")
		r.refused("POST", "/orgs/acme/projects", `{}`, 400, "invalid_value")
		r.refused("POST", "/orgs/nobody/projects", `{"id":"x"}`, 404, "org_not_found")
		r.call("PUT", "/keys/"+k+"/project", `{"project":"staging"}`, 200, nil)
		r.refused("PUT", "/keys/"+k+"/project", `{"project":"nope"}`, 404, "project_not_found")
		r.refused("PUT", "/keys/key_nope/project", `{"project":"staging"}`, 404, "key_not_found")
		if b := r.call("PUT", "/keys/"+k+"/project", `{"project":null}`, 200, nil); !strings.Contains(b, `"project":null`) {
			t.Fatalf("clearing a key's project: %s", b)
		}
		r.call("PUT", "/keys/"+k+"/project", `{"project":"staging"}`, 200, nil)

		// Limits.
		var day, month, week limitRow
		r.call("POST", "/orgs/acme/limits", `{"scope":"key","scope_id":"`+k+`","window":"day","cap":300}`, 201, &day)
		r.call("POST", "/orgs/acme/limits", `{"scope":"org","window":"month","cap":10000}`, 201, &month)
		r.call("POST", "/orgs/acme/limits", `{"scope":"project","scope_id":"staging","window":"week","cap":5000}`, 201, &week)
		if day.ID == "" || day.Scope != "key" || day.ScopeID != k || day.Window != "day" || day.Cap != 300 || month.ScopeID != "" {
			t.Fatalf("created limits %+v %+v", day, month)
		}
		for body, code := range map[string]string{
			`{"scope":"team","scope_id":"x","window":"day","cap":1}`:       "invalid_value",
			`{"scope":"org","window":"year","cap":1}`:                      "invalid_value",
			`{"scope":"org","window":"day","cap":0}`:                       "invalid_value",
			`{"scope":"org","window":"day"}`:                               "invalid_value",
			`{"scope":"key","window":"day","cap":5}`:                       "invalid_value",
			`{"scope":"org","scope_id":"x","window":"day","cap":5}`:        "invalid_value",
			`{"scope":"org","window":"day","cap":5,"extra":1}`:             "invalid_json",
			`{"scope":"project","scope_id":"nope","window":"day","cap":5}`: "project_not_found",
			`{"scope":"key","scope_id":"key_nope","window":"day","cap":5}`: "key_not_found",
		} {
			status := 400
			if strings.HasSuffix(code, "not_found") {
				status = 404
			}
			r.refused("POST", "/orgs/acme/limits", body, status, code)
		}
		r.refused("POST", "/orgs/nobody/limits", `{"scope":"org","window":"day","cap":5}`, 404, "org_not_found")

		// A hold counts against every limit in its scope; the list shows it as used and held.
		if err := r.reserve(k, 100); err != nil {
			t.Fatal(err)
		}
		var ls struct {
			Data []limitRow `json:"data"`
		}
		r.call("GET", "/orgs/acme/limits", "", 200, &ls)
		if len(ls.Data) != 3 {
			t.Fatalf("limits %+v", ls.Data)
		}
		for _, l := range ls.Data {
			if l.Used != 100 || l.Held != 100 || l.ResetsAt == nil {
				t.Fatalf("limit %+v: want used 100, held 100 and a reset time", l)
			}
		}
		if want := time.Date(2030, 6, 15, 0, 0, 0, 0, time.UTC); !ls.Data[0].ResetsAt.Equal(want) || ls.Data[0].ID != day.ID {
			t.Fatalf("the day limit %+v, want a reset at %v", ls.Data[0], want)
		}
		if b := r.call("GET", "/orgs/acme/limits?format=csv", "", 200, nil); !strings.Contains(b, day.ID+",key,"+k+",day,300,100,100,2030-06-15T00:00:00Z") {
			t.Fatalf("limits as CSV: %s", b)
		}

		// Lowering a cap below what is used refuses the next hold.
		var patched limitRow
		r.call("PATCH", "/orgs/acme/limits/"+day.ID, `{"cap":50}`, 200, &patched)
		if patched.Cap != 50 || patched.ID != day.ID || patched.Window != "day" {
			t.Fatalf("patched %+v", patched)
		}
		var le *balance.LimitError
		if err := r.reserve(k, 1); !errors.As(err, &le) || le.Limit.ID != day.ID || le.Used != 100 {
			t.Fatalf("reserve over a lowered cap: %v", err)
		}
		r.refused("PATCH", "/orgs/acme/limits/999999", `{"cap":5}`, 404, "limit_not_found")
		r.refused("PATCH", "/orgs/acme/limits/"+day.ID, `{"window":"month"}`, 400, "invalid_json")
		r.refused("PATCH", "/orgs/acme/limits/"+day.ID, `{}`, 400, "invalid_value")
		r.refused("PATCH", "/orgs/acme/limits/"+day.ID, `{"cap":-1}`, 400, "invalid_value")
		r.call("DELETE", "/orgs/acme/limits/"+day.ID, "", 204, nil)
		r.refused("DELETE", "/orgs/acme/limits/"+day.ID, "", 404, "limit_not_found")
		if err := r.reserve(k, 1); err != nil {
			t.Fatalf("reserve after the limit was deleted: %v", err)
		}
		r.call("GET", "/orgs/acme/limits", "", 200, &ls)
		if len(ls.Data) != 2 || ls.Data[0].ID != month.ID || ls.Data[1].ID != week.ID {
			t.Fatalf("limits after a delete %+v", ls.Data)
		}

		// Freezes take effect on the next reserve.
		for _, f := range []struct{ path, scope string }{
			{"/orgs/acme", "org"}, {"/orgs/acme/projects/staging", "project"}, {"/keys/" + k, "key"},
		} {
			var got map[string]any
			r.call("POST", f.path+"/freeze", "", 200, &got)
			if got["frozen"] != true || got["scope"] != f.scope {
				t.Fatalf("freeze %s: %v", f.path, got)
			}
			var fe *balance.FrozenError
			if err := r.reserve(k, 1); !errors.As(err, &fe) || string(fe.Scope.Kind) != f.scope {
				t.Fatalf("reserve with %s frozen: %v", f.path, err)
			}
			r.call("POST", f.path+"/unfreeze", "", 200, nil)
			if err := r.reserve(k, 1); err != nil {
				t.Fatalf("reserve after unfreezing %s: %v", f.path, err)
			}
		}
		r.refused("POST", "/orgs/acme/projects/nope/freeze", "", 404, "project_not_found")
		r.refused("POST", "/keys/key_nope/freeze", "", 404, "key_not_found")
		r.refused("POST", "/orgs/nobody/freeze", "", 404, "org_not_found")

		// Every write is in the audit trail, a limit's under its org.
		var audit struct {
			Data []ledger.AuditRecord `json:"data"`
		}
		r.call("GET", "/audit?limit=1000", "", 200, &audit)
		found := map[string]bool{}
		for _, a := range audit.Data {
			if a.Actor != "alice" {
				t.Fatalf("audit record %+v", a)
			}
			found[a.Action+" "+a.Target] = true
		}
		for _, want := range []string{
			"POST /admin/v1/orgs/:org/projects acme",
			"PUT /admin/v1/keys/:id/project " + k,
			"POST /admin/v1/orgs/:org/limits acme",
			"PATCH /admin/v1/orgs/:org/limits/:id acme/" + day.ID,
			"DELETE /admin/v1/orgs/:org/limits/:id acme/" + day.ID,
			"POST /admin/v1/orgs/:org/freeze acme",
			"POST /admin/v1/orgs/:org/unfreeze acme",
			"POST /admin/v1/orgs/:org/projects/:id/freeze acme/staging",
			"POST /admin/v1/keys/:id/unfreeze " + k,
		} {
			if !found[want] {
				t.Fatalf("no audit record %q in %v", want, found)
			}
		}
	})
}
