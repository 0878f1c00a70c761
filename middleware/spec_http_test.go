package middleware

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// Issue 32, items 1–6, over HTTP against the fake upstream in its Worst mode: an upstream that
// ignores unknown fields, fills every cap it reads and generates its full default (32,768
// tokens; legacy completions 16) when it reads none — as vLLM, Ollama and most OpenAI-compatible
// servers bill.

// upstreamMax is the fake's full default: what it generates without a cap it reads.
const upstreamMax = 32_768

// specPrices: 1 per input token, 8 per output token (the figures).
var specPrices = pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 8_000_000}

// specEnv is an env whose upstream is the Worst fake, with two models: gpt-short, whose max
// output escrow knows as 1,000 (the upstream's is 32,768), and gpt-wide (32,768); and an Anthropic
// one, claude-w (64,000).
func specEnv(t *testing.T, mini bool) *testEnv {
	t.Helper()
	e := newEnv(t, envOpt{mini: mini, finish: true})
	ctx := context.Background()
	for _, m := range []ledger.Model{
		{Name: "gpt-short", Prices: specPrices, MaxInputTokens: 128_000, MaxOutputTokens: 1000},
		{Name: "gpt-wide", Prices: specPrices, MaxInputTokens: 128_000, MaxOutputTokens: upstreamMax},
		{Name: "claude-w", Prices: specPrices, MaxInputTokens: 200_000, MaxOutputTokens: 64_000},
	} {
		must(t, e.ledger.PutModel(ctx, m))
	}
	fake := fakeupstream.New(fakeupstream.Options{Worst: true, MaxOutputTokens: 65_536, KeepRequests: -1})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		r.Body = io.NopCloser(bytes.NewReader(body))
		fake.ServeHTTP(w, r)
	})
	return e
}

// lastSent is the body the upstream got last.
func (e *testEnv) lastSent() []byte {
	e.t.Helper()
	ups := e.upstreamRequests()
	if len(ups) == 0 {
		e.t.Fatal("nothing reached the upstream")
	}
	return ups[len(ups)-1].Body
}

// servedWithin sends body for org's key, wants a 200 whose cost is at most its hold and an
// org ledger that stays ≥ 0 and exact; it returns the outcome and the body the upstream got.
func (e *testEnv) servedWithin(path, org, key, body string, credit int64, hdr map[string]string) (Outcome, []byte) {
	e.t.Helper()
	st, _, b := e.postH(path, key, body, hdr)
	o := e.outcome()
	if st != http.StatusOK || o.Kind != OutcomeRecorded {
		e.t.Fatalf("%s: status %d outcome %s: %.300s", body, st, o.Kind, b)
	}
	if o.Cost > o.HoldAmount {
		e.t.Fatalf("%s: cost %d above the hold %d (usage %+v): the org goes into debt", body, o.Cost, o.HoldAmount, o.Usage)
	}
	if a := e.accountOf(org); a.Balance != credit-o.Cost || a.Balance < 0 {
		e.t.Fatalf("ledger %+v after a cost of %d on %d", a, o.Cost, credit)
	}
	return o, e.lastSent()
}

