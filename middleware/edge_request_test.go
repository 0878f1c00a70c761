package middleware

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/tidwall/gjson"
)

// Issue 10, item 2: a body in which a lenient upstream would read a field other than the one
// escrow priced — a case or fold variant, or a duplicate, at any depth that prices — is refused
// with an OpenAI-shaped 400, nothing held or recorded, and never reaches the upstream.
func TestHostileKeysRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	ctx := context.Background()
	chat := func(extra string) string { return jsonBody(testModel, extra) }
	tests := []struct{ name, path, body, param string }{
		{"Model beside model", EndpointChat, chat(`"Model":"gpt-dear"`), "Model"},
		{"Model alone", EndpointChat, `{"Model":"gpt-test","messages":[]}`, "Model"},
		{"escaped Model", EndpointChat, chat(`"\u004dodel":"gpt-dear"`), "Model"},
		{"MAX_TOKENS", EndpointChat, chat(`"max_tokens":1,"MAX_TOKENS":16384`), "MAX_TOKENS"},
		{"Max_Tokens and N", EndpointChat, chat(`"max_tokens":1,"Max_Tokens":16384,"N":8`), "Max_Tokens"},
		{"N", EndpointChat, chat(`"N":8`), "N"},
		{"Best_Of", EndpointCompletions, `{"model":"gpt-test","prompt":"x","max_tokens":5,"Best_Of":20}`, "Best_Of"},
		{"long s stream", EndpointChat, chat("\"\u017ftream\":true"), "\u017ftream"},
		{"escaped long s stream", EndpointChat, chat(`"\u017Ftream":true`), "\u017ftream"},
		{"Kelvin max_tokens", EndpointChat, chat("\"max_to\u212aens\":16384"), "max_to\u212aens"},
		{"v2 spelling maxTokens", EndpointChat, chat(`"max_tokens":1,"maxTokens":16384`), "maxTokens"},
		{"v2 spelling max-completion-tokens", EndpointChat, chat(`"max-completion-tokens":16384`), "max-completion-tokens"},
		{"Stream_Options", EndpointChat, chat(`"stream":true,"Stream_Options":{"include_usage":false}`), "Stream_Options"},
		{"Include_Usage", EndpointChat, chat(`"stream":true,"stream_options":{"Include_Usage":false}`), "stream_options.Include_Usage"},
		{"duplicate model", EndpointChat, `{"model":"gpt-test","model":"gpt-dear"}`, "model"},
		{"duplicate n", EndpointChat, chat(`"n":1,"n":16`), "n"},
		{"Service_Tier", EndpointChat, chat(`"Service_Tier":"priority"`), "Service_Tier"},
		{"Modalities", EndpointChat, chat(`"Modalities":["text","audio"]`), "Modalities"},
		{"Background", EndpointResponses, `{"model":"gpt-test","input":"hi","Background":true}`, "Background"},
		{"duplicate tool type", EndpointResponses,
			`{"model":"gpt-test","input":"hi","tools":[{"type":"function","name":"f","type":"web_search_preview"}]}`, "tools[0].type"},
		{"tool Type variant", EndpointResponses,
			`{"model":"gpt-test","input":"hi","tools":[{"type":"function","name":"f"},{"type":"function","Type":"web_search_preview"}]}`, "tools[1].Type"},
		{"Tools", EndpointResponses, `{"model":"gpt-test","input":"hi","Tools":[{"type":"web_search_preview"}]}`, "Tools"},
		{"tool_choice Type", EndpointResponses,
			`{"model":"gpt-test","input":"hi","tool_choice":{"type":"function","name":"f","TYPE":"web_search_preview"}}`, "tool_choice.TYPE"},
		{"part type duplicate", EndpointChat,
			`{"model":"gpt-test","messages":[{"role":"user","content":[{"type":"text","text":"a","type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}`,
			"messages[0].content[0].type"},
		{"part Type variant", EndpointResponses,
			`{"model":"gpt-test","input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","Type":"input_file","file_id":"f"}]}]}`,
			"input[0].content[1].Type"},
		{"message Content variant", EndpointChat,
			`{"model":"gpt-test","messages":[{"role":"user","content":"hi","Content":[{"type":"image_url","image_url":{"url":"http://x"}}]}]}`,
			"messages[0].Content"},
		{"item type duplicate", EndpointResponses,
			`{"model":"gpt-test","input":[{"type":"message","role":"user","content":"hi","type":"item_reference","id":"msg_1"}]}`, "input[0].type"},
		{"function_call_output Output", EndpointResponses,
			`{"model":"gpt-test","input":[{"type":"function_call_output","call_id":"c","output":"ok","Output":[{"type":"input_image","image_url":"http://x"}]}]}`,
			"input[0].Output"},
		{"n zero", EndpointChat, chat(`"n":0`), "n"},
		{"n negative", EndpointChat, chat(`"n":-2`), "n"},
		{"n fraction", EndpointChat, chat(`"n":1.5`), "n"},
		{"n exponent", EndpointChat, chat(`"n":1e1`), "n"},
		{"n string", EndpointChat, chat(`"n":"16"`), "n"},
		{"best_of zero", EndpointCompletions, `{"model":"gpt-test","prompt":"x","best_of":0}`, "best_of"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := e.post(ctx, tt.path, e.key, tt.body)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest {
				t.Fatalf("status %d, want 400: %s", resp.StatusCode, body)
			}
			typ, code, param := openAIError(t, body)
			if typ != TypeInvalidRequest || code != CodeInvalidValue || param != tt.param {
				t.Fatalf("type %q code %q param %q, want param %q: %s", typ, code, param, tt.param, body)
			}
			if o := e.outcome(); o.Kind != OutcomeRefused || o.Status != 400 || o.HoldID != "" {
				t.Fatalf("outcome %+v", o)
			}
		})
	}
	e.assertNothingDebited()
	if n := len(e.upstreamRequests()); n != 0 {
		t.Fatalf("upstream called %d times", n)
	}
	// The same bodies spelled exactly are served: the refusals come from the spelling.
	resp := e.post(ctx, EndpointChat, e.key, chat(`"max_tokens":16,"n":2,"stream":false,"stream_options":null`))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if o := e.outcome(); resp.StatusCode != 200 || o.Kind != OutcomeRecorded {
		t.Fatalf("exact spelling: %d %+v", resp.StatusCode, o)
	}
}

