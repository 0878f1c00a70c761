package server

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/testutil"
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
// ESCROW_KEY, ESCROW_POOR_KEY, ESCROW_MODEL) and returns what it printed; a failing script fails
// the test with its standard error.
func runSDKScript(ctx context.Context, t *testing.T, node, script, base, key, poor, model string) []byte {
	t.Helper()
	cmd := exec.CommandContext(ctx, node, filepath.Join("..", "sdktest", script))
	cmd.Env = append(os.Environ(), "ESCROW_BASE_URL="+base, "ESCROW_KEY="+key, "ESCROW_POOR_KEY="+poor, "ESCROW_MODEL="+model)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node %s: %v\n%s", script, err, stderr.String())
	}
	return out
}

// TestAnthropicSDK drives the proxy with the official @anthropic-ai/sdk (sdktest/anthropic.mjs):
// a Messages request as JSON, as a stream and through the beta client (its betas reach the
// upstream), with prompt-cache writes and reads, are billed to the micro-unit
// what the SDK reported, and an insufficient balance surfaces as the SDK's
// PaymentRequiredError after one HTTP attempt (no retries, although the client allows 3).
func TestAnthropicSDK(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "@anthropic-ai/sdk")
	eachAnthropicMode(t, func(t *testing.T, p anthProxy) {
		const funds = 10_000_000
		key := p.setupClaude("sdk", funds)
		poor := p.setupClaude("sdk-poor", 5)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out := runSDKScript(ctx, t, node, "anthropic.mjs", p.base, key, poor, "claude-t")
		var res struct {
			JSON, Stream, Beta struct {
				ID    string    `json:"id"`
				Usage anthUsage `json:"usage"`
				Text  string    `json:"text"`
			}
			Refused *struct {
				Status            int    `json:"status"`
				Class             string `json:"class"`
				IsAPIError        bool   `json:"isAPIError"`
				IsPaymentRequired bool   `json:"isPaymentRequired"`
				Type              string `json:"type"`
				Attempts          int    `json:"attempts"`
			}
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
		if seen, _ := p.fake.LastRequest(); (seen.Query != "" && seen.Query != "beta=true") ||
			seen.Header.Get("Anthropic-Beta") != "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14" {
			t.Fatalf("the beta call upstream: query %q, anthropic-beta %q", seen.Query, seen.Header.Get("Anthropic-Beta"))
		}
		var total int64
		for _, u := range []anthUsage{res.JSON.Usage, res.Stream.Usage, res.Beta.Usage} {
			c, err := claudePrices.Cost(u.usage())
			if err != nil {
				t.Fatal(err)
			}
			total += c
		}
		if b := p.settled("sdk"); b.LedgerBalance != funds-total || b.Available != funds-total {
			t.Fatalf("ledger %+v, want %d (the usage the SDK reported, %d)", b, funds-total, total)
		}
		r := res.Refused
		if r == nil || r.Status != 402 || r.Class != "PaymentRequiredError" || !r.IsPaymentRequired || !r.IsAPIError ||
			r.Type != "billing_error" || r.Attempts != 1 {
			t.Fatalf("insufficient balance as the SDK saw it: %+v", r)
		}
		if b := p.settled("sdk-poor"); b.LedgerBalance != 5 || b.Held != 0 {
			t.Fatalf("poor org: %+v", b)
		}
		if !strings.HasPrefix(res.JSON.ID, "msg") {
			t.Fatalf("message id %q", res.JSON.ID)
		}
	})
}

// TestOpenAINodeSDK drives the proxy with the official openai npm package (sdktest/openai.mjs):
// a chat completion as JSON and as a stream are billed to the micro-unit what the SDK reported,
// the model list holds the priced model, and an insufficient balance surfaces as the SDK's
// RateLimitError with code insufficient_quota after one HTTP attempt (no retries, although the
// client allows 3: x-should-retry: false).
func TestOpenAINodeSDK(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	eachMode(t, func(t *testing.T, p *testProxy) {
		const funds = 1_000_000
		key := p.setup("sdk", funds, 65)   // 1 µ per output token, input free
		poor := p.setup("sdk-poor", 5, 65) // a hold of 65 does not fit in 5
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out := runSDKScript(ctx, t, node, "openai.mjs", p.base, key, poor, "m")
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
			Models  []string `json:"models"`
			Refused *struct {
				Status      int    `json:"status"`
				Class       string `json:"class"`
				IsRateLimit bool   `json:"isRateLimit"`
				Code        string `json:"code"`
				Type        string `json:"type"`
				Attempts    int    `json:"attempts"`
			} `json:"refused"`
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
		r := res.Refused
		if r == nil || r.Status != 429 || !r.IsRateLimit || r.Code != "insufficient_quota" || r.Attempts != 1 {
			t.Errorf("insufficient balance through the SDK: %+v, want 429 RateLimitError insufficient_quota after 1 attempt", r)
		}
		// The model costs 1 µ per output token: the ledger is charged exactly what the SDK reported.
		b := p.settled("sdk")
		if want := int64(funds) - res.JSON.Usage.Completion - res.Stream.Usage.Completion; b.LedgerBalance != want || b.Available != want {
			t.Errorf("balance after the SDK's two requests: %+v, want %d", b, want)
		}
		if pb := p.settled("sdk-poor"); pb.LedgerBalance != 5 || pb.Available != 5 {
			t.Errorf("the refused org was charged: %+v", pb)
		}
	})
}
