package admin_test

import (
	"os"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// TestImportRoute: POST /models/import takes LiteLLM's file (larger than MaxBodyBytes is fine)
// or a CSV; ?dry_run=1 answers the diff and writes nothing; the real import writes through Ops
// and the audit trail records its summary, not the file; a model named "import" stays
// reachable.
func TestImportRoute(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	excerpt, err := os.ReadFile("../accounting/testdata/litellm/model_prices_excerpt.json")
	if err != nil {
		t.Fatal(err)
	}
	// Padded past the admin API's 1 MiB body limit with blanks: still one JSON object.
	big := string(excerpt) + strings.Repeat(" ", 2<<20)

	var dry accounting.ImportReport
	c.ok("POST", "/models/import?dry_run=1", big, 200, &dry)
	cacheWrite := 0
	for _, m := range dry.New {
		// The report shows defaults filled in: a cache-write price the table left out is the
		// input price, the 1-hour one 2× it.
		if m.Prices[pricing.CacheWrite1h] != 2*m.Prices[pricing.Input] {
			t.Fatalf("%s: 1-hour cache-write price %d, input %d", m.Name, m.Prices[pricing.CacheWrite1h], m.Prices[pricing.Input])
		}
		if m.Prices[pricing.CacheWrite] != m.Prices[pricing.Input] {
			cacheWrite++
		}
	}
	if !dry.DryRun || len(dry.New) != 16 || len(dry.Skipped) != 19 || cacheWrite != 2 {
		t.Fatalf("dry run: %d new, %d skipped, %d with a cache-write price: %+v", len(dry.New), len(dry.Skipped), cacheWrite, dry)
	}
	var models list[ledger.Model]
	c.ok("GET", "/models", "", 200, &models)
	if len(models.Data) != 0 {
		t.Fatalf("the dry run wrote %d models", len(models.Data))
	}

	var r accounting.ImportReport
	c.ok("POST", "/models/import?provider=bedrock_converse", big, 200, &r)
	if r.DryRun || len(r.New) != 10 {
		t.Fatalf("import: %+v", r)
	}
	var m ledger.Model
	c.ok("GET", "/models/amazon.nova-2-lite-v1:0", "", 200, &m)
	if m.Prices[pricing.Input] != 300_000 || m.Prices[pricing.CachedInput] != 75_000 || m.Prices[pricing.Output] != 2_500_000 || m.MaxOutputTokens != 64_000 {
		t.Fatalf("imported model: %+v", m)
	}

	// CSV: one change against what is there.
	var csvr accounting.ImportReport
	c.ok("POST", "/models/import", "amazon.nova-2-lite-v1:0,0.3,2.5,0.1\nimport,1,2\n", 200, &csvr)
	if len(csvr.Changed) != 1 || csvr.Changed[0].Old.Prices[pricing.CachedInput] != 75_000 || csvr.Changed[0].New.Prices[pricing.CachedInput] != 100_000 || len(csvr.New) != 1 {
		t.Fatalf("csv import: %+v", csvr)
	}
	c.ok("GET", "/models/import", "", 200, &m)
	if m.Name != "import" || m.Prices[pricing.Input] != 1_000_000 {
		t.Fatalf("model named import: %+v", m)
	}

	for _, bad := range []struct{ path, body string }{
		{"/models/import?dry_run=maybe", "a,1,2"},
		{"/models/import", "{"},
		{"/models/import?provider=openai", "a,1,2"},
	} {
		if rec := c.do("POST", bad.path, bad.body); rec.Code != 400 {
			t.Errorf("%s %q: %d %s", bad.path, bad.body, rec.Code, rec.Body)
		}
	}

	var audit list[ledger.AuditRecord]
	c.ok("GET", "/audit", "", 200, &audit)
	var details []string
	for _, a := range audit.Data {
		if a.Action == "POST /admin/v1/models/import" {
			details = append(details, a.Detail)
		}
	}
	if len(details) != 6 || !strings.Contains(details[len(details)-1], "dry_run=true") || !strings.Contains(details[len(details)-1], "16 new") ||
		!strings.Contains(details[len(details)-2], "10 new") || len(details[len(details)-1]) > 400 {
		t.Fatalf("audit details: %q", details)
	}
}