// perChoiceUpstream answers chat and completions with n (or best_of) choices of outTokens
// output tokens each, and Responses with inTokens of input (a stored prompt or a file expands
// server-side) and outTokens of output, like a real upstream bills them.
func perChoiceUpstream(inTokens, outTokens int64) func(w http.ResponseWriter, r *http.Request, body []byte) {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == EndpointResponses {
			_, _ = io.WriteString(w, `{"id":"resp_1","object":"response","status":"completed","output":[],"usage":{"input_tokens":`+
				itoa(inTokens)+`,"output_tokens":`+itoa(outTokens)+`,"total_tokens":`+itoa(inTokens+outTokens)+`}}`)
			return
		}
		n := max(gjson.GetBytes(body, "n").Int(), gjson.GetBytes(body, "best_of").Int(), 1)
		out := outTokens
		if c := gjson.GetBytes(body, "max_tokens"); c.Exists() {
			out = min(out, c.Int())
		}
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","choices":[],"usage":{"prompt_tokens":`+itoa(inTokens)+
			`,"completion_tokens":`+itoa(n*out)+`,"total_tokens":`+itoa(inTokens+n*out)+`}}`)
	}
}

// poorKey makes an org with credit micro-units and returns its id and a key.
func (e *testEnv) poorKey(credit int64) (string, string) {
	e.t.Helper()
	ctx := context.Background()
	org := e.org + "p"
	must(e.t, e.ledger.CreateOrg(ctx, org))
	if _, _, err := e.ledger.Credit(ctx, org, credit, "pay-"+org); err != nil {
		e.t.Fatal(err)
	}
	_, key, err := e.ledger.CreateKey(ctx, org)
	must(e.t, err)
	return org, key
}