// TestForeignCapRefused (item 1): a cap field the endpoint does not define — chat with
// Responses' max_output_tokens, Responses with max_tokens, the legacy completion with
// max_completion_tokens, embeddings with any, Anthropic with max_completion_tokens — is a 400
// invalid_request_error naming it, and nothing is held. Before: the hold was sized from it (184)
// while the upstream ignored it and generated its default (cost 262,170).
func TestForeignCapRefused(t *testing.T) {
	t.Parallel()
	cases := []struct{ path, body, field string }{
		{EndpointChat, `{"model":"gpt-wide","max_output_tokens":1,"messages":[{"role":"user","content":"hi"}]}`, "max_output_tokens"},
		{EndpointChat, `{"model":"gpt-wide","max_tokens":100,"max_output_tokens":30000,"messages":[{"role":"user","content":"hi"}]}`, "max_output_tokens"},
		{EndpointResponses, `{"model":"gpt-wide","max_tokens":1,"input":"hi"}`, "max_tokens"},
		{EndpointResponses, `{"model":"gpt-wide","max_completion_tokens":1,"input":"hi"}`, "max_completion_tokens"},
		{EndpointCompletions, `{"model":"gpt-wide","max_completion_tokens":1,"prompt":"hi"}`, "max_completion_tokens"},
		{EndpointEmbeddings, `{"model":"gpt-wide","max_tokens":1,"input":"hi"}`, "max_tokens"},
		{EndpointMessages, `{"model":"claude-w","max_tokens":10,"max_output_tokens":1,"messages":[{"role":"user","content":"hi"}]}`, "max_output_tokens"},
	}
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		for _, c := range cases {
			org, key := e.poorKey(2000)
			st, _, b := e.postH(c.path, key, c.body, nil)
			o := e.outcome()
			typ := gjson.Get(b, "error.type").String()
			if st != http.StatusBadRequest || typ != TypeInvalidRequest || o.Kind != OutcomeRefused || o.HoldAmount != 0 ||
				!strings.Contains(gjson.Get(b, "error.message").String(), c.field) {
				t.Fatalf("%s %s: status %d outcome %+v: %s, want a 400 invalid_request_error naming %s", c.path, c.body, st, o, b, c.field)
			}
			if c.path != EndpointMessages && gjson.Get(b, "error.param").String() != c.field {
				t.Fatalf("%s: param of %s", c.body, b)
			}
			e.assertUntouched(org, 2000)
			e.org += "x" // the next poorKey makes another org
		}
		if n := len(e.upstreamRequests()); n != 0 {
			t.Fatalf("%d refused requests reached the upstream", n)
		}
	})
}

// TestFitNeverRaisesCap (item 2): fit writes min(fitted cap, the cap the request would
// otherwise get) into each cap field the body has: chat with max_tokens 100 and
// max_completion_tokens 30,000 (the upstream reads the latter) fitted to C keeps max_tokens 100.
// Before: C was written into both, raising max_tokens from 100 to C.
func TestFitNeverRaisesCap(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		const credit = 100_000
		org, key := e.poorKey(credit)
		body := `{"model":"gpt-wide","max_tokens":100,"max_completion_tokens":30000,"messages":[{"role":"user","content":"hi"}]}`
		o, sent := e.servedWithin(EndpointChat, org, key, body, credit, nil)
		c := gjson.GetBytes(sent, "max_completion_tokens").Int()
		if o.FitCap == 0 || c != o.FitCap || c >= 30000 {
			t.Fatalf("fit cap %d, upstream read max_completion_tokens %d: want it fitted below 30,000", o.FitCap, c)
		}
		if mt := gjson.GetBytes(sent, "max_tokens").Int(); mt != 100 {
			t.Fatalf("max_tokens sent %d, want the request's 100 kept (fit never raises a cap): %s", mt, sent)
		}
		if o.Usage.Completion != c {
			t.Fatalf("billed %d output tokens, want the cap %d", o.Usage.Completion, c)
		}
	})
}

// TestCompletionsDefaultCap (item 3): a legacy completion without max_tokens is held at the
// upstream's default of 16 and sent with max_tokens: 16 — an org with 100,000 pays what a rich
// one pays. Before: it was "fitted" and 12,491 was written in (cost 99,940, 714× the 140 a rich
// org paid).
func TestCompletionsDefaultCap(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		body := `{"model":"gpt-wide","prompt":"Say hello"}`
		for _, credit := range []int64{100_000, 10_000_000} {
			org, key := e.poorKey(credit)
			o, sent := e.servedWithin(EndpointCompletions, org, key, body, credit, nil)
			want := int64(len(body)) + 8*16
			if o.HoldAmount != want || o.FitCap != 0 || gjson.GetBytes(sent, "max_tokens").Int() != 16 || o.Usage.Completion != 16 {
				t.Fatalf("credit %d: hold %d (fit %d), sent %s, usage %+v: want the bound at 16, %d, and max_tokens 16",
					credit, o.HoldAmount, o.FitCap, sent, o.Usage, want)
			}
			e.org += "x" // the next poorKey makes another org
		}
	})
}

