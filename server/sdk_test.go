package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/pricing"
)

// needNodeSDK returns the path of node with the sdktest packages installed. Without them the
// test fails when ESCROW_REQUIRE_SERVICES is set (CI installs them with scripts/sdktest.sh) and
// is skipped otherwise — never counted as passed.
func needNodeSDK(t *testing.T, pkg string) string {
	t.Helper()
	missing := func(what string) {
		msg := what + " (install with: bash scripts/sdktest.sh)"
		if testutil.RequireServices() {
			t.Fatalf("ESCROW_REQUIRE_SERVICES=1 and %s", msg)
		}
		t.Skip(msg)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		missing("node is not on PATH")
	}
	if _, err := os.Stat(filepath.Join("..", "sdktest", "node_modules", filepath.FromSlash(pkg), "package.json")); err != nil {
		missing("the npm package " + pkg + " is not installed in sdktest/")
	}
	return node
}

// runSDKScript runs sdktest/<script> with node against the proxy at base (env ESCROW_BASE_URL,
// ESCROW_KEY, ESCROW_POOR_KEY, ESCROW_MODEL, and extra NAME=value pairs) and returns the last
// line it printed; a failing script fails the test with its standard error.
func runSDKScript(ctx context.Context, t *testing.T, node, script, base, key, poor, model string, extra ...string) []byte {
	t.Helper()
	env := append([]string{"ESCROW_BASE_URL=" + base, "ESCROW_KEY=" + key, "ESCROW_POOR_KEY=" + poor, "ESCROW_MODEL=" + model}, extra...)
	return runSDK(ctx, t, node, script, env, nil)
}

// runSDK runs sdktest/<script> with node and env added to the test's environment and returns
// the last line it printed. A line {"event":…} is the script waiting for a line on its standard
// input (before an SDK retry: "retry"; before it starts: "ready"): runSDK calls onEvent and then
// lets it go on (a script run without onEvent gets no standard input). A failing script fails
// the test with its standard error.
func runSDK(ctx context.Context, t *testing.T, node, script string, env []string, onEvent func()) []byte {
	t.Helper()
	cmd := exec.CommandContext(ctx, node, filepath.Join("..", "sdktest", script))
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	var stdin io.WriteCloser
	var err error
	if onEvent != nil {
		if stdin, err = cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var last []byte
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		var ev struct {
			Event string `json:"event"`
		}
		if onEvent != nil && json.Unmarshal(sc.Bytes(), &ev) == nil && ev.Event != "" {
			onEvent()
			if _, err := io.WriteString(stdin, "go\n"); err != nil {
				t.Fatalf("node %s: letting the %s go: %v\n%s", script, ev.Event, err, stderr.String())
			}
			continue
		}
		last = append(last[:0], sc.Bytes()...)
	}
	scanErr := sc.Err()
	if err := cmd.Wait(); err != nil || scanErr != nil {
		t.Fatalf("node %s: %v %v\n%s", script, err, scanErr, stderr.String())
	}
	return last
}

// sdkGate is a fake upstream that holds back every request whose body contains gateMarker
// until the test releases it: a request in flight for exactly as long as the test needs.
type sdkGate struct {
	fake    *fakeupstream.Server
	arrived chan struct{}
	release chan struct{}
	once    sync.Once
}

const gateMarker = "[gate]"

func newSDKGate(apiKey string) *sdkGate {
	g := &sdkGate{arrived: make(chan struct{}, 1), release: make(chan struct{})}
	g.fake = fakeupstream.New(fakeupstream.Options{APIKey: apiKey, OnRequest: func(r fakeupstream.Request) {
		if bytes.Contains(r.Body, []byte(gateMarker)) {
			select {
			case g.arrived <- struct{}{}:
			default:
			}
			<-g.release
		}
	}})
	return g
}

// open releases the gated requests (idempotent; also a cleanup, so that the proxy's Stop never
// waits on one).
func (g *sdkGate) open() { g.once.Do(func() { close(g.release) }) }

type gatedResult struct {
	status int
	body   []byte
	err    error
}