// assertUntouched checks that org's hot balance (if seeded) and ledger account still hold
// credit, with no hold and no usage.
func (e *testEnv) assertUntouched(org string, credit int64) {
	e.t.Helper()
	ctx := context.Background()
	st, err := e.store.State(ctx, org)
	must(e.t, err)
	if st.Exists && (st.Balance != credit || st.Held != 0 || st.Holds != 0) {
		e.t.Fatalf("hot balance of %s touched: %+v", org, st)
	}
	a, err := e.ledger.Account(ctx, org)
	must(e.t, err)
	if a.Balance != credit || a.Pending != 0 {
		e.t.Fatalf("ledger of %s touched: %+v", org, a)
	}
}

// served sends body and checks that it was served and billed at most its hold; it returns the
// outcome.
func (e *testEnv) served(path, key, body string) Outcome {
	e.t.Helper()
	resp := e.post(context.Background(), path, key, body)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	o := e.outcome()
	if resp.StatusCode != 200 || o.Kind != OutcomeRecorded {
		e.t.Fatalf("status %d outcome %+v: %s", resp.StatusCode, o, b)
	}
	if o.Cost > o.HoldAmount {
		e.t.Fatalf("cost %d above the hold %d: the org can be driven into debt", o.Cost, o.HoldAmount)
	}
	return o
}

// Issue 10, item 3: n and best_of multiply the learned max as well as the request's bound, so
// the hold covers every choice; an org that cannot cover them all is refused with nothing
// debited (before, n:16 with a learned max held one choice and drove the org into debt).
func TestNMultipliesTheHold(t *testing.T) {
	t.Parallel()
	const out = 1000 // the model's max output tokens: each choice writes all of them
	// One choice costs 12 + 2×1000 micro-units; that is the learned max.
	learned := int64(12 + 2*out)
	setup := func(t *testing.T) *testEnv {
		e := newEnv(t, envOpt{})
		e.setUpstream(perChoiceUpstream(12, out))
		if _, err := e.store.RaiseModelMax(context.Background(), testModel, learned, 0, 1<<40); err != nil {
			t.Fatal(err)
		}
		return e
	}
	// A body escrow cannot bound (a predicted output is not on the plain-text list) holds the
	// learned max (at least what it states: its small cap keeps that below); a plain one its
	// bound, with the model's max output when it states no cap.
	const unbounded = `"prediction":{"type":"content","content":"x"},"max_tokens":10`
	t.Run("rich org: the hold covers 16 choices", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		o := e.served(EndpointChat, e.key, jsonBody(testModel, `"n":16,`+unbounded))
		if want := 16 * learned; o.HoldAmount != want {
			t.Fatalf("hold %d, want 16 × learned = %d", o.HoldAmount, want)
		}
		first := o.Cost
		body := jsonBody(testModel, `"n":16`)
		o = e.served(EndpointChat, e.key, body)
		if want := int64(16 * (len(body) + 2*out)); o.HoldAmount != want {
			t.Fatalf("plain: hold %d, want 16 × the bound with the max output = %d", o.HoldAmount, want)
		}
		if want := int64(12 + 16*2*out); o.Cost != want {
			t.Fatalf("cost %d, want %d", o.Cost, want)
		}
		if _, err := e.ledger.AccountPending(context.Background(), 100); err != nil {
			t.Fatal(err)
		}
		if a := e.account(); a.Balance != testCredit-first-o.Cost {
			t.Fatalf("ledger balance %d, want %d", a.Balance, testCredit-first-o.Cost)
		}
	})
	t.Run("best_of above n", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		o := e.served(EndpointCompletions, e.key, `{"model":"gpt-test","prompt":"say hi","n":2,"best_of":4,`+unbounded+`}`)
		if want := 4 * learned; o.HoldAmount != want {
			t.Fatalf("hold %d, want 4 × learned = %d", o.HoldAmount, want)
		}
	})
	t.Run("plain text with a cap: bound × n", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		body := jsonBody(testModel, `"n":16,"max_tokens":10`)
		o := e.served(EndpointChat, e.key, body)
		if want := int64(16 * (len(body) + 2*10)); o.HoldAmount != want {
			t.Fatalf("hold %d, want (bytes + 2×10) × 16 = %d", o.HoldAmount, want)
		}
	})
	t.Run("org that covers one choice but not 16 is refused", func(t *testing.T) {
		t.Parallel()
		e := setup(t)
		credit := 30_000 // > learned (2,012), < 16 choices (32,192)
		org, key := e.poorKey(int64(credit))
		resp := e.post(context.Background(), EndpointChat, key, jsonBody(testModel, `"n":16,`+unbounded))
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusTooManyRequests {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if _, code, _ := openAIError(t, body); code != CodeInsufficientQuota {
			t.Fatalf("code %q", code)
		}
		if o := e.outcome(); o.Kind != OutcomeRefused || o.HoldAmount != 16*learned {
			t.Fatalf("outcome %+v", o)
		}
		e.assertUntouched(org, int64(credit))
		if len(e.upstreamRequests()) != 0 {
			t.Fatal("refused request reached the upstream")
		}
		// One choice fits: the refusal is the n.
		o := e.served(EndpointChat, key, jsonBody(testModel, `"n":1,`+unbounded))
		if o.HoldAmount != learned {
			t.Fatalf("one choice held %d, want %d", o.HoldAmount, learned)
		}
	})
}