// TestAbsentCapWrittenIn (item 4): a request without a cap is held at the model's max output
// (1,000 here) and sent with it in the endpoint's field, so an upstream whose own default is
// 32,768 generates no more than the hold priced. Before: the body went out without a cap and
// the upstream generated 32,768 (−212,170 on a balance of 50,000).
func TestAbsentCapWrittenIn(t *testing.T) {
	t.Parallel()
	cases := []struct{ path, body, field string }{
		{EndpointChat, `{"model":"gpt-short","messages":[{"role":"user","content":"hi"}]}`, "max_completion_tokens"},
		{EndpointChat, `{"model":"gpt-short","stream":true,"messages":[{"role":"user","content":"hi"}]}`, "max_completion_tokens"},
		{EndpointResponses, `{"model":"gpt-short","input":"hi"}`, "max_output_tokens"},
		{EndpointResponses, `{"model":"gpt-short","input":"hi","previous_response_id":"resp_1"}`, "max_output_tokens"}, // unbounded: still capped
	}
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		for _, c := range cases {
			const credit = 200_000 // less than the upstream's default output (32,768 × 8)
			org, key := e.poorKey(credit)
			o, sent := e.servedWithin(c.path, org, key, c.body, credit, nil)
			if got := gjson.GetBytes(sent, c.field).Int(); got != 1000 || o.Usage.Completion != 1000 {
				t.Fatalf("%s: sent %s (%s = %d), billed %+v: want the model's max 1,000 written in", c.body, sent, c.field, got, o.Usage)
			}
			e.org += "x"
		}
	})
}

// TestBoundedPartsHoldWhatTheyState (item 5): an image part, functions, Anthropic tools or
// server-side context with max_tokens 32,768 never hold less than the request states — with a
// learned max of 32 (one small request), the 20 at once on 2,000 drove the org to
// −7,240,880. Images are bounded by the image rule of their detail, tool definitions by their
// bytes plus the preamble, and server-side context holds max(learned max, what it states).
func TestBoundedPartsHoldWhatTheyState(t *testing.T) {
	t.Parallel()
	img := `{"type":"image_url","image_url":{"url":"https://x/y.png"}}`
	cases := []struct {
		name, path, body string
		bounded          bool // the hold is the bound (fit may serve a small org)
	}{
		{"chat image", EndpointChat, `{"model":"gpt-wide","max_tokens":32768,"messages":[{"role":"user","content":[{"type":"text","text":"what is it"},` + img + `]}]}`, true},
		{"chat low-detail images", EndpointChat, `{"model":"gpt-wide","max_tokens":32768,"messages":[{"role":"user","content":[` +
			strings.Repeat(`{"type":"image_url","image_url":{"url":"https://x/y.png","detail":"low"}},`, 3) + `{"type":"text","text":"?"}]}]}`, true},
		{"responses image", EndpointResponses, `{"model":"gpt-wide","max_output_tokens":32768,"input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y.png","detail":"high"}]}]}`, true},
		{"functions", EndpointChat, `{"model":"gpt-wide","max_tokens":32768,"functions":[{"name":"f","parameters":{"type":"object"}}],"messages":[{"role":"user","content":"hi"}]}`, true},
		{"anthropic tools", EndpointMessages, `{"model":"claude-w","max_tokens":32768,"tools":[{"name":"f","input_schema":{"type":"object"}}],"messages":[{"role":"user","content":"hi"}]}`, true},
		{"anthropic image", EndpointMessages, `{"model":"claude-w","max_tokens":32768,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x/y.png"}}]}]}`, true},
		{"previous_response_id", EndpointResponses, `{"model":"gpt-wide","max_output_tokens":32768,"input":"hi","previous_response_id":"resp_1"}`, false},
	}
	eachRedis(t, func(t *testing.T, mini bool) {
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				e := specEnv(t, mini)
				model := gjson.Get(c.body, "model").String()
				if _, err := e.store.RaiseModelMax(context.Background(), model, 32, 0, 1<<40); err != nil {
					t.Fatal(err)
				}
				const rich = 10_000_000
				org, key := e.poorKey(rich)
				o, _ := e.servedWithin(c.path, org, key, c.body, rich, nil)
				if o.HoldAmount < 8*32768 {
					t.Fatalf("hold %d: below its output cap alone (%d)", o.HoldAmount, 8*32768)
				}
				// A small org: a bounded request is fitted (and billed within its hold), an
				// unbounded one refused; never served into debt.
				e.org += "x"
				const poor = 8000 // the parts and 256 output tokens fit; 32,768 do not
				org, key = e.poorKey(poor)
				if c.bounded {
					o, _ := e.servedWithin(c.path, org, key, c.body, poor, nil)
					if o.FitCap == 0 {
						t.Fatalf("a bounded request on %d was not fitted: %+v", poor, o)
					}
					return
				}
				st, _, b := e.postH(c.path, key, c.body, nil)
				if o := e.outcome(); st != http.StatusTooManyRequests || o.Kind != OutcomeRefused {
					t.Fatalf("unbounded on %d: status %d %s", poor, st, b)
				}
				e.assertUntouched(org, poor)
			})
		}
	})
}