// send posts body to url with the headers (name, value pairs) in the background, and returns
// once the upstream holds it: its hold is taken and it stays in flight until open.
func (g *sdkGate) send(t *testing.T, url, body string, hdr ...string) <-chan gatedResult {
	t.Helper()
	done := make(chan gatedResult, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			done <- gatedResult{err: err}
			return
		}
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- gatedResult{err: err}
			return
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		done <- gatedResult{status: res.StatusCode, body: b, err: err}
	}()
	select {
	case <-g.arrived:
	case r := <-done:
		t.Fatalf("the request to hold the balance was answered before reaching the upstream: %d %s %v", r.status, r.body, r.err)
	case <-time.After(30 * time.Second):
		t.Fatal("the request to hold the balance never reached the upstream")
	}
	return done
}

// letRetry is the onEvent of runSDK for "held is not gone": the first time the SDK is about to
// retry, the org's balance must still be held by the gated request alone (the refused attempt
// took nothing: available == availWhileHeld); the gated request is then released, its answer
// (200, stored in *gated) and the end of its hold awaited, and only then may the SDK go on. So
// the first attempt meets the hold and the retry does not, whatever the timing.
func (g *sdkGate) letRetry(t *testing.T, p *testProxy, org string, availWhileHeld int64, inflight <-chan gatedResult, gated *gatedResult) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			if b := p.balance(org); b.Holds != 1 || b.Available != availWhileHeld {
				t.Fatalf("before the retry: %+v, want the gated request's hold alone (available %d)", b, availWhileHeld)
			}
			g.open()
			select {
			case *gated = <-inflight:
			case <-time.After(30 * time.Second):
				t.Fatal("the gated request never finished")
			}
			if gated.err != nil || gated.status != http.StatusOK {
				t.Fatalf("the gated request: %d %s %v", gated.status, gated.body, gated.err)
			}
			deadline := time.Now().Add(time.Minute)
			for p.balance(org).Holds != 0 {
				if time.Now().After(deadline) {
					t.Fatalf("the gated request's hold is still there: %+v", p.balance(org))
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}

// eachSDKMode is eachMode with a gated fake upstream (sdkGate) for every proxy.
func eachSDKMode(t *testing.T, fn func(t *testing.T, p *testProxy, g *sdkGate)) {
	run := func(name string, start func(t *testing.T, up Option) *testProxy) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			g := newSDKGate("")
			p := start(t, WithUpstream(g.fake, "sk-fake-upstream"))
			t.Cleanup(g.open) // before the proxy's Stop (cleanups run last-in first-out)
			fn(t, p, g)
		})
	}
	run("real", func(t *testing.T, up Option) *testProxy { return startTestProxyWith(t, true, []Option{up}) })
	run("embedded", func(t *testing.T, up Option) *testProxy { return startTestProxyWith(t, false, []Option{up}) })
	run("cluster", func(t *testing.T, up Option) *testProxy {
		return startClusterProxy(t, testutil.StartRedisCluster(t), up)
	})
}

// eachSDKAnthropicMode is eachAnthropicMode with a gated fake Anthropic upstream (sdkGate).
func eachSDKAnthropicMode(t *testing.T, fn func(t *testing.T, p anthProxy, g *sdkGate)) {
	for _, real := range []bool{true, false} {
		t.Run(map[bool]string{true: "real", false: "embedded"}[real], func(t *testing.T) {
			t.Parallel()
			g := newSDKGate(anthUpstreamKey)
			up := httptest.NewServer(g.fake)
			t.Cleanup(up.Close)
			p := startTestProxy(t, real, func(c *Config) { c.AnthropicURL, c.AnthropicAPIKey = up.URL, anthUpstreamKey })
			t.Cleanup(g.open) // before the proxy's Stop and the upstream's Close
			fn(t, anthProxy{p, g.fake}, g)
		})
	}
}

// sdkCharge is a charge entry of the ledger with the request behind it.
type sdkCharge struct {
	Delta   int64 `json:"delta"`
	Request struct {
		Model      string        `json:"model"`
		Usage      pricing.Usage `json:"usage"`
		Cost       int64         `json:"cost"`
		HoldAmount int64         `json:"hold_amount"`
	} `json:"request"`
}

// charges are the org's charge entries (call settled first: a usage event becomes an entry
// asynchronously).
func (p *testProxy) charges(org string) []sdkCharge {
	p.t.Helper()
	var out struct{ Data []sdkCharge }
	p.admin("GET", "/orgs/"+org+"/entries?kind=charge", nil, http.StatusOK, &out)
	return out.Data
}

