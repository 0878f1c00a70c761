package middleware

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// worstUpstream bills every request the most it may: one input token per byte of what it reads as
// input (the messages, prompt, input, system and instructions values, as sent), and every
// output token its cap allows — the cap read as the upstream reads it (chat:
// max_completion_tokens, else max_tokens; Responses: max_output_tokens; legacy completions and
// Messages: max_tokens; none: maxOut, the model's max) — for every choice and every prompt of a
// prompt array. A hold that is the request's bound covers exactly this; a hold below it
// cannot. It remembers the caps it read.
type worstUpstream struct {
	maxOut int64
	mu     sync.Mutex
	caps   []int64
}

func (u *worstUpstream) read(path string, body []byte) (in, out int64) {
	field := "max_tokens"
	switch path {
	case EndpointChat:
		if gjson.GetBytes(body, "max_completion_tokens").Exists() {
			field = "max_completion_tokens"
		}
	case EndpointResponses:
		field = "max_output_tokens"
	}
	c := u.maxOut
	if v := gjson.GetBytes(body, field); v.Exists() && v.Type == gjson.Number {
		c = v.Int()
	}
	u.mu.Lock()
	u.caps = append(u.caps, c)
	u.mu.Unlock()
	n := max(gjson.GetBytes(body, "n").Int(), gjson.GetBytes(body, "best_of").Int(), 1)
	prompts := int64(1)
	if p := gjson.GetBytes(body, "prompt"); path == EndpointCompletions && p.IsArray() {
		if a := p.Array(); len(a) > 0 && (a[0].IsArray() || a[0].Type == gjson.String) {
			prompts = int64(len(a))
		}
	}
	for _, f := range []string{"messages", "prompt", "input", "system", "instructions"} {
		in += int64(len(gjson.GetBytes(body, f).Raw))
	}
	return in, c * n * prompts
}

func (u *worstUpstream) lastCap() int64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.caps) == 0 {
		return -1
	}
	return u.caps[len(u.caps)-1]
}

func (u *worstUpstream) serve(w http.ResponseWriter, r *http.Request, body []byte) {
	in, out := u.read(r.URL.Path, body)
	stream := gjson.GetBytes(body, "stream").Bool()
	switch {
	case r.URL.Path == EndpointMessages && stream:
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-test\",\"usage\":{\"input_tokens\":"+itoa(in)+",\"output_tokens\":1}}}\n\n"+
			"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"+
			"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"+
			"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"+
			"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":"+itoa(out)+"}}\n\n"+
			"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
	case r.URL.Path == EndpointMessages:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"msg_1","type":"message","role":"assistant","model":"claude-test","content":[{"type":"text","text":"Hi"}],"stop_reason":"max_tokens","usage":{"input_tokens":`+itoa(in)+`,"output_tokens":`+itoa(out)+`}}`)
	case stream:
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}`+"\n\n")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`+"\n\n")
		_, _ = io.WriteString(w, `data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":`+itoa(in)+`,"completion_tokens":`+itoa(out)+`,"total_tokens":`+itoa(in+out)+"}}\n\ndata: [DONE]\n\n")
	default:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":`+
			itoa(in)+`,"completion_tokens":`+itoa(out)+`,"total_tokens":`+itoa(in+out)+`}}`)
	}
}

// fitEnv is the harness with the worst upstream and finishing recorder (a request that ended
// holds nothing, as in the proxy).
func fitEnv(t *testing.T, mini bool, cfg func(*Config)) (*testEnv, *worstUpstream) {
	t.Helper()
	e := newEnv(t, envOpt{mini: mini, finish: true, cfg: cfg})
	u := &worstUpstream{maxOut: 1000} // testModel's max output tokens
	e.setUpstream(u.serve)
	return e, u
}

