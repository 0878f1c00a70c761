package admin_test

import (
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
)

// TestModelCacheWritePrice: the prompt-cache write price (Anthropic) is set by PUT in
// micro-units, by PATCH in micro-units or in decimals, kept by a PATCH of other fields, listed in
// JSON and CSV, and refused when negative.
func TestModelCacheWritePrice(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	var m accounting.Model
	c.ok("PUT", "/models/claude-x", `{"input_price":3000000,"cached_input_price":300000,"cache_write_input_price":3750000,"output_price":15000000}`, 200, &m)
	if m.CacheWriteInput != 3_750_000 || m.Input != 3_000_000 {
		t.Fatalf("PUT: %+v", m)
	}
	c.ok("PATCH", "/models/claude-x", `{"cache_write_input_per_1m":"6"}`, 200, &m)
	if m.CacheWriteInput != 6_000_000 || m.Input != 3_000_000 || m.Output != 15_000_000 {
		t.Fatalf("PATCH decimal: %+v", m)
	}
	c.ok("PATCH", "/models/claude-x", `{"cache_write_input_price":3750001}`, 200, &m)
	c.ok("PATCH", "/models/claude-x", `{"output_per_1m":"16"}`, 200, &m)
	if m.CacheWriteInput != 3_750_001 {
		t.Fatalf("a PATCH of another field changed the cache-write price: %+v", m)
	}
	c.ok("GET", "/models/claude-x", "", 200, &m)
	if m.CacheWriteInput != 3_750_001 {
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
