package middleware

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/balance"
)

// sendAs posts a chat request naming an end user in the body (extra: a JSON member such as
// `"user":"alice"`, "" for none) and in the headers given.
func (e *limitEnv) sendAs(extra string, header map[string]string) (int, string) {
	e.t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, e.srv.URL+EndpointChat, strings.NewReader(jsonBody(testModel, extra)))
	must(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+e.key)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	must(e.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	must(e.t, err)
	return resp.StatusCode, string(b)
}

// TestEndUserLimit: a limit of each end user apart stops one end user at its cap and not
// another; a request without an end user is not counted; the end user is recorded with the
// usage event; a bad end user is a 400 with nothing held.
func TestEndUserLimit(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, true, 20, balance.Limits{Version: 1}, nil)
		e.rec.fin = e.store // holds finish when their usage is recorded, as the proxy's recorder does
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "eu", Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Day, Cap: 41}}
		})
		for i := range 2 {
			if st, body := e.sendAs(`"user":"alice"`, nil); st != 200 {
				t.Fatalf("alice's request %d: %d %s", i, st, body)
			}
			if o := e.outcome(); o.Kind == OutcomeRefused {
				t.Fatalf("outcome %+v", o)
			}
		}
		before := e.state()
		st, body := e.sendAs(`"user":"alice"`, nil)
		want := `{"error":{"message":"End user's daily limit of 41 reached: 42 used, 20 needed; resets 2030-06-16T00:00:00Z.",` +
			`"type":"insufficient_quota","param":null,"code":"budget_exceeded",` +
			`"limit":{"id":"eu","scope":"end_user","scope_id":null,"window":"day","cap":41,"used":42,"resets_at":"2030-06-16T00:00:00Z"}}}`
		if st != http.StatusTooManyRequests || body != want {
			t.Fatalf("alice past her cap: %d\n%s\nwant\n%s", st, body, want)
		}
		e.outcome()
		if after := e.state(); after.Balance != before.Balance || after.Holds != before.Holds {
			t.Fatalf("refusal moved the hot balance: %+v, before %+v", after, before)
		}
		if st, body := e.sendAs(`"user":"bob"`, nil); st != 200 {
			t.Fatalf("bob stopped by alice's counter: %d %s", st, body)
		}
		e.outcome()
		for range 3 {
			if st, body := e.sendAs("", nil); st != 200 {
				t.Fatalf("no end user: %d %s", st, body)
			}
			e.outcome()
		}
		c, err := e.store.Counters(context.Background(), e.org)
		must(t, err)
		day := balance.Day.StartMS(limitClock)
		if len(c) != 2 || c[balance.Counter{LimitID: "eu", Start: day, EndUser: "alice"}] != 42 || c[balance.Counter{LimitID: "eu", Start: day, EndUser: "bob"}] != 21 {
			t.Fatalf("counters %v: want alice 42, bob 21 (each request costs 21), nothing for no end user", c)
		}
		by := map[string]int{}
		for _, ev := range e.rec.events() {
			by[ev.EndUser]++
		}
		if by["alice"] != 2 || by["bob"] != 1 || by[""] != 3 {
			t.Fatalf("events by end user %v", by)
		}
		for _, bad := range []string{`"user":"team:alice"`, `"user":"a b"`, `"user":"` + strings.Repeat("x", 129) + `"`, `"user":7`} {
			before := e.state()
			st, body := e.sendAs(bad, nil)
			if st != http.StatusBadRequest || !strings.Contains(body, `"param":"user"`) {
				t.Fatalf("end user %s: %d %s", bad, st, body)
			}
			e.outcome()
			if after := e.state(); after != before {
				t.Fatalf("a bad end user moved the hot balance: %+v, before %+v", after, before)
			}
		}
		if st, body := e.sendAs(`"user":"alice","user":"bob"`, nil); st != http.StatusBadRequest {
			t.Fatalf("two user members (priced as one, served as the other): %d %s", st, body)
		}
		e.outcome()
	})
}