// postH posts body with extra headers and returns the status, headers and body.
func (e *testEnv) postH(path, key, body string, hdr map[string]string) (int, http.Header, string) {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	must(e.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	must(e.t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header, string(b)
}

// accountOf accounts every pending event in the memory ledger and returns org's account.
func (e *testEnv) accountOf(org string) ledger.Account {
	e.t.Helper()
	if _, err := e.ledger.AccountPending(context.Background(), 1_000_000); err != nil {
		e.t.Fatal(err)
	}
	a, err := e.ledger.Account(context.Background(), org)
	must(e.t, err)
	return a
}

// TestFitServesWhatFits (issue 23, item 3): a small balance that cannot cover a request's bound
// (its max output at the output price) is not refused: the output cap is lowered to the
// largest C that fits, written into the body the upstream reads, held exactly, and told in
// x-escrow-output-cap. The upstream bills every token C allows and the balance never goes
// below 0. Before: a 429 insufficient_quota for a request that could be paid many times over.
func TestFitServesWhatFits(t *testing.T) {
	t.Parallel()
	// testModel: 1 per input byte-token, 2 per output token, max output 1000.
	cases := []struct {
		name, path, extra string
		field             string // the cap field the upstream must read
		stream            bool
	}{
		{"chat, no cap", EndpointChat, ``, "max_completion_tokens", false},
		{"chat, max_tokens above what fits", EndpointChat, `"max_tokens":900`, "max_tokens", false},
		{"chat, both caps", EndpointChat, `"max_tokens":900,"max_completion_tokens":800`, "max_completion_tokens", false},
		{"chat stream, no cap", EndpointChat, `"stream":true`, "max_completion_tokens", true},
		// Without a cap a legacy completion is held at the upstream's default of 16, which fits
		// (issue 32, TestCompletionsDefaultCap); with a large one it is fitted.
		{"legacy completions", EndpointCompletions, `"max_tokens":900`, "max_tokens", false},
		{"responses", EndpointResponses, ``, "max_output_tokens", false},
	}
	eachRedis(t, func(t *testing.T, mini bool) {
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				e, up := fitEnv(t, mini, nil)
				body := jsonBody(testModel, tc.extra)
				switch tc.path {
				case EndpointCompletions:
					body = strings.TrimSuffix(`{"model":"gpt-test","prompt":"Say hello",`+tc.extra, ",") + `}`
				case EndpointResponses:
					body = `{"model":"gpt-test","input":"Say hello"}`
				}
				const credit = 1500 // the bound with 1000 output tokens is ≈ 2,050
				org, key := e.poorKey(credit)
				st, h, b := e.postH(tc.path, key, body, nil)
				if st != 200 {
					t.Fatalf("status %d: %s", st, b)
				}
				o := e.outcome()
				c, err := strconv.ParseInt(h.Get(HeaderOutputCap), 10, 64)
				// The largest C with len(body) + 2C ≤ credit (the added field's bytes are not input).
				if want := int64(credit-len(body)) / 2; err != nil || c != want {
					t.Fatalf("x-escrow-output-cap %q, want %d", h.Get(HeaderOutputCap), want)
				}
				if up.lastCap() != c || o.FitCap != c {
					t.Fatalf("the upstream read a cap of %d (outcome %d), want %d", up.lastCap(), o.FitCap, c)
				}
				sent := e.upstreamRequests()
				if got := gjson.GetBytes(sent[len(sent)-1].Body, tc.field); got.Int() != c {
					t.Fatalf("upstream body %s: %s = %v, want %d", sent[len(sent)-1].Body, tc.field, got, c)
				}
				if o.HoldAmount != int64(len(body))+2*c || o.Cost > o.HoldAmount || o.Usage.Completion != c {
					t.Fatalf("hold %d cost %d (%d output tokens), want the fitted bound %d, billed at most, and %d output tokens",
						o.HoldAmount, o.Cost, o.Usage.Completion, int64(len(body))+2*c, c)
				}
				if a := e.accountOf(org); a.Balance != credit-o.Cost || a.Balance < 0 {
					t.Fatalf("ledger %+v after a cost of %d", a, o.Cost)
				}
			})
		}
	})
}

