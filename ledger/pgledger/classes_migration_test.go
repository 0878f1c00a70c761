package pgledger_test

import (
	"context"
	"maps"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/pricing"
)

// TestPriceClassesMigration: the price-classes migration moves each model's price columns into
// its class map (a cached or cache-write price of 0 was "the default" and is left out) and each
// usage event's cached and cache-write counts into its units (the 1-hour writes apart from
// the 5-minute ones: the old cache_write_tokens counted both); the model then bills as before.
// The old columns stay, so a process of the previous release still inserts its events, and
// PutModel keeps the old price columns current for it.
func TestPriceClassesMigration(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	ctx := context.Background()
	migrateBefore(t, env.Pool, "_price_classes.up.sql")
	if _, err := env.Pool.Exec(ctx, `
INSERT INTO models (model, input_price, cached_input_price, output_price, cache_write_input_price, cache_write_1h_input_price, default_hold) VALUES
	('claude', 3000000, 300000, 15000000, 3750000, 0, 10), ('plain', 0, 0, 5, 0, 0, 10);
INSERT INTO accounts (org_id, balance, ledger_seq, settled_seq) VALUES ('a', 0, 0, 0);
INSERT INTO usage_events (id, org_id, model, cost, status, prompt_tokens, cached_tokens, completion_tokens, cache_write_tokens, cache_write_1h_tokens) VALUES
	('0192f0c4-0000-7000-8000-000000000001', 'a', 'claude', 9, 'voided', 7100, 5000, 50, 2000, 1500),
	('0192f0c4-0000-7000-8000-000000000002', 'a', 'claude', 9, 'voided', 10, 0, 5, 0, 0)`); err != nil {
		t.Fatal(err)
	}
	l := migrateRest(t, env.Pool)
	m, err := l.Model(ctx, "claude")
	want := pricing.Prices{pricing.Input: 3_000_000, pricing.CachedInput: 300_000, pricing.Output: 15_000_000, pricing.CacheWrite: 3_750_000}
	if err != nil || !maps.Equal(m.Prices, want) || m.Prices.Has(pricing.AudioInput) {
		t.Fatalf("claude after the migration: %+v %v", m, err)
	}
	if p, err := l.Model(ctx, "plain"); err != nil || !maps.Equal(p.Prices, pricing.Prices{pricing.Input: 0, pricing.Output: 5}) {
		t.Fatalf("plain after the migration: %+v %v", p, err)
	}
	r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000001")
	wantUsage := pricing.Usage{Prompt: 7100, Completion: 50, Units: pricing.Units{pricing.CachedInput: 5000, pricing.CacheWrite: 500, pricing.CacheWrite1h: 1500}}
	if err != nil || !r.Usage.Equal(wantUsage) {
		t.Fatalf("event after the migration: %+v %v", r.Usage, err)
	}
	// 100·3 + 5000·0.3 + 500·3.75 + 1500·6 (the 1-hour default, 2× input) + 50·15
	if c, err := m.Cost(r.Usage); err != nil || c != 300+1_500+1_875+9_000+750 {
		t.Fatalf("cost %d %v", c, err)
	}
	if r, err := l.Request(ctx, "0192f0c4-0000-7000-8000-000000000002"); err != nil || r.Usage.Units != nil {
		t.Fatalf("a text event has units: %+v %v", r.Usage, err)
	}
	// A process of the previous release: its insert (the old columns) still succeeds, and it
	// reads prices written since from the old columns.
	if _, err := env.Pool.Exec(ctx, `INSERT INTO usage_events (id, org_id, model, cost, status, prompt_tokens, cached_tokens, cache_write_tokens, cache_write_1h_tokens)
		VALUES ('0192f0c4-0000-7000-8000-000000000003', 'a', 'claude', 1, 'voided', 5, 1, 2, 1)`); err != nil {
		t.Fatalf("an old process's insert: %v", err)
	}
	m.Prices = pricing.Prices{pricing.Input: 4_000_000, pricing.Output: 16_000_000, pricing.AudioInput: 40_000_000}
	if err := l.PutModel(ctx, m); err != nil {
		t.Fatal(err)
	}
	var in, cached, out int64
	if err := env.Pool.QueryRow(ctx, `SELECT input_price, cached_input_price, output_price FROM models WHERE model = 'claude'`).Scan(&in, &cached, &out); err != nil ||
		in != 4_000_000 || cached != 0 || out != 16_000_000 {
		t.Fatalf("old columns after PutModel: %d %d %d %v", in, cached, out, err)
	}
}