// fitCapOf is the largest output cap c ≤ maxCap whose bound (docs/failure-policy.md "What a request holds":
// bodyBytes at the highest input price + c × output price, rounded up) is at most room, and that
// bound; 0, 0 when not even a cap of 1 fits.
func fitCapOf(t *testing.T, prices pricing.Prices, bodyBytes, maxCap, room int64) (c, bound int64) {
	t.Helper()
	boundAt := func(c int64) int64 {
		b, err := prices.Bound(bodyBytes, c)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for lo, hi := int64(1), maxCap; lo <= hi; {
		mid := lo + (hi-lo)/2
		if boundAt(mid) <= room {
			c, lo = mid, mid+1
		} else {
			hi = mid - 1
		}
	}
	if c == 0 {
		return 0, 0
	}
	return c, boundAt(c)
}

// sdkFitted is what a script reports of a fitted request.
type sdkFitted struct {
	Status       int             `json:"status"`
	OutputCap    string          `json:"outputCap"`
	BodyBytes    int64           `json:"bodyBytes"`
	Attempts     int             `json:"attempts"`
	Usage        json.RawMessage `json:"usage"`
	FinishReason string          `json:"finishReason"`
	StopReason   string          `json:"stopReason"`
	Words        int64           `json:"words"`
}

// sdkHeld is what a script reports of the request refused while the balance was held.
type sdkHeld struct {
	Status   int `json:"status"`
	Attempts int `json:"attempts"`
	First    struct {
		Status      int    `json:"status"`
		BodyBytes   int64  `json:"bodyBytes"`
		RetryAfter  string `json:"retryAfter"`
		ShouldRetry string `json:"shouldRetry"`
		Type        string `json:"type"`
		Code        string `json:"code"`
		Message     string `json:"message"`
	} `json:"first"`
	WaitedMs  *int64          `json:"waitedMs"`
	OutputCap *string         `json:"outputCap"`
	Usage     json.RawMessage `json:"usage"`
}

// sdkRefusal is what a script reports of a request the SDK got an error for (the fields of
// either SDK's error).
type sdkRefusal struct {
	Status            int    `json:"status"`
	Class             string `json:"class"`
	IsRateLimit       bool   `json:"isRateLimit"`       // openai
	IsAPIError        bool   `json:"isAPIError"`        // @anthropic-ai/sdk
	IsPaymentRequired bool   `json:"isPaymentRequired"` // @anthropic-ai/sdk
	Code              string `json:"code"`              // openai
	Type              string `json:"type"`
	Message           string `json:"message"`
	Attempts          int    `json:"attempts"`
	BodyBytes         int64  `json:"bodyBytes"`
}

// checkHeld checks what the SDK saw of "held is not gone": a first attempt refused as held
// (429, Retry-After a positive number of seconds, no x-should-retry: false), then one retry,
// served whole (no fitted cap). typ is the refusal's error type; code its OpenAI code ("" for
// Anthropic's shape, which has none).
func checkHeld(t *testing.T, h *sdkHeld, typ, code string) {
	t.Helper()
	if h == nil {
		t.Fatal("the script reported no held request")
	}
	ra, err := strconv.Atoi(h.First.RetryAfter)
	if f := h.First; f.Status != http.StatusTooManyRequests || err != nil || ra <= 0 || f.ShouldRetry == "false" ||
		f.Type != typ || f.Code != code || !strings.Contains(f.Message, "held by your requests in flight") {
		t.Fatalf("the first attempt: %+v, want 429 %s %s with Retry-After", f, typ, code)
	}
	if h.Status != http.StatusOK || h.Attempts != 2 || h.OutputCap != nil {
		t.Fatalf("the SDK's retry: %+v, want 200 after 2 HTTP attempts, not fitted", h)
	}
	if h.WaitedMs != nil {
		// The SDK pauses Retry-After before it retries (client.js retryRequest); logged, not
		// asserted (no wall-clock gaps in tests).
		t.Logf("the SDK retried %d ms after the first answer (Retry-After: %s)", *h.WaitedMs, h.First.RetryAfter)
	}
}

// TestAnthropicSDK drives the proxy with the official @anthropic-ai/sdk (sdktest/anthropic.mjs):
// a Messages request as JSON, as a stream and through the beta client (its betas reach the
// upstream), with prompt-cache writes and reads, are billed to the micro-unit what the SDK
// reported, and an insufficient balance surfaces as the SDK's PaymentRequiredError after one
// HTTP attempt (no retries, although the client allows 3) — also for a max_tokens that fit could
// lower, when not even the smallest fitted bound fits.
//
// Fit (issue 23): max_tokens 8192 on a balance of 50,000 is served, as JSON and as a stream, with
// the largest cap that fits, which the SDK reads in x-escrow-output-cap; the ledger holds exactly
// the fitted bound and charges what the upstream billed, within it. Sent with x-escrow-fit: off,
// the same request is refused (402, with the numbers) and not retried.
//
// Held is not gone (issue 23): while the org's balance is held by a request in flight (gated at
// the upstream), a small request is refused 429 rate_limit_error; the SDK retries it after
// Retry-After, and the retry — let go only once the request in flight has finished — is served.
func TestAnthropicSDK(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "@anthropic-ai/sdk")
	eachSDKAnthropicMode(t, func(t *testing.T, p anthProxy, g *sdkGate) {
		const funds, smallFunds = 10_000_000, 50_000
		key := p.setupClaude("sdk", funds)
		poor := p.setupClaude("sdk-poor", 5)
		small := p.priceOrg("sdk-small", smallFunds)
		smallStream := p.priceOrg("sdk-small-stream", smallFunds)

		// Held: the gated request's bound is mostly its input bytes (10,000 bytes of one word at
		// the 1-hour cache-write price), its cost a few hundred; the org has 100 more than it.
		gated := `{"model":"claude-t","max_tokens":10,"messages":[{"role":"user","content":"` + gateMarker + " " +
			strings.Repeat("x", 10_000) + `"}]}`
		gatedHold, err := claudePrices.Bound(int64(len(gated)), 10)
		if err != nil {
			t.Fatal(err)
		}
		heldFunds := gatedHold + 100
		held := p.priceOrg("sdk-held", heldFunds)
		inflight := g.send(t, p.base+"/v1/messages", gated, "x-api-key", held, "anthropic-version", "2023-06-01")
		var gatedRes gatedResult

		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		out := runSDK(ctx, t, node, "anthropic.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + key,
			"ESCROW_POOR_KEY=" + poor, "ESCROW_MODEL=claude-t", "ESCROW_SMALL_KEY=" + small,
			"ESCROW_SMALL_STREAM_KEY=" + smallStream, "ESCROW_HELD_KEY=" + held},
			g.letRetry(t, p.testProxy, "sdk-held", heldFunds-gatedHold, inflight, &gatedRes))
		var res struct {
			JSON, Stream, Beta struct {
				ID    string    `json:"id"`
				Usage anthUsage `json:"usage"`
				Text  string    `json:"text"`
			}
			Refused      *sdkRefusal `json:"refused"`
			RefusedLarge *sdkRefusal `json:"refusedLarge"`
			Fit          *sdkFits    `json:"fit"`
			FitOff       *sdkRefusal `json:"fitOff"`
			Held         *sdkHeld    `json:"held"`
		}
		if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
			t.Fatalf("node output %s: %v", out, err)
		}
		// 3 system words + 8 user words: 4 written, 3 read, 4 plain; 9 output words.
		want := anthUsage{Input: 4, CacheWrite: 4, CacheRead: 3, Output: 9}
		if res.JSON.Usage != want || res.Stream.Usage != want || res.Beta.Usage != want || res.JSON.Text == "" ||
			res.Stream.Text != res.JSON.Text || res.Beta.Text != res.JSON.Text {
			t.Fatalf("the SDK reported %+v", res)
		}
		// The beta client's call reached the upstream with its betas, and its beta=true when the
		// SDK sends one (older versions did; this one does not): the poor client's request never
		// reached it.
		var betaCalls []fakeupstream.Request // the fitted calls come after it
		for _, r := range p.fake.Seen() {
			if r.Header.Get("Anthropic-Beta") != "" {
				betaCalls = append(betaCalls, r)
			}
		}
		if len(betaCalls) != 1 || (betaCalls[0].Query != "" && betaCalls[0].Query != "beta=true") ||
			betaCalls[0].Header.Get("Anthropic-Beta") != "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14" {
			t.Fatalf("the beta call upstream: %d calls with betas: %+v", len(betaCalls), betaCalls)
		}
		var total int64
		for _, u := range []anthUsage{res.JSON.Usage, res.Stream.Usage, res.Beta.Usage} {
			total += claudeCost(t, u)
		}
		if b := p.settled("sdk"); b.LedgerBalance != funds-total || b.Available != funds-total {
			t.Fatalf("ledger %+v, want %d (the usage the SDK reported, %d)", b, funds-total, total)
		}
		for _, r := range []*sdkRefusal{res.Refused, res.RefusedLarge} {
			if r == nil || r.Status != 402 || r.Class != "PaymentRequiredError" || !r.IsPaymentRequired || !r.IsAPIError ||
				r.Type != "billing_error" || r.Attempts != 1 || !strings.Contains(r.Message, ", 5 is available") {
				t.Fatalf("insufficient balance as the SDK saw it: %+v", r)
			}
		}
		if b := p.settled("sdk-poor"); b.LedgerBalance != 5 || b.Held != 0 {
			t.Fatalf("poor org: %+v", b)
		}
		if !strings.HasPrefix(res.JSON.ID, "msg") {
			t.Fatalf("message id %q", res.JSON.ID)
		}

		checkAnthropicFit(t, p.testProxy, g.fake, res.Fit, res.FitOff, smallFunds)

		// Held is not gone.
		checkHeld(t, res.Held, "rate_limit_error", "")
		var gatedMsg struct{ Usage anthUsage }
		if err := json.Unmarshal(gatedRes.body, &gatedMsg); err != nil {
			t.Fatal(err)
		}
		var hu anthUsage
		_ = json.Unmarshal(res.Held.Usage, &hu)
		heldHold, err := claudePrices.Bound(res.Held.First.BodyBytes, 9)
		if err != nil {
			t.Fatal(err)
		}
		if heldHold <= heldFunds-gatedHold || heldHold > heldFunds {
			t.Fatalf("the held request's bound %d: want it above the %d left while the gated request holds %d, within the org's %d",
				heldHold, heldFunds-gatedHold, gatedHold, heldFunds)
		}
		gatedCost, heldCost := claudeCost(t, gatedMsg.Usage), claudeCost(t, hu)
		b := p.settled("sdk-held") // every charge is in the ledger
		ch := p.charges("sdk-held")
		holds := []int64{}
		for _, c := range ch {
			holds = append(holds, c.Request.HoldAmount)
		}
		slices.Sort(holds)
		if len(ch) != 2 || !slices.Equal(holds, []int64{heldHold, gatedHold}) || b.LedgerBalance != heldFunds-gatedCost-heldCost {
			t.Fatalf("held org: charges %+v, balance %+v; want holds %d and %d, balance %d", ch, b, heldHold, gatedHold, heldFunds-gatedCost-heldCost)
		}
	})
}