// TestFitOffRefusesWithNumbers: "x-escrow-fit: off" (or Config.NoFit) asks for the refusal: a
// 429 insufficient_quota that says what was needed, what is available and the largest
// max_tokens that would fit; nothing is held or sent. A balance below the smallest fitted
// bound (256 output tokens) is refused the same way, fit on.
func TestFitOffRefusesWithNumbers(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		for _, tc := range []struct {
			name   string
			noFit  bool
			hdr    map[string]string
			credit int64
		}{
			{"header", false, map[string]string{HeaderFit: "off"}, 1500},
			{"config", true, nil, 1500},
			{"below the smallest fit", false, nil, 400},
		} {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				e, _ := fitEnv(t, mini, func(c *Config) { c.NoFit = tc.noFit })
				body := jsonBody(testModel, "")
				org, key := e.poorKey(tc.credit)
				st, h, b := e.postH(EndpointChat, key, body, tc.hdr)
				if st != http.StatusTooManyRequests || h.Get("x-should-retry") != "false" || h.Get(HeaderOutputCap) != "" {
					t.Fatalf("status %d headers %v: %s", st, h, b)
				}
				typ, code, _ := openAIError(t, []byte(b))
				msg := gjson.Get(b, "error.message").String()
				needed := int64(len(body)) + 2*1000
				if tc.name == "below the smallest fit" {
					needed = int64(len(body)) + 2*256
				}
				fits := (tc.credit - int64(len(body))) / 2
				if typ != TypeInsufficientQuota || code != CodeInsufficientQuota ||
					!strings.Contains(msg, "needs at least "+itoa(needed)+", "+itoa(tc.credit)+" is available") ||
					!strings.Contains(msg, "at most "+itoa(fits)+" would fit") {
					t.Fatalf("refusal %s %s %q", typ, code, msg)
				}
				e.outcome()
				e.assertUntouched(org, tc.credit)
				if n := len(e.upstreamRequests()); n != 0 {
					t.Fatalf("%d upstream calls", n)
				}
			})
		}
	})
}

// TestFitAnthropic: Messages requests are fitted too (max_tokens lowered), streaming or not;
// refused, they get Anthropic's 402 billing_error shape with the numbers.
func TestFitAnthropic(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		for _, stream := range []bool{false, true} {
			t.Run("stream="+strconv.FormatBool(stream), func(t *testing.T) {
				t.Parallel()
				e, up := fitEnv(t, mini, nil)
				must(t, e.ledger.PutModel(context.Background(), ledger.Model{Name: "claude-test",
					Prices:         pricing.Prices{pricing.Input: 1_000_000, pricing.CachedInput: 1_000_000, pricing.CacheWrite: 1_000_000, pricing.CacheWrite1h: 1_000_000, pricing.Output: 2_000_000},
					MaxInputTokens: 100_000, MaxOutputTokens: 1000}))
				body := `{"model":"claude-test","max_tokens":1000,"messages":[{"role":"user","content":"Say hello"}]` +
					map[bool]string{true: `,"stream":true`}[stream] + `}`
				org, key := e.poorKey(1500)
				st, h, b := e.postH(EndpointMessages, key, body, nil)
				if st != 200 {
					t.Fatalf("status %d: %s", st, b)
				}
				o := e.outcome()
				// The largest cap that fits: one more output token (2) would not.
				c, _ := strconv.ParseInt(h.Get(HeaderOutputCap), 10, 64)
				if c <= 0 || up.lastCap() != c || o.HoldAmount > 1500 || o.HoldAmount+2 <= 1500 || o.Cost > o.HoldAmount || o.Usage.Completion != c {
					t.Fatalf("cap %q (upstream %d) hold %d cost %d usage %+v: want the largest cap that fits 1500", h.Get(HeaderOutputCap), up.lastCap(), o.HoldAmount, o.Cost, o.Usage)
				}
				if a := e.accountOf(org); a.Balance != 1500-o.Cost {
					t.Fatalf("ledger %+v", a)
				}
				// What is left (≈ 0) fits no 256 tokens: Anthropic's billing error, with the numbers.
				st, _, b = e.postH(EndpointMessages, key, body, nil)
				e.outcome()
				if st != http.StatusPaymentRequired || gjson.Get(b, "error.type").String() != AnthropicBilling ||
					!strings.Contains(gjson.Get(b, "error.message").String(), "needs at least") {
					t.Fatalf("refusal %d %s", st, b)
				}
			})
		}
	})
}