// TestThinkingBudgetKeptValid (item 6): a Messages request with extended thinking is fitted
// to a max_tokens above its budget: the budget is lowered below the fitted cap (and never below
// 1,024), or the request is refused with the numbers. Before: budget_tokens 50,000 was sent
// with a fitted max_tokens of 19,946 (Anthropic answers 400).
func TestThinkingBudgetKeptValid(t *testing.T) {
	t.Parallel()
	body := `{"model":"claude-w","max_tokens":60000,"thinking":{"type":"enabled","budget_tokens":50000},"messages":[{"role":"user","content":"think"}]}`
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		const credit = 160_000 // about 20,000 output tokens
		org, key := e.poorKey(credit)
		o, sent := e.servedWithin(EndpointMessages, org, key, body, credit, nil)
		c, b := gjson.GetBytes(sent, "max_tokens").Int(), gjson.GetBytes(sent, "thinking.budget_tokens").Int()
		if o.FitCap == 0 || c != o.FitCap || b >= c || b < endpoint.DefaultMinThinking || gjson.GetBytes(sent, "thinking.type").String() != "enabled" {
			t.Fatalf("sent max_tokens %d, budget_tokens %d (fit %d): want budget < max_tokens, ≥ 1,024: %s", c, b, o.FitCap, sent)
		}
		// An org that cannot pay 1,025 output tokens: refused with the numbers.
		e.org += "x"
		org, key = e.poorKey(5000)
		st, _, resp := e.postH(EndpointMessages, key, body, nil)
		e.outcome()
		if st != http.StatusPaymentRequired || !strings.Contains(resp, "1025") || !strings.Contains(resp, "budget_tokens") {
			t.Fatalf("status %d %s: want 402 billing_error with the thinking numbers", st, resp)
		}
		e.assertUntouched(org, 5000)
	})
}

// TestFitHeaderAnyCase (item 6): escrow's own header values are read in any case:
// "x-escrow-fit: OFF" asks for the refusal like "off". Before: only "off" was.
func TestFitHeaderAnyCase(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := specEnv(t, mini)
		for _, v := range []string{"off", "OFF", "Off", " oFf "} {
			org, key := e.poorKey(4000) // fit would serve 256 or more output tokens

			st, h, b := e.postH(EndpointChat, key, `{"model":"gpt-short","messages":[{"role":"user","content":"hi"}]}`, map[string]string{HeaderFit: v})
			e.outcome()
			if st != http.StatusTooManyRequests || h.Get(HeaderOutputCap) != "" || gjson.Get(b, "error.code").String() != CodeInsufficientQuota {
				t.Fatalf("%s: %q: status %d %.300s, want the refusal", HeaderFit, v, st, b)
			}
			e.assertUntouched(org, 4000)
			e.org += "x"
		}
		// include-cost too.
		_, key := e.poorKey(10_000)
		_, _, b := e.postH(EndpointChat, key, `{"model":"gpt-short","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`,
			map[string]string{HeaderIncludeCost: "TRUE"})
		e.outcome()
		if !strings.Contains(b, ": escrow {") {
			t.Fatalf("%s: TRUE: no cost comment in %s", HeaderIncludeCost, b)
		}
	})
}
