package admin_test

import (
	"maps"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestModelCacheWritePrice: the prompt-cache write price (Anthropic) is set by PUT in
// micro-units, by PATCH in micro-units or in decimals, kept by a PATCH of other fields, listed in
// JSON and CSV, and refused when negative.
func TestModelCacheWritePrice(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	var m ledger.Model
	c.ok("PUT", "/models/claude-x", `{"input_price":3000000,"cached_input_price":300000,"cache_write_input_price":3750000,"output_price":15000000}`, 200, &m)
	if m.Prices[pricing.CacheWrite] != 3_750_000 || m.Prices[pricing.Input] != 3_000_000 {
		t.Fatalf("PUT: %+v", m)
	}
	c.ok("PATCH", "/models/claude-x", `{"cache_write_input_per_1m":"6"}`, 200, &m)
	if m.Prices[pricing.CacheWrite] != 6_000_000 || m.Prices[pricing.Input] != 3_000_000 || m.Prices[pricing.Output] != 15_000_000 {
		t.Fatalf("PATCH decimal: %+v", m)
	}
	c.ok("PATCH", "/models/claude-x", `{"cache_write_input_price":3750001}`, 200, &m)
	c.ok("PATCH", "/models/claude-x", `{"output_per_1m":"16"}`, 200, &m)
	if m.Prices[pricing.CacheWrite] != 3_750_001 {
		t.Fatalf("a PATCH of another field changed the cache-write price: %+v", m)
	}
	c.ok("GET", "/models/claude-x", "", 200, &m)
	if m.Prices[pricing.CacheWrite] != 3_750_001 {
		t.Fatalf("GET: %+v", m)
	}
	if rec := c.do("GET", "/models?format=csv", ""); !strings.Contains(rec.Body.String(), "cache_write_input_price") ||
		!strings.Contains(rec.Body.String(), ",3750001") {
		t.Fatalf("CSV: %s", rec.Body)
	}
	for _, body := range []string{`{"cache_write_input_price":-1}`, `{"cache_write_input_per_1m":"1","cache_write_input_price":1}`} {
		if rec := c.do("PATCH", "/models/claude-x", body); rec.Code != 400 {
			t.Fatalf("PATCH %s: %d %s", body, rec.Code, rec.Body)
		}
	}
	if rec := c.do("PUT", "/models/claude-y", `{"cache_write_input_price":-5}`); rec.Code != 400 {
		t.Fatalf("PUT negative: %d %s", rec.Code, rec.Body)
	}
}

// TestModelMissingPricesDefault: a model priced by PUT or PATCH with only its input and output
// prices shows — and is billed at — the input price for cached tokens and cache writes and 2×
// the input price for 1-hour cache writes; prices never given follow a later change of the input
// price; the 1-hour price is set by PUT and PATCH (micro-units or decimals) and refused when
// negative.
func TestModelMissingPricesDefault(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	var m ledger.Model
	c.ok("PUT", "/models/plain", `{"input_price":2000000,"output_price":8000000}`, 200, &m)
	want := pricing.Prices{pricing.Input: 2_000_000, pricing.CachedInput: 2_000_000, pricing.Output: 8_000_000, pricing.CacheWrite: 2_000_000, pricing.CacheWrite1h: 4_000_000}
	if !maps.Equal(m.Prices, want) {
		t.Fatalf("PUT answered %+v, want %+v", m.Prices, want)
	}
	c.ok("GET", "/models/plain", "", 200, &m)
	if !maps.Equal(m.Prices, want) {
		t.Fatalf("GET %+v, want %+v", m.Prices, want)
	}
	c.ok("PATCH", "/models/plain", `{"input_per_1m":"3"}`, 200, &m)
	want = pricing.Prices{pricing.Input: 3_000_000, pricing.CachedInput: 3_000_000, pricing.Output: 8_000_000, pricing.CacheWrite: 3_000_000, pricing.CacheWrite1h: 6_000_000}
	if !maps.Equal(m.Prices, want) {
		t.Fatalf("after a PATCH of the input price: %+v, want %+v", m.Prices, want)
	}
	var list struct{ Data []ledger.Model }
	c.ok("GET", "/models", "", 200, &list)
	if len(list.Data) != 1 || !maps.Equal(list.Data[0].Prices, want) {
		t.Fatalf("list: %+v", list.Data)
	}
	c.ok("PATCH", "/models/patched", `{"input_price":1000000,"output_price":5000000,"cache_write_1h_input_per_1m":"2.5"}`, 200, &m)
	if m.Prices[pricing.CacheWrite1h] != 2_500_000 || m.Prices[pricing.CachedInput] != 1_000_000 || m.Prices[pricing.CacheWrite] != 1_000_000 {
		t.Fatalf("PATCH with a 1-hour price: %+v", m)
	}
	c.ok("PUT", "/models/claude-1h", `{"input_price":3000000,"output_price":15000000,"cache_write_1h_input_price":6000001}`, 200, &m)
	if m.Prices[pricing.CacheWrite1h] != 6_000_001 {
		t.Fatalf("PUT with a 1-hour price: %+v", m)
	}
	if rec := c.do("GET", "/models?format=csv", ""); !strings.Contains(rec.Body.String(), ",cache_write_1h_input_price") ||
		!strings.Contains(rec.Body.String(), ",6000001") {
		t.Fatalf("CSV: %s", rec.Body)
	}
	for _, body := range []string{`{"cache_write_1h_input_price":-1}`, `{"cache_write_1h_input_per_1m":"1","cache_write_1h_input_price":1}`} {
		if rec := c.do("PATCH", "/models/plain", body); rec.Code != 400 {
			t.Fatalf("PATCH %s: %d %s", body, rec.Code, rec.Body)
		}
	}
	if rec := c.do("PUT", "/models/bad", `{"input_price":1,"cache_write_1h_input_price":-5}`); rec.Code != 400 {
		t.Fatalf("PUT negative: %d %s", rec.Code, rec.Body)
	}
}