// TestPromptArrayHeldInFull (issue 23, item 1): a legacy completion with a prompt array is
// completed once per prompt, so its hold is the bound × prompts. Before: held as one prompt
// (7,801 for a cost of 201,500 each in the audit), a burst drove the org far below 0.
func TestPromptArrayHeldInFull(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e, _ := fitEnv(t, mini, nil)
		prompts := strings.TrimSuffix(strings.Repeat("[1],", 200), ",")
		body := `{"model":"gpt-test","prompt":[` + prompts + `],"max_tokens":10}`
		o := e.served(EndpointCompletions, e.key, body)
		if want := int64(len(body)) + 2*10*200; o.HoldAmount != want || o.Cost > want || o.Usage.Completion != 10*200 {
			t.Fatalf("hold %d cost %d usage %+v, want the hold %d (200 prompts × 10 tokens × 2 + the body's bytes) and 2,000 output tokens",
				o.HoldAmount, o.Cost, o.Usage, want)
		}
		// A burst on a small balance: every request served is paid, the ledger never below 0.
		const credit = 20_000
		org, key := e.poorKey(credit)
		var wg sync.WaitGroup
		var served atomic.Int64
		for range 20 {
			wg.Go(func() {
				st, _, _ := e.postH(EndpointCompletions, key, body, map[string]string{HeaderFit: "off"})
				if st == 200 {
					served.Add(1)
				}
			})
		}
		wg.Wait()
		for range 20 {
			e.outcome()
		}
		a := e.accountOf(org)
		if a.Balance < 0 || a.Balance != credit-served.Load()*o.Cost || served.Load() == 0 || served.Load() > credit/o.HoldAmount {
			t.Fatalf("ledger %+v after %d served of cost %d (hold %d)", a, served.Load(), o.Cost, o.HoldAmount)
		}
	})
}

// TestBoundBeatsALowLearnedMax (issue 23, item 1): a request that states its cap holds its
// bound even when the learned max is far lower (a model repriced, then one cheap request).
// Before: held at the learned max (13) while costing 163,843.
func TestBoundBeatsALowLearnedMax(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e, _ := fitEnv(t, mini, nil)
		if _, err := e.store.RaiseModelMax(context.Background(), testModel, 13, 0, 1<<40); err != nil {
			t.Fatal(err)
		}
		body := jsonBody(testModel, `"max_tokens":1000`)
		o := e.served(EndpointChat, e.key, body)
		if want := int64(len(body)) + 2*1000; o.HoldAmount != want || o.Cost > want || o.Usage.Completion != 1000 {
			t.Fatalf("hold %d cost %d usage %+v, want the hold %d, the cost within it", o.HoldAmount, o.Cost, o.Usage, want)
		}
	})
}

// TestBalanceHeld (issue 23, item 4): a refusal while the org's own requests in flight hold
// what is missing is 429 rate_limit_exceeded balance_held with Retry-After (retryable, no
// x-should-retry: false); once they finish, the same request is served.
func TestBalanceHeld(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e, up := fitEnv(t, mini, nil)
		release := make(chan struct{})
		e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
			if strings.Contains(string(body), "slow") {
				<-release
				fakeOpenAI(w, r, body) // costs 21 of its hold
				return
			}
			up.serve(w, r, body)
		})
		slow := jsonBody(testModel, `"max_tokens":300,"user":"slow"`) // holds its bound, bytes + 600
		quick := jsonBody(testModel, `"max_tokens":100`)              // needs bytes + 200 (its cap is below the fit minimum)
		credit := int64(len(slow)+600) + int64(len(quick)+200) - 50   // both cannot be held together
		org, key := e.poorKey(credit)
		done := make(chan int)
		go func() { st, _, _ := e.postH(EndpointChat, key, slow, nil); done <- st }()
		waitFor(t, func() bool { st, _ := e.store.State(context.Background(), org); return st.Holds == 1 }, "the slow request's hold")
		st, h, b := e.postH(EndpointChat, key, quick, nil)
		if st != http.StatusTooManyRequests || h.Get("Retry-After") == "" || h.Get("x-should-retry") == "false" {
			t.Fatalf("while held: %d %v %s", st, h, b)
		}
		if typ, code, _ := openAIError(t, []byte(b)); typ != TypeRateLimit || code != CodeBalanceHeld {
			t.Fatalf("while held: %s %s", typ, code)
		}
		e.outcome()
		close(release)
		if st := <-done; st != 200 {
			t.Fatalf("slow request: %d", st)
		}
		slowCost := e.outcome().Cost
		// The held money is back (the slow request cost 21): the retry is served.
		st, _, b = e.postH(EndpointChat, key, quick, nil)
		if st != 200 {
			t.Fatalf("the retry: %d %s", st, b)
		}
		o := e.outcome()
		if a := e.accountOf(org); a.Balance != credit-slowCost-o.Cost {
			t.Fatalf("ledger %+v", a)
		}
	})
}