// TestEndUserHeaderAndRequired: with Config.EndUserHeader the header names the end user (the
// body's field is not read); with RequireEndUser a request without one is a 400, nothing held.
func TestEndUserHeaderAndRequired(t *testing.T) {
	t.Parallel()
	e := newLimitEnv(t, true, true, 20, balance.Limits{Version: 1}, nil, func(c *Config) {
		c.EndUserHeader = "X-End-User"
		c.RequireEndUser = true
	})
	e.rec.fin = e.store
	e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
		l.Limits = []balance.Limit{{ID: "carol", Scope: balance.Scope{Kind: balance.ScopeEndUser, ID: "carol"}, Window: balance.Day, Cap: 30}}
	})
	if st, body := e.sendAs(`"user":"dave"`, map[string]string{"X-End-User": "carol"}); st != 200 {
		t.Fatalf("carol by header: %d %s", st, body)
	}
	e.outcome()
	if st, body := e.sendAs(`"user":"dave"`, map[string]string{"X-End-User": "carol"}); st != http.StatusTooManyRequests ||
		!strings.Contains(body, "End user carol daily limit of 30 reached") {
		t.Fatalf("carol past her own cap (the body's user is not read): %d %s", st, body)
	}
	e.outcome()
	before := e.state()
	st, body := e.sendAs(`"user":"dave"`, nil)
	if st != http.StatusBadRequest || !strings.Contains(body, `"param":"X-End-User"`) || !strings.Contains(body, "missing_required_parameter") {
		t.Fatalf("no end user header, required: %d %s", st, body)
	}
	e.outcome()
	if after := e.state(); after != before {
		t.Fatalf("refusal moved the hot balance: %+v, before %+v", after, before)
	}
	if evs := e.rec.events(); len(evs) != 1 || evs[0].EndUser != "carol" {
		t.Fatalf("events %+v", evs)
	}
}

// TestParseEndUser: the end user is the member the upstream reads — OpenAI's top-level "user" on
// every priced endpoint, Anthropic's metadata.user_id — and a second or a variant spelling of it
// is refused, as for every field escrow reads.
func TestParseEndUser(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		endpoint, body, want string
		bad                  bool
	}{
		{EndpointChat, `{"model":"m","messages":[],"user":"alice"}`, "alice", false},
		{EndpointChat, `{"model":"m","messages":[],"user":null}`, "", false},
		{EndpointChat, `{"model":"m","messages":[],"user":"al\u0069ce"}`, "alice", false},
		{EndpointCompletions, `{"model":"m","prompt":"hi","user":"u-1@example.com"}`, "u-1@example.com", false},
		{EndpointEmbeddings, `{"model":"m","input":"hi","user":"e1"}`, "e1", false},
		{EndpointResponses, `{"model":"m","input":"hi","user":"r1"}`, "r1", false},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"metadata":{"user_id":"a1"}}`, "a1", false},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"metadata":{}}`, "", false},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"user":"x"}`, "", false}, // not what Anthropic reads
		{EndpointChat, `{"model":"m","messages":[],"user":"a","user":"b"}`, "", true},
		{EndpointChat, `{"model":"m","messages":[],"User":"a"}`, "", true},
		{EndpointChat, `{"model":"m","messages":[],"user":["a"]}`, "", true},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"metadata":{"user_id":"a","user_id":"b"}}`, "", true},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"metadata":{"userId":"a"}}`, "", true},
		{EndpointMessages, `{"model":"m","max_tokens":5,"messages":[],"metadata":"a"}`, "", true},
	} {
		r, e := parseRequest(c.endpoint, []byte(c.body))
		if c.bad {
			if e == nil || e.Status != http.StatusBadRequest {
				t.Errorf("%s %s: %+v, want a 400", c.endpoint, c.body, e)
			}
			continue
		}
		if e != nil || r.EndUser != c.want {
			t.Errorf("%s %s: end user %q (%+v), want %q", c.endpoint, c.body, r.EndUser, e, c.want)
		}
	}
}

// TestEndUserRequiredByLimit: an org whose limit of each end user apart requires an end user
// refuses a request naming none (400 missing_required_parameter, param user, nothing held) and
// serves the others; another org is not concerned.
func TestEndUserRequiredByLimit(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, true, 20, balance.Limits{Version: 1}, nil)
		e.rec.fin = e.store
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "each", Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Day, Cap: 1_000, RequireEndUser: true}}
		})
		st, body := e.sendAs("", nil)
		if st != http.StatusBadRequest || !strings.Contains(body, `"param":"user"`) || !strings.Contains(body, "missing_required_parameter") {
			t.Fatalf("no end user, required by the limit: %d %s", st, body)
		}
		e.outcome()
		if after := e.state(); after.Holds != 0 || after.Held != 0 || len(e.rec.events()) != 0 {
			t.Fatalf("the refusal held or recorded something: %+v, events %+v", after, e.rec.events())
		}
		if st, body := e.sendAs(`"user":"alice"`, nil); st != 200 {
			t.Fatalf("alice: %d %s", st, body)
		}
		e.outcome()
		if n := len(e.upstreamRequests()); n != 1 {
			t.Fatalf("upstream called %d times, want once (alice)", n)
		}
	})
}