// Issue 10, item 3 (learning): a real cost of n choices teaches the learned max ⌈cost/n⌉, the
// cost of one choice, so the next request with the same n holds what it costs, not n times it.
func TestLearnedMaxIsPerChoice(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{})
	e.setUpstream(perChoiceUpstream(13, 1000))
	ctx := context.Background()
	o := e.served(EndpointChat, e.key, jsonBody(testModel, `"n":4`))
	if o.Cost != 13+4*2000 {
		t.Fatalf("cost %d", o.Cost)
	}
	want := (o.Cost + 3) / 4
	e.drainWorker() // the worker learns the max from the usage event, which carries n
	waitFor(t, func() bool { m, err := e.store.ModelMax(ctx, testModel); return err == nil && m == want },
		"learned max = ⌈cost/4⌉ = "+itoa(want))
	// The next n:4 request that escrow cannot bound (a predicted output) holds 4 × the learned
	// max, which covers its cost.
	// (Its cap keeps what it states, the hold's floor, below 4 × the learned max.)
	o2 := e.served(EndpointChat, e.key, jsonBody(testModel, `"n":4,"max_tokens":10,"prediction":{"type":"content","content":"x"}`))
	if o2.HoldAmount != 4*want || o2.Cost > o2.HoldAmount {
		t.Fatalf("second hold %d (cost %d), want %d", o2.HoldAmount, o2.Cost, 4*want)
	}
}