// TestFitBurst (issue 23): 2,000 concurrent uncapped requests (500 on miniredis, which runs
// scripts one at a time) on a balance for a few dozen: each is served whole, served fitted, or
// refused (balance_held while others hold the money, insufficient_quota once it is gone);
// the upstream bills every token each cap allows, and the ledger ends ≥ 0 and equal to the
// credit less exactly what the upstream served.
//
// Not parallel with the package's other tests (its own reserve timeout, as TestLimitBurst).
func TestFitBurst(t *testing.T) {
	eachRedis(t, func(t *testing.T, mini bool) {
		total := 2000
		if mini {
			total = 500
		}
		var served, refused, other, fitted, costs, charged atomic.Int64
		var firstOther atomic.Value
		e, up := fitEnv(t, mini, func(c *Config) {
			c.ReserveTimeout = time.Minute
			c.OnOutcome = func(o Outcome) {
				// A record that timed out on a loaded machine after the content was served is
				// recorded again (served ⇒ billed): its cost is charged all the same.
				if o.Kind == OutcomeRecorded || o.Kind == OutcomeRecordLater {
					costs.Add(o.Cost)
					charged.Add(1)
				}
			}
		})
		var upCost atomic.Int64
		e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
			in, out := up.read(r.URL.Path, body)
			upCost.Add(in + 2*out) // testPrices: 1 per input token, 2 per output token
			up.serve(w, r, body)
		})
		const credit = 60_000 // ≈ 29 whole requests (≈ 2,050 each)
		org, key := e.poorKey(credit)
		body := jsonBody(testModel, "")
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: total}}
		defer client.CloseIdleConnections()
		var wg sync.WaitGroup
		for range total {
			wg.Go(func() {
				req, _ := http.NewRequest(http.MethodPost, e.srv.URL+EndpointChat, strings.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+key)
				resp, err := client.Do(req)
				if err != nil {
					other.Add(1)
					firstOther.CompareAndSwap(nil, err.Error())
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				code := gjson.GetBytes(b, "error.code").String()
				switch {
				case resp.StatusCode == 200:
					served.Add(1)
					if resp.Header.Get(HeaderOutputCap) != "" {
						fitted.Add(1)
					}
				case resp.StatusCode == 429 && (code == CodeBalanceHeld || code == CodeInsufficientQuota):
					refused.Add(1)
				default:
					other.Add(1)
					firstOther.CompareAndSwap(nil, strconv.Itoa(resp.StatusCode)+" "+string(b))
				}
			})
		}
		wg.Wait()
		// A request's outcome is reported after its response ended: wait for every served one.
		waitFor(t, func() bool { return charged.Load() >= served.Load() }, "the served requests' outcomes")
		a := e.accountOf(org)
		t.Logf("%d served (%d fitted), %d refused, %d other; upstream billed %d; ledger %+v", served.Load(), fitted.Load(), refused.Load(), other.Load(), upCost.Load(), a)
		if other.Load() != 0 || served.Load()+refused.Load() != int64(total) || served.Load() == 0 {
			t.Fatalf("%d other (first: %v)", other.Load(), firstOther.Load())
		}
		if a.Balance < 0 || a.Balance != credit-upCost.Load() || costs.Load() != upCost.Load() {
			t.Fatalf("ledger %+v, outcomes charged %d: want ≥ 0 and the credit %d less the %d the upstream billed",
				a, costs.Load(), credit, upCost.Load())
		}
	})
}
