package server

import (
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
)

// Issue 10, items 2–4, against the whole server (the fake upstream decodes with Go's
// encoding/json, the most lenient reader): every hostile body is refused with an OpenAI-shaped
// 400 and nothing debited, and every body that is served was held at least what it cost.

// refusedUntouched sends body and checks a 400 with the param, and that org's balance and
// ledger are as funded.
func (p *testProxy) refusedUntouched(org, key, path, body, param string, funds int64) {
	p.t.Helper()
	st, _, b := p.do("POST", path, key, body)
	var e struct {
		Error struct {
			Type  string  `json:"type"`
			Code  *string `json:"code"`
			Param *string `json:"param"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || st != http.StatusBadRequest || e.Error.Type != "invalid_request_error" ||
		e.Error.Param == nil || *e.Error.Param != param {
		p.t.Fatalf("%s: status %d %s (%v), want 400 with param %q", body, st, b, err, param)
	}
	p.untouched(org, funds)
}

// untouched checks that org has its funds in Redis and in the ledger, no hold and no usage.
func (p *testProxy) untouched(org string, funds int64) {
	p.t.Helper()
	b := p.balance(org)
	acct, err := p.app.ledger.Account(context.Background(), org)
	if err != nil || b.Available != funds || b.Held != 0 || b.Holds != 0 || acct.Balance != funds || acct.Pending != 0 {
		p.t.Fatalf("org %s touched: %+v %+v %v, want %d", org, b, acct, err, funds)
	}
}

// servedExact sends body, expects a 200, and checks that once settled the org paid exactly the
// usage the client saw (model m: 1 micro-unit per output token, input free).
func (p *testProxy) servedExact(org, key, path, body string, funds int64) int64 {
	p.t.Helper()
	st, _, b := p.do("POST", path, key, body)
	if st != http.StatusOK {
		p.t.Fatalf("%s: status %d %s", body, st, b)
	}
	var u struct {
		Usage struct {
			Completion int64 `json:"completion_tokens"`
			Output     int64 `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &u); err != nil {
		p.t.Fatalf("%s: %v", b, err)
	}
	cost := u.Usage.Completion + u.Usage.Output
	if s := p.settled(org); s.Available != funds-cost || s.LedgerBalance != funds-cost {
		p.t.Fatalf("after settle %+v, want %d − visible cost %d", s, funds, cost)
	}
	return cost
}

func TestEdgeRequestHostileKeys(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		key := p.setup("acme", 10_000, 65)
		const chatPath, respPath = "/v1/chat/completions", "/v1/responses"
		msgs := `"messages":[{"role":"user","content":"hi"}]`
		for _, c := range []struct{ path, body, param string }{
			{chatPath, `{"model":"m","Model":"dear",` + msgs + `}`, "Model"},
			{chatPath, `{"model":"m","max_tokens":1,"Max_Tokens":16384,"N":8,` + msgs + `}`, "Max_Tokens"},
			{chatPath, `{"model":"m","MAX_TOKENS":16384,` + msgs + `}`, "MAX_TOKENS"},
			{chatPath, "{\"model\":\"m\",\"\u017ftream\":true," + msgs + "}", "\u017ftream"},
			{chatPath, "{\"model\":\"m\",\"max_to\u212aens\":900," + msgs + "}", "max_to\u212aens"},
			{chatPath, `{"model":"m","n":1,"n":16,` + msgs + `}`, "n"},
			{chatPath, `{"model":"m","n":0,` + msgs + `}`, "n"},
			{chatPath, `{"model":"m","n":1.5,` + msgs + `}`, "n"},
			{chatPath, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi","type":"image_url"}]}]}`,
				"messages[0].content[0].type"},
			{respPath, `{"model":"m","input":"hi","tools":[{"type":"function","name":"f","type":"web_search_preview"}]}`, "tools[0].type"},
			{respPath, `{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"ok","OUTPUT":[{"type":"input_image","image_url":"u"}]}]}`,
				"input[0].OUTPUT"},
		} {
			p.refusedUntouched("acme", key, c.path, c.body, c.param, 10_000)
		}
		// The same request spelled exactly is served and billed what the client saw.
		if cost := p.servedExact("acme", key, chatPath, `{"model":"m","max_tokens":3,"n":2,`+msgs+`}`, 10_000); cost != 6 {
			t.Fatalf("cost %d, want 2 choices × 3 tokens", cost)
		}
	})
}

// n multiplies the learned max: 16 choices hold 16 × 65, so an org with one micro-unit less is
// refused untouched, one with exactly that is served, and both end without debt.
func TestEdgeRequestNHold(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		const learned, n = 65, 16
		// An image part keeps the learned max (no body bound).
		body := `{"model":"m","n":16,"messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}`
		short := p.setup("short", n*learned-1, learned)
		st, _, b := p.do("POST", "/v1/chat/completions", short, body)
		if st != http.StatusTooManyRequests {
			t.Fatalf("org with %d: status %d %s, want 429", n*learned-1, st, b)
		}
		p.untouched("short", n*learned-1)
		exact := p.setup("exact", n*learned, learned)
		if cost := p.servedExact("exact", exact, "/v1/chat/completions", body, n*learned); cost != n*20 {
			t.Fatalf("cost %d, want %d choices × 20", cost, n)
		}
	})
}

// A stored prompt or a function_call_output with an uploaded image (a file id) keeps the learned
// max (65) where plain text with max_output_tokens 5 holds 5. (An image in the body is bounded
// by the image rule since issue 32.)
func TestEdgeRequestResponsesInputs(t *testing.T) {
	t.Parallel()
	eachMode(t, func(t *testing.T, p *testProxy) {
		const learned = 65
		for i, body := range []string{
			`{"model":"m","prompt":{"id":"pmpt_1","version":"2"},"input":"hi","max_output_tokens":5}`,
			`{"model":"m","max_output_tokens":5,"input":[{"type":"function_call","call_id":"c","name":"shot","arguments":"{}"},` +
				`{"type":"function_call_output","call_id":"c","output":[{"type":"input_image","file_id":"file-1"}]},` +
				`{"role":"user","content":"hi"}]}`,
			`{"model":"m","max_output_tokens":5,"input":[{"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_file","file_id":"file-1"}]}]}`,
		} {
			org := "r" + strconv.Itoa(i)
			key := p.setup(org, learned-1, learned)
			if st, _, b := p.do("POST", "/v1/responses", key, body); st != http.StatusTooManyRequests {
				t.Fatalf("%s with %d: status %d %s, want 429 (the hold must stay the learned max)", body, learned-1, st, b)
			}
			p.untouched(org, learned-1)
			org2 := org + "ok"
			key = p.setup(org2, learned, learned)
			p.servedExact(org2, key, "/v1/responses", body, learned)
		}
		// Control: plain text with the same cap holds 5 and passes with 64.
		key := p.setup("plain", learned-1, learned)
		if cost := p.servedExact("plain", key, "/v1/responses", `{"model":"m","input":"hi","max_output_tokens":5}`, learned-1); cost != 5 {
			t.Fatalf("cost %d, want 5", cost)
		}
	})
}