// Issue 10, item 4: Responses inputs that the body's bytes do not bound — a stored prompt, a
// function_call_output whose output holds a file, file ids, item references — keep the learned
// max; input_text / output_text parts lower the hold to the bound, and (issue 32) an image
// given in the body adds the image rule's most (1,445 tokens at high detail) to it.
func TestResponsesInputsKeepTheLearnedMax(t *testing.T) {
	t.Parallel()
	// The stored prompt / image / file expands upstream to 50,000 input tokens.
	const inTokens, outTokens = 50_000, 100
	const learned = int64(100_000)
	tests := []struct {
		name, body string
		plain      bool // the hold drops to the body's bound
	}{
		{"stored prompt", `{"model":"gpt-test","prompt":{"id":"pmpt_abc","version":"2"},"input":"hi","max_output_tokens":100}`, false},
		{"stored prompt alone", `{"model":"gpt-test","prompt":{"id":"pmpt_abc"},"max_output_tokens":100}`, false},
		{"function_call_output with an uploaded image", `{"model":"gpt-test","max_output_tokens":100,"input":[` +
			`{"type":"function_call","call_id":"c1","name":"shot","arguments":"{}"},` +
			`{"type":"function_call_output","call_id":"c1","output":[{"type":"input_image","file_id":"file-1"}]}]}`, false},
		{"function_call_output with a file", `{"model":"gpt-test","max_output_tokens":100,"input":[` +
			`{"type":"function_call_output","call_id":"c1","output":[{"type":"input_text","text":"see"},{"type":"input_file","file_id":"file-1"}]}]}`, false},
		{"input_file part", `{"model":"gpt-test","max_output_tokens":100,"input":[{"role":"user","content":[{"type":"input_file","file_id":"file-1"}]}]}`, false},
		{"text part carrying a file id", `{"model":"gpt-test","max_output_tokens":100,"input":[{"role":"user","content":[{"type":"input_text","text":"a","file_id":"file-1"}]}]}`, false},
		{"chat-style text part on responses", `{"model":"gpt-test","max_output_tokens":100,"input":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`, false},
		{"item reference", `{"model":"gpt-test","max_output_tokens":100,"input":[{"type":"item_reference","id":"msg_1"}]}`, false},
		{"previous_response_id", `{"model":"gpt-test","max_output_tokens":100,"input":"hi","previous_response_id":"resp_0"}`, false},
		{"unknown item field", `{"model":"gpt-test","max_output_tokens":100,"input":[{"role":"user","content":"hi","attachments":["file-1"]}]}`, false},
		// Controls: text alone is bounded by the body.
		{"function_call_output with text parts", `{"model":"gpt-test","max_output_tokens":100,"input":[` +
			`{"type":"function_call_output","call_id":"c1","output":[{"type":"input_text","text":"42"}]}]}`, true},
		{"input_text and output_text", `{"model":"gpt-test","max_output_tokens":100,"input":[` +
			`{"role":"user","content":[{"type":"input_text","text":"a"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"b","annotations":[]}]}]}`, true},
		{"function_call_output with an image URL", `{"model":"gpt-test","max_output_tokens":100,"input":[` +
			`{"type":"function_call","call_id":"c1","name":"shot","arguments":"{}"},` +
			`{"type":"function_call_output","call_id":"c1","output":[{"type":"input_image","image_url":"https://x/y.png"}]}]}`, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, envOpt{})
			if _, err := e.store.RaiseModelMax(context.Background(), testModel, learned, 0, 1<<40); err != nil {
				t.Fatal(err)
			}
			if tt.plain {
				// Text only: the upstream can read no more than the body holds.
				e.setUpstream(perChoiceUpstream(int64(len(tt.body)/4), outTokens))
				o := e.served(EndpointResponses, e.key, tt.body)
				images := int64(strings.Count(tt.body, "input_image")) * endpoint.Responses.Images.High
				if want := int64(len(tt.body)) + images + 2*outTokens; o.HoldAmount != want {
					t.Fatalf("hold %d, want the bound %d", o.HoldAmount, want)
				}
				return
			}
			e.setUpstream(perChoiceUpstream(inTokens, outTokens))
			o := e.served(EndpointResponses, e.key, tt.body)
			if o.HoldAmount != learned {
				t.Fatalf("hold %d, want the learned max %d", o.HoldAmount, learned)
			}
			// An org that could pay the body's bound but not the learned max is refused.
			org, key := e.poorKey(1000)
			resp := e.post(context.Background(), EndpointResponses, key, tt.body)
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("poor org: status %d: %s", resp.StatusCode, body)
			}
			e.outcome()
			e.assertUntouched(org, 1000)
		})
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	// The bound only ends a test that would hang; a loaded machine takes what it takes.
	for deadline := time.Now().Add(hangLimit); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}
