package admin_test

import (
	"strings"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestModelPriceClasses (issue 32, prices as data): any class of the registry is set by PUT
// ("<class>_price") and PATCH ("<class>_price", "<class>_per_1m" or "<class>_per_unit" by the
// class's unit; null removes it), shown in JSON and as a CSV column, and listed by GET
// /price-classes; no class has code of its own in the admin API. A name that is no class, or
// a decimal with the wrong unit, is a 400.
func TestModelPriceClasses(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	var m ledger.Model
	c.ok("PUT", "/models/gpt-audio", `{"input_price":2500000,"output_price":10000000,"audio_input_price":40000000}`, 200, &m)
	if m.Prices[pricing.AudioInput] != 40_000_000 || m.Prices[pricing.CachedInput] != 2_500_000 {
		t.Fatalf("PUT: %+v", m)
	}
	if _, ok := m.Prices[pricing.AudioOutput]; ok {
		t.Fatalf("an audio output price appeared from nowhere: %+v", m)
	}
	c.ok("PATCH", "/models/gpt-audio", `{"audio_output_per_1m":"80","per_image_1024x1024_hd_per_unit":"0.08","tool_call_web_search_price":10000}`, 200, &m)
	if m.Prices[pricing.AudioOutput] != 80_000_000 || m.Prices[pricing.PerImage("1024x1024", "hd")] != 80_000 ||
		m.Prices[pricing.ToolCall("web_search")] != 10_000 || m.Prices[pricing.AudioInput] != 40_000_000 {
		t.Fatalf("PATCH: %+v", m)
	}
	c.ok("PATCH", "/models/gpt-audio", `{"audio_input_price":null}`, 200, &m)
	if _, ok := m.Prices[pricing.AudioInput]; ok {
		t.Fatalf("PATCH null kept the class: %+v", m)
	}
	csv := c.do("GET", "/models?format=csv", "").Body.String()
	if !strings.Contains(csv, ",audio_output_price,") || !strings.Contains(csv, ",per_image_1024x1024_hd_price") || !strings.Contains(csv, ",80000000,") {
		t.Fatalf("CSV: %s", csv)
	}
	for _, body := range []string{`{"nope_price":1}`, `{"audio_output_per_unit":"1"}`, `{"per_image_1024x1024_hd_per_1m":"1"}`, `{"audio_output_price":-1}`,
		`{"audio_output_price":1,"audio_output_per_1m":"1"}`, `{"batch_discount_price":101}`, `{"max_cost":"x"}`} {
		if rec := c.do("PATCH", "/models/gpt-audio", body); rec.Code != 400 {
			t.Errorf("PATCH %s: %d %s", body, rec.Code, rec.Body)
		}
	}
	for _, body := range []string{`{"input_price":1,"nope_price":1}`, `{"input_price":1,"colour":"red"}`} {
		if rec := c.do("PUT", "/models/bad", body); rec.Code != 400 {
			t.Errorf("PUT %s: %d %s", body, rec.Code, rec.Body)
		}
	}
	var classes struct{ Data []map[string]any }
	c.ok("GET", "/price-classes", "", 200, &classes)
	seen := map[string]bool{}
	for _, cl := range classes.Data {
		seen[cl["class"].(string)] = true
	}
	if !seen["audio_input"] || !seen["cache_write_1h_input"] || len(classes.Data) != len(pricing.Classes()) {
		t.Fatalf("price classes: %+v", classes.Data)
	}
}
