package main

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const excerpt = "../../accounting/testdata/litellm/model_prices_excerpt.json"

// TestCLIImport imports the committed LiteLLM excerpt through `escrow models import` against
// the proxy: the dry run prints the diff (new, changed old → new, skipped by reason) and writes
// nothing; the import writes, keeps the model's default hold, is recorded in the audit trail
// and prices requests exactly; importing again changes nothing; a CSV imports too.
func TestCLIImport(t *testing.T) {
	base, c := startCLIServer(t)
	c.ok("models", "set", "ai21.j2-mid-v1", "--input", "10", "--output", "10", "--max-output-tokens", "100", "--default-hold", "777")

	// The table's columns are aligned with spaces: compare with single spaces.
	squash := func(s string) string { return strings.Join(strings.Fields(s), " ") }
	out := squash(c.ok("models", "import", excerpt, "--dry-run"))
	for _, want := range []string{
		"dry run: nothing written",
		// cached_input_price was never set: it is not stored, and follows the input price (its
		// default rule), so the diff names only the classes the import sets.
		"changed ai21.j2-mid-v1 input_price 10000000 → 12500000, output_price 10000000 → 12500000, max_input_tokens 0 → 8191, max_output_tokens 100 → 8191 skipped",
		"new amazon.nova-2-lite-v1:0 input_price 300000, cached_input_price 75000, output_price 2500000, max_input_tokens 1000000, max_output_tokens 64000 new",
		"skipped 18: mode \"image_generation\" is not priced per token here",
		"new eu.anthropic.claude-opus-4-6-v1 input_price 5500000, cached_input_price 550000, cache_write_input_price 6875000, output_price 27500000, max_input_tokens 1000000, max_output_tokens 128000 new",
		"would import: 15 new, 1 changed, 0 unchanged, 19 skipped",
	} {
		if !strings.Contains(out, want) {
			t.Fatalf("dry run output lacks %q:\n%s", want, out)
		}
	}
	if out := c.ok("models", "--csv"); strings.Count(out, "\n") != 2 || !strings.Contains(out, "ai21.j2-mid-v1,10000000,") {
		t.Fatalf("the dry run wrote:\n%s", out)
	}

	if out := c.ok("models", "import", excerpt); !strings.Contains(out, "imported: 15 new, 1 changed, 0 unchanged, 19 skipped") || strings.Contains(out, "dry run") {
		t.Fatalf("import output:\n%s", out)
	}
	var m struct {
		Input       int64 `json:"input_price"`
		DefaultHold int64 `json:"default_hold"`
		MaxOutput   int64 `json:"max_output_tokens"`
	}
	c.json(&m, "models", "show", "ai21.j2-mid-v1")
	if m.Input != 12_500_000 || m.DefaultHold != 777 || m.MaxOutput != 8191 {
		t.Fatalf("imported model: %+v", m)
	}
	if out := c.ok("models", "import", excerpt); !strings.Contains(out, "imported: 0 new, 0 changed, 16 unchanged, 19 skipped") {
		t.Fatalf("second import:\n%s", out)
	}
	var report struct {
		New     []map[string]any
		Skipped []map[string]any
	}
	c.json(&report, "models", "import", excerpt, "--provider", "bedrock", "--dry-run")
	if len(report.New) != 0 || len(report.Skipped) != 29 {
		t.Fatalf("--provider --json: %+v", report)
	}

	csvFile := filepath.Join(t.TempDir(), "prices.csv")
	if err := os.WriteFile(csvFile, []byte("model,input_per_1m,output_per_1m\ncsv-model,0.15,0.0000015\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out := squash(c.ok("models", "import", csvFile)); !strings.Contains(out, "rounded up csv-model: output_price") || !strings.Contains(out, "imported: 1 new") {
		t.Fatalf("csv import:\n%s", out)
	}
	var audit []map[string]any
	c.json(&audit, "audit")
	imports := 0
	for _, a := range audit {
		if a["action"] == "POST /admin/v1/models/import" && a["actor"] == "tester (escrow cli)" {
			imports++
		}
	}
	if imports != 5 {
		t.Fatalf("%d imports in the audit trail, want 5: %v", imports, audit)
	}

	// An imported price bills a request exactly: amazon.nova-lite-v1:0 is 60,000 in and
	// 240,000 out per 1M tokens; 3 words in and 10 out cost ceil((3·60,000 + 10·240,000)/1e6) = 3.
	c.ok("orgs", "create", "acme")
	c.ok("credit", "acme", "1000000", "--ref", "pay-1")
	var k struct{ Key string }
	c.json(&k, "keys", "create", "acme")
	req, _ := http.NewRequest("POST", base+"/v1/chat/completions",
		strings.NewReader(`{"model":"amazon.nova-lite-v1:0","max_tokens":10,"messages":[{"role":"user","content":"one two three"}]}`))
	req.Header.Set("Authorization", "Bearer "+k.Key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("request: %d", resp.StatusCode)
	}
	var org struct {
		LedgerBalance int64 `json:"ledger_balance"`
		LedgerSeq     int64 `json:"ledger_seq"`
	}
	deadline := time.Now().Add(time.Minute)
	for c.json(&org, "orgs", "show", "acme"); org.LedgerSeq < 2; c.json(&org, "orgs", "show", "acme") {
		if time.Now().After(deadline) {
			t.Fatalf("the request was never accounted: %+v", org)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if org.LedgerBalance != 1_000_000-3 {
		t.Fatalf("balance %d, want %d", org.LedgerBalance, 1_000_000-3)
	}
}