// sdkFits is what a script reports of its fitted requests.
type sdkFits struct {
	JSON   sdkFitted `json:"json"`
	Stream sdkFitted `json:"stream"`
}

// checkAnthropicFit checks what anthropic.mjs reports of its fitted requests (max_tokens 8192
// with the keys of orgs sdk-small and sdk-small-stream, funds each, claude-t at claudePrices):
// asked for the refusal (x-escrow-fit: off), the SDK got 402 billing_error with the numbers and
// did not retry; fitted, the cap the SDK read is the largest whose bound fits funds, the upstream
// (fake) got it, and the ledger held that bound and charged the usage the SDK reported, within it.
func checkAnthropicFit(t *testing.T, p *testProxy, fake *fakeupstream.Server, fit *sdkFits, off *sdkRefusal, funds int64) {
	t.Helper()
	if fit == nil || off == nil {
		t.Fatal("the script reported no fit")
	}
	bound, err := claudePrices.Bound(off.BodyBytes, 8192)
	if err != nil {
		t.Fatal(err)
	}
	fits, _ := fitCapOf(t, claudePrices, off.BodyBytes, 8192, funds)
	if off.Status != 402 || !off.IsPaymentRequired || off.Type != "billing_error" || off.Attempts != 1 ||
		!strings.Contains(off.Message, "needs at least "+strconv.FormatInt(bound, 10)+", "+strconv.FormatInt(funds, 10)+" is available") ||
		!strings.Contains(off.Message, "at most "+strconv.FormatInt(fits, 10)+" would fit") {
		t.Fatalf("x-escrow-fit: off as the SDK saw it: %+v, want 402 billing_error needing %d, %d fitting", off, bound, fits)
	}
	for _, c := range []struct {
		org  string
		f    sdkFitted
		name string
	}{{"sdk-small", fit.JSON, "JSON"}, {"sdk-small-stream", fit.Stream, "stream"}} {
		wantCap, wantHold := fitCapOf(t, claudePrices, c.f.BodyBytes, 8192, funds)
		var u anthUsage
		_ = json.Unmarshal(c.f.Usage, &u)
		if c.f.Status != 200 || c.f.Attempts != 1 || c.f.OutputCap != strconv.FormatInt(wantCap, 10) || wantCap < 256 || wantCap >= 8192 ||
			u.Output != wantCap || c.f.Words != wantCap || c.f.StopReason != "max_tokens" {
			t.Fatalf("fitted %s: %+v (usage %+v), want the output cap %d", c.name, c.f, u, wantCap)
		}
		cost := claudeCost(t, u)
		b := p.settled(c.org) // every charge is in the ledger
		ch := p.charges(c.org)
		if len(ch) != 1 || ch[0].Request.HoldAmount != wantHold || ch[0].Request.Cost != cost || cost > wantHold ||
			b.LedgerBalance != funds-cost || b.LedgerBalance < 0 {
			t.Fatalf("fitted %s: charges %+v, balance %+v; want the hold %d, the cost %d", c.name, ch, b, wantHold, cost)
		}
		t.Logf("fitted %s: %d body bytes, max_tokens 8192 → %d, held %d of %d, cost %d", c.name, c.f.BodyBytes, wantCap, wantHold, funds, cost)
	}
	var caps []int64
	for _, r := range fake.Seen() {
		var body struct {
			MaxTokens int64 `json:"max_tokens"`
		}
		if json.Unmarshal(r.Body, &body) == nil && strings.Contains(string(r.Body), "fit me in") {
			caps = append(caps, body.MaxTokens)
		}
	}
	if want := []int64{parseCap(fit.JSON.OutputCap), parseCap(fit.Stream.OutputCap)}; !slices.Equal(caps, want) {
		t.Fatalf("the upstream got max_tokens %v, want %v", caps, want)
	}
}

