package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// demoModels are priced like small public models (micro-units per 1M tokens).
var demoModels = []ledger.Model{
	{Name: "gpt-4o-mini", Prices: pricing.Prices{pricing.Input: 150_000, pricing.CachedInput: 75_000, pricing.Output: 600_000},
		MaxInputTokens: 128_000, MaxOutputTokens: 16_384, DefaultHold: 50_000},
	{Name: "gpt-4.1", Prices: pricing.Prices{pricing.Input: 2_000_000, pricing.CachedInput: 500_000, pricing.Output: 8_000_000},
		MaxInputTokens: 1_047_576, MaxOutputTokens: 32_768, DefaultHold: 500_000},
	{Name: "text-embedding-3-small", Prices: pricing.Prices{pricing.Input: 20_000},
		MaxInputTokens: 8_192, MaxOutputTokens: 1, DefaultHold: 1_000},
	// Served on /v1/messages by the fake's Anthropic API (cache writes and reads priced).
	{Name: "claude-haiku-4-5", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.CacheWrite: 1_250_000, pricing.CachedInput: 100_000, pricing.Output: 5_000_000},
		MaxInputTokens: 200_000, MaxOutputTokens: 64_000, DefaultHold: 100_000},
}

// seedDemo creates the demo models, the demo org with its balance, and an API key, through the
// same operations the admin API uses (the org and the key straight from its ledger); it returns
// the key.
func seedDemo(ctx context.Context, ops *accounting.Ops, funds int64) (string, error) {
	for _, m := range demoModels {
		if err := ops.PutModel(ctx, m); err != nil {
			return "", err
		}
	}
	if err := ops.Ledger().CreateOrg(ctx, "demo"); err != nil && !errors.Is(err, ledger.ErrOrgExists) {
		return "", err
	}
	if funds > 0 {
		if _, _, err := ops.Credit(ctx, "demo", funds, "demo-initial-balance"); err != nil {
			return "", err
		}
	}
	_, secret, err := ops.Ledger().CreateKey(ctx, "demo")
	return secret, err
}

// demoBanner is what the embedded demo prints: a curl line that works, and the admin token.
func demoBanner(addr, key, adminToken string, funds int64) string {
	var b strings.Builder
	base := "http://" + addr
	fmt.Fprintf(&b, "\nescrow proxy (embedded demo) on %s\n", base)
	fmt.Fprintf(&b, "  org \"demo\" has %d micro-units; its API key: %s\n", funds, key)
	fmt.Fprintf(&b, "  admin token: %s\n\nTry:\n", adminToken)
	fmt.Fprintf(&b, "  curl -s %s/v1/chat/completions -H 'Authorization: Bearer %s' -H 'Content-Type: application/json' \\\n", base, key)
	fmt.Fprintf(&b, "    -d '{\"model\":\"gpt-4o-mini\",\"max_tokens\":50,\"messages\":[{\"role\":\"user\",\"content\":\"hello there\"}]}'\n")
	fmt.Fprintf(&b, "  curl -s %s/v1/messages -H 'x-api-key: %s' -H 'anthropic-version: 2023-06-01' -H 'Content-Type: application/json' \\\n", base, key)
	fmt.Fprintf(&b, "    -d '{\"model\":\"claude-haiku-4-5\",\"max_tokens\":50,\"messages\":[{\"role\":\"user\",\"content\":\"hello there\"}]}'\n")
	fmt.Fprintf(&b, "  curl -s %s/admin/v1/orgs/demo/balance -H 'Authorization: Bearer %s'\n\n", base, adminToken)
	return b.String()
}

func randomToken(prefix string) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}
