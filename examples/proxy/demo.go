package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/llmescrow/escrow/accounting"
)

// demoModels are priced like small public models (micro-units per 1M tokens).
var demoModels = []accounting.Model{
	{Name: "gpt-4o-mini", Prices: accounting.Prices{Input: 150_000, CachedInput: 75_000, Output: 600_000},
		MaxInputTokens: 128_000, MaxOutputTokens: 16_384, DefaultHold: 50_000},
	{Name: "gpt-4.1", Prices: accounting.Prices{Input: 2_000_000, CachedInput: 500_000, Output: 8_000_000},
		MaxInputTokens: 1_047_576, MaxOutputTokens: 32_768, DefaultHold: 500_000},
	{Name: "text-embedding-3-small", Prices: accounting.Prices{Input: 20_000},
		MaxInputTokens: 8_192, MaxOutputTokens: 1, DefaultHold: 1_000},
}

// seedDemo creates the demo org, its balance, an API key and the demo models.
func (a *app) seedDemo(ctx context.Context) error {
	for _, m := range demoModels {
		if err := a.ledger.PutModel(ctx, m); err != nil {
			return err
		}
	}
	if err := a.ledger.CreateOrg(ctx, "demo"); err != nil && !errors.Is(err, accounting.ErrOrgExists) {
		return err
	}
	if a.cfg.DemoBalance > 0 {
		if _, _, err := a.ledger.Credit(ctx, "demo", a.cfg.DemoBalance, "demo-initial-balance"); err != nil {
			return err
		}
	}
	_, secret, err := a.ledger.CreateKey(ctx, "demo")
	if err != nil {
		return err
	}
	a.demoKey = secret
	return nil
}

// demoBanner is what the embedded demo prints: a curl line that works, and the admin token.
func (a *app) demoBanner() string {
	var b strings.Builder
	base := "http://" + a.addr()
	fmt.Fprintf(&b, "\nescrow proxy (embedded demo) on %s\n", base)
	fmt.Fprintf(&b, "  org \"demo\" has %d micro-units; its API key: %s\n", a.cfg.DemoBalance, a.demoKey)
	fmt.Fprintf(&b, "  admin token: %s\n\nTry:\n", a.cfg.AdminToken)
	fmt.Fprintf(&b, "  curl -s %s/v1/chat/completions -H 'Authorization: Bearer %s' -H 'Content-Type: application/json' \\\n", base, a.demoKey)
	fmt.Fprintf(&b, "    -d '{\"model\":\"gpt-4o-mini\",\"max_tokens\":50,\"messages\":[{\"role\":\"user\",\"content\":\"hello there\"}]}'\n")
	fmt.Fprintf(&b, "  curl -s %s/admin/v1/orgs/demo/balance -H 'Authorization: Bearer %s'\n\n", base, a.cfg.AdminToken)
	return b.String()
}