// claudeCost is the cost of an Anthropic usage at claudePrices.
func claudeCost(t *testing.T, u anthUsage) int64 {
	t.Helper()
	c, err := claudePrices.Cost(u.usage())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// parseCap is a decimal header value, -1 when it is not one.
func parseCap(s string) int64 {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return -1
	}
	return n
}

// bigPrices is README's "What a request holds" model: 2 per input and 8 per output token
// (micro-units), 32,768 output tokens.
var bigPrices = pricing.Prices{pricing.Input: 2_000_000, pricing.Output: 8_000_000}

// TestOpenAINodeSDK drives the proxy with the official openai npm package (sdktest/openai.mjs):
// a chat completion as JSON and as a stream are billed to the micro-unit what the SDK reported,
// the model list holds the priced model, and an insufficient balance surfaces as the SDK's
// RateLimitError with code insufficient_quota after one HTTP attempt (no retries, although the
// client allows 3: x-should-retry: false) — also for an uncapped request that fit could lower,
// when not even the smallest fitted bound fits.
//
// Fit (issue 23): README's example — "hi" without max_tokens to a model at 2 / 8 per token with
// 32,768 output tokens, on a balance of 0.20 — is served, as JSON and as a stream, with the
// largest cap that fits, which the SDK reads in x-escrow-output-cap; the upstream gets it as
// max_completion_tokens and bills every token of it; the ledger holds exactly the fitted bound.
// Sent with x-escrow-fit: off, the same request is refused (insufficient_quota, with the
// numbers) and not retried.
//
// Held is not gone (issue 23): while the org's balance is held by a request in flight (gated at
// the upstream), a small request is refused 429 rate_limit_exceeded balance_held; the SDK
// retries it after Retry-After, and the retry — let go only once the request in flight has
// finished — is served.
func TestOpenAINodeSDK(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	eachSDKMode(t, func(t *testing.T, p *testProxy, g *sdkGate) {
		const funds, smallFunds = 1_000_000, 200_000
		key := p.setup("sdk", funds, 65)   // 1 µ per output token, input free
		poor := p.setup("sdk-poor", 5, 65) // a hold of 12 does not fit in 5
		p.admin("PUT", "/models/big", map[string]any{"input_price": bigPrices[pricing.Input], "output_price": bigPrices[pricing.Output],
			"max_input_tokens": 128_000, "max_output_tokens": 32_768}, http.StatusOK, nil)
		small := p.priceOrg("sdk-small", smallFunds)
		smallStream := p.priceOrg("sdk-small-stream", smallFunds)

		// Held: an uncapped request to m holds its bound, 65 (m's max output at 1 each), of the
		// org's 70, and costs 20 (the fake's 20 output tokens); the SDK's request (max_tokens 12)
		// needs 12: refused while 5 are left, served once the 65 are back.
		const heldFunds, gatedHold, gatedCost = 70, 65, 20
		held := p.setup("sdk-held", heldFunds, 65)
		inflight := g.send(t, p.base+"/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"hold the balance `+gateMarker+`"}]}`, "Authorization", "Bearer "+held)
		var gatedRes gatedResult

		ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
		defer cancel()
		out := runSDK(ctx, t, node, "openai.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + key,
			"ESCROW_POOR_KEY=" + poor, "ESCROW_MODEL=m", "ESCROW_FIT_MODEL=big", "ESCROW_SMALL_KEY=" + small,
			"ESCROW_SMALL_STREAM_KEY=" + smallStream, "ESCROW_HELD_KEY=" + held},
			g.letRetry(t, p, "sdk-held", heldFunds-gatedHold, inflight, &gatedRes))
		type usage struct {
			Prompt     int64 `json:"prompt_tokens"`
			Completion int64 `json:"completion_tokens"`
		}
		var res struct {
			JSON struct {
				ID    string `json:"id"`
				Usage usage  `json:"usage"`
				Text  string `json:"text"`
			} `json:"json"`
			Stream struct {
				Usage *usage `json:"usage"`
				Text  string `json:"text"`
			} `json:"stream"`
			Models          []string    `json:"models"`
			Refused         *sdkRefusal `json:"refused"`
			RefusedUncapped *sdkRefusal `json:"refusedUncapped"`
			Fit             *sdkFits    `json:"fit"`
			FitOff          *sdkRefusal `json:"fitOff"`
			Held            *sdkHeld    `json:"held"`
		}
		if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
			t.Fatalf("node output %s: %v", out, err)
		}
		if res.JSON.Usage.Completion <= 0 || res.Stream.Usage == nil || res.Stream.Usage.Completion <= 0 || res.Stream.Text == "" {
			t.Fatalf("SDK results: %s", out)
		}
		if !slices.Contains(res.Models, "m") {
			t.Errorf("models listed: %v, want m", res.Models)
		}
		for _, r := range []*sdkRefusal{res.Refused, res.RefusedUncapped} {
			if r == nil || r.Status != 429 || !r.IsRateLimit || r.Code != "insufficient_quota" || r.Attempts != 1 ||
				!strings.Contains(r.Message, ", 5 is available") {
				t.Errorf("insufficient balance through the SDK: %+v, want 429 RateLimitError insufficient_quota after 1 attempt", r)
			}
		}
		// The model costs 1 µ per output token: the ledger is charged exactly what the SDK reported.
		b := p.settled("sdk")
		if want := int64(funds) - res.JSON.Usage.Completion - res.Stream.Usage.Completion; b.LedgerBalance != want || b.Available != want {
			t.Errorf("balance after the SDK's two requests: %+v, want %d", b, want)
		}
		if pb := p.settled("sdk-poor"); pb.LedgerBalance != 5 || pb.Available != 5 {
			t.Errorf("the refused org was charged: %+v", pb)
		}

		// Fit: C = ⌊(200,000 − 2 × body bytes) / 8⌋ (README: 24,985 for a 59-byte body).
		if res.Fit == nil {
			t.Fatal("the script reported no fit")
		}
		noCacheWrites := bigPrices.Restrict(pricing.TextClasses) // chat usage has no cache writes to price
		// Asked for the refusal (x-escrow-fit: off): the numbers, not retried.
		if off := res.FitOff; off == nil || off.Status != 429 || !off.IsRateLimit || off.Code != "insufficient_quota" || off.Attempts != 1 ||
			!strings.Contains(off.Message, "needs at least "+strconv.FormatInt(2*off.BodyBytes+8*32_768, 10)+", 200000 is available") ||
			!strings.Contains(off.Message, "at most "+strconv.FormatInt((smallFunds-2*off.BodyBytes)/8, 10)+" would fit") {
			t.Fatalf("x-escrow-fit: off through the SDK: %+v", off)
		}
		for _, c := range []struct {
			org  string
			f    sdkFitted
			name string
		}{{"sdk-small", res.Fit.JSON, "JSON"}, {"sdk-small-stream", res.Fit.Stream, "stream"}} {
			wantCap, wantHold := fitCapOf(t, noCacheWrites, c.f.BodyBytes, 32_768, smallFunds)
			if readme := (smallFunds - 2*c.f.BodyBytes) / 8; wantCap != readme || wantHold != 2*c.f.BodyBytes+8*wantCap {
				t.Fatalf("the cap %d and bound %d are not README's %d", wantCap, wantHold, readme)
			}
			var u usage
			_ = json.Unmarshal(c.f.Usage, &u)
			if c.f.Status != 200 || c.f.Attempts != 1 || c.f.OutputCap != strconv.FormatInt(wantCap, 10) || wantCap < 256 ||
				u.Completion != wantCap || c.f.Words != wantCap || c.f.FinishReason != "length" {
				t.Fatalf("fitted %s: %+v (usage %+v), want the output cap %d", c.name, c.f, u, wantCap)
			}
			cost := 2*u.Prompt + 8*u.Completion
			b := p.settled(c.org) // every charge is in the ledger
			ch := p.charges(c.org)
			if len(ch) != 1 || ch[0].Request.HoldAmount != wantHold || ch[0].Request.Cost != cost || cost > wantHold ||
				b.LedgerBalance != smallFunds-cost || b.LedgerBalance < 0 {
				t.Fatalf("fitted %s: charges %+v, balance %+v; want the hold %d, the cost %d", c.name, ch, b, wantHold, cost)
			}
			t.Logf("fitted %s: %d body bytes, no max_tokens → %d, held %d of %d, cost %d", c.name, c.f.BodyBytes, wantCap, wantHold, smallFunds, cost)
		}
		var caps []int64
		for _, r := range g.fake.Seen() {
			var body struct {
				Model string `json:"model"`
				Cap   int64  `json:"max_completion_tokens"`
			}
			if json.Unmarshal(r.Body, &body) == nil && body.Model == "big" {
				caps = append(caps, body.Cap)
			}
		}
		if want := []int64{parseCap(res.Fit.JSON.OutputCap), parseCap(res.Fit.Stream.OutputCap)}; !slices.Equal(caps, want) {
			t.Fatalf("the upstream got max_completion_tokens %v, want %v", caps, want)
		}

		// Held is not gone.
		checkHeld(t, res.Held, "rate_limit_exceeded", "balance_held")
		var hu usage
		_ = json.Unmarshal(res.Held.Usage, &hu)
		hb := p.settled("sdk-held") // every charge is in the ledger
		ch := p.charges("sdk-held")
		var holds, costs []int64
		for _, c := range ch {
			holds, costs = append(holds, c.Request.HoldAmount), append(costs, c.Request.Cost)
		}
		slices.Sort(holds)
		slices.Sort(costs)
		if hu.Completion != 12 || len(ch) != 2 || !slices.Equal(holds, []int64{12, gatedHold}) || !slices.Equal(costs, []int64{12, gatedCost}) ||
			hb.LedgerBalance != heldFunds-gatedCost-12 {
			t.Fatalf("held org: charges %+v, balance %+v; want holds 12 and %d, costs 12 and %d", ch, hb, gatedHold, gatedCost)
		}
	})
}
