package accounting_test

import (
	"context"
	"maps"
	"os"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
)

func i64p(v int64) *int64 { return &v }

// TestParseLiteLLM reads the committed excerpt of LiteLLM's price file: the chat entries
// become rows in micro-units per 1M tokens, exactly; the others are skipped with a reason.
func TestParseLiteLLM(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("testdata/litellm/model_prices_excerpt.json")
	if err != nil {
		t.Fatal(err)
	}
	tab, err := pricing.ParsePriceTable(b, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(tab.Rows) != 16 || len(tab.Skipped) != 19 {
		t.Fatalf("%d rows, %d skipped; want 16 and 19: %+v", len(tab.Rows), len(tab.Skipped), tab.Skipped)
	}
	rows := map[string]pricing.PriceRow{}
	for i, r := range tab.Rows {
		rows[r.Model] = r
		if i > 0 && tab.Rows[i-1].Model >= r.Model {
			t.Fatalf("rows not sorted: %s before %s", tab.Rows[i-1].Model, r.Model)
		}
	}
	for name, want := range map[string]pricing.PriceRow{
		// 1.25e-05 per token = 12.5 per 1M tokens; no cache-read price: the input price.
		"ai21.j2-mid-v1":        {Prices: pricing.Prices{pricing.Input: 12_500_000, pricing.CachedInput: 12_500_000, pricing.Output: 12_500_000}, MaxInputTokens: i64p(8191), MaxOutputTokens: i64p(8191)},
		"amazon.nova-lite-v1:0": {Prices: pricing.Prices{pricing.Input: 60_000, pricing.CachedInput: 60_000, pricing.Output: 240_000}, MaxInputTokens: i64p(300_000), MaxOutputTokens: i64p(10_000)},
		// cache_read_input_token_cost 5.46875e-07, input 2.1875e-06, output 1.75e-05;
		// input_cost_per_audio_token and input_cost_per_image_token: their classes.
		"amazon.nova-2-pro-preview-20251202-v1:0": {Prices: pricing.Prices{pricing.Input: 2_187_500, pricing.CachedInput: 546_875, pricing.Output: 17_500_000,
			pricing.AudioInput: 2_187_500, pricing.ImageInput: 2_187_500}, MaxInputTokens: i64p(1_000_000), MaxOutputTokens: i64p(64_000)},
		"jp.amazon.nova-2-lite-v1:0": {Prices: pricing.Prices{pricing.Input: 330_000, pricing.CachedInput: 82_500, pricing.Output: 2_750_000}, MaxInputTokens: i64p(1_000_000), MaxOutputTokens: i64p(64_000)},
		// cache_creation_input_token_cost 6.875e-06: the cache-write price, 6,875,000;
		// cache_creation_input_token_cost_above_1hr 1.1e-05: the 1-hour one.
		"eu.anthropic.claude-opus-4-6-v1": {Prices: pricing.Prices{pricing.Input: 5_500_000, pricing.CachedInput: 550_000, pricing.Output: 27_500_000, pricing.CacheWrite: 6_875_000, pricing.CacheWrite1h: 11_000_000},
			MaxInputTokens: i64p(1_000_000), MaxOutputTokens: i64p(128_000)},
		"anthropic.claude-mythos-preview": {MaxInputTokens: i64p(1_000_000), MaxOutputTokens: i64p(128_000)},
	} {
		got, ok := rows[name]
		if !ok {
			t.Errorf("%s: not imported", name)
			continue
		}
		if !got.Prices.Equal(want.Prices) || !eqp(got.MaxInputTokens, want.MaxInputTokens) ||
			!eqp(got.MaxOutputTokens, want.MaxOutputTokens) || got.Mode != "chat" || len(got.RoundedUp) != 0 {
			t.Errorf("%s: %+v, want %+v", name, got, want)
		}
	}
	reasons := map[string]string{}
	for _, s := range tab.Skipped {
		reasons[s.Model] = s.Reason
	}
	if r := reasons["sample_spec"]; !strings.HasPrefix(r, "mode ") {
		t.Errorf("sample_spec: %q", r)
	}
	if r := reasons["1024-x-1024/dall-e-2"]; r != `mode "image_generation" is not priced per token here` {
		t.Errorf("dall-e-2: %q", r)
	}

	// A provider filter keeps that provider's entries.
	tab, err = pricing.ParsePriceTable(b, []string{"bedrock"})
	if err != nil || len(tab.Rows) != 6 {
		t.Fatalf("bedrock only: %d rows %v", len(tab.Rows), err)
	}
}

func eqp(a, b *int64) bool { return (a == nil && b == nil) || (a != nil && b != nil && *a == *b) }

// TestParseLiteLLMEdges: rounding up is reported, bad prices skip their entry (not the file),
// and a missing output price is 0 only for embeddings.
func TestParseLiteLLMEdges(t *testing.T) {
	t.Parallel()
	tab, err := pricing.ParsePriceTable([]byte(`{
		"frac": {"mode": "chat", "input_cost_per_token": 1.0000001e-06, "output_cost_per_token": 3.333333333333e-07},
		"emb": {"mode": "embedding", "input_cost_per_token": 2e-08},
		"resp": {"mode": "responses", "input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07, "max_output_tokens": 16384},
		"neg": {"mode": "chat", "input_cost_per_token": -1e-06, "output_cost_per_token": 1e-06},
		"str": {"mode": "chat", "input_cost_per_token": "1e-06", "output_cost_per_token": 1e-06},
		"noout": {"mode": "chat", "input_cost_per_token": 1e-06},
		"noin": {"mode": "completion", "output_cost_per_token": 1e-06},
		"badmax": {"mode": "chat", "input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06, "max_input_tokens": 1.5},
		"nomode": {"input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06},
		"rerank": {"mode": "rerank", "input_cost_per_token": 1e-06}
	}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range tab.Rows {
		names = append(names, r.Model)
	}
	if strings.Join(names, ",") != "emb,frac,resp" || len(tab.Skipped) != 7 {
		t.Fatalf("rows %v, skipped %+v", names, tab.Skipped)
	}
	frac := tab.Rows[1]
	if frac.Prices[pricing.Input] != 1_000_001 || frac.Prices[pricing.Output] != 333_334 || frac.Prices[pricing.CachedInput] != 1_000_001 ||
		strings.Join(frac.RoundedUp, ",") != "input_price,output_price" {
		t.Fatalf("frac: %+v", frac)
	}
	if emb := tab.Rows[0]; emb.Prices[pricing.Input] != 20_000 || emb.Prices[pricing.Output] != 0 || emb.Mode != "embedding" {
		t.Fatalf("emb: %+v", emb)
	}
	if resp := tab.Rows[2]; resp.Prices[pricing.Input] != 150_000 || resp.Prices[pricing.Output] != 600_000 || resp.MaxInputTokens != nil || *resp.MaxOutputTokens != 16384 {
		t.Fatalf("resp: %+v", resp)
	}
	for _, bad := range []string{`{`, `{"a":1} x`, `{"a":1}{}`} {
		if _, err := pricing.ParsePriceTable([]byte(bad), nil); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

// TestParsePriceCSV: the simple CSV format, prices per 1M tokens in currency units.
func TestParsePriceCSV(t *testing.T) {
	t.Parallel()
	tab, err := pricing.ParsePriceTable([]byte("\ufeff"+pricing.CSVHeader+`
# a comment
gpt-4o-mini, 0.15, 0.6, 0.075, 128000, 16384
"name,with,commas",2.5,10,,,
tiny,0.0000001,0.0000015
gpt-4o-mini,1,1
bad,abc,1
short,1
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(tab.Rows) != 3 || len(tab.Skipped) != 3 {
		t.Fatalf("%+v", tab)
	}
	want := []pricing.PriceRow{
		{Model: "gpt-4o-mini", Prices: pricing.Prices{pricing.Input: 150_000, pricing.CachedInput: 75_000, pricing.Output: 600_000}, MaxInputTokens: i64p(128_000), MaxOutputTokens: i64p(16_384)},
		{Model: "name,with,commas", Prices: pricing.Prices{pricing.Input: 2_500_000, pricing.CachedInput: 2_500_000, pricing.Output: 10_000_000}},
		{Model: "tiny", Prices: pricing.Prices{pricing.Input: 1, pricing.CachedInput: 1, pricing.Output: 2}, RoundedUp: []string{"input_price", "output_price"}},
	}
	for i, w := range want {
		g := tab.Rows[i]
		if g.Model != w.Model || !maps.Equal(g.Prices, w.Prices) || !eqp(g.MaxInputTokens, w.MaxInputTokens) || !eqp(g.MaxOutputTokens, w.MaxOutputTokens) ||
			strings.Join(g.RoundedUp, ",") != strings.Join(w.RoundedUp, ",") {
			t.Errorf("row %d: %+v, want %+v", i, g, w)
		}
	}
	if tab.Skipped[0].Reason != "listed twice" {
		t.Errorf("skipped: %+v", tab.Skipped)
	}
	if _, err := pricing.ParsePriceTable([]byte("a,1,1\n"), []string{"openai"}); err == nil {
		t.Error("a provider filter on a CSV: accepted")
	}
}

// TestImportPrices: a dry run writes nothing and reports new, changed (old → new) and
// unchanged models; the import writes them, keeps each model's default hold and learned max
// cost (in the ledger and in Redis), and a second import changes nothing.
func TestImportPrices(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	l := memledger.New()
	store, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	ops := accounting.NewOps(newWorker(t, l, store, nil))
	old := ledger.Model{Name: "gpt-4o-mini", Prices: pricing.Prices{pricing.Input: 100_000, pricing.CachedInput: 50_000, pricing.Output: 400_000},
		MaxInputTokens: 128_000, MaxOutputTokens: 4096, MaxCost: 7_000, DefaultHold: 9_000}
	if err := ops.PutModel(ctx, old); err != nil {
		t.Fatal(err)
	}
	same := ledger.Model{Name: "same", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.CachedInput: 1_000_000, pricing.Output: 2_000_000}, MaxCost: 5}
	if err := ops.PutModel(ctx, same); err != nil {
		t.Fatal(err)
	}
	// A request taught Redis a higher max than the ledger knows.
	if _, err := store.RaiseModelMax(ctx, "gpt-4o-mini", 8_000, 0, 1_000_000); err != nil {
		t.Fatal(err)
	}
	tab, err := pricing.ParsePriceTable([]byte("model,input_per_1m,output_per_1m,cached_input_per_1m,max_input_tokens,max_output_tokens\n"+
		"gpt-4o-mini,0.15,0.6,0.075,,16384\nsame,1,2\nnew-model,3,15,0.3,200000,8192\nbad,x,1\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	dry, err := ops.ImportPrices(ctx, tab, true)
	if err != nil {
		t.Fatal(err)
	}
	if !dry.DryRun || len(dry.New) != 1 || dry.New[0].Name != "new-model" || len(dry.Changed) != 1 || len(dry.Unchanged) != 1 || len(dry.Skipped) != 1 {
		t.Fatalf("dry run: %+v", dry)
	}
	ch := dry.Changed[0]
	wantNew := old
	wantNew.Prices = pricing.Prices{pricing.Input: 150_000, pricing.CachedInput: 75_000, pricing.Output: 600_000}
	wantNew.MaxOutputTokens = 16384
	// The report shows the prices each model is billed at: its defaults filled in.
	if !ch.Old.Equal(old) || !ch.New.Equal(wantNew) {
		t.Fatalf("change %+v, want %+v → %+v", ch, old, wantNew)
	}
	if m, _ := l.Model(ctx, "gpt-4o-mini"); !m.Equal(old) {
		t.Fatalf("the dry run wrote: %+v", m)
	}
	if _, err := l.Model(ctx, "new-model"); err == nil {
		t.Fatal("the dry run created a model")
	}

	r, err := ops.ImportPrices(ctx, tab, false)
	if err != nil || r.DryRun || len(r.New) != 1 || len(r.Changed) != 1 || len(r.Unchanged) != 1 {
		t.Fatalf("import: %+v %v", r, err)
	}
	m, err := l.Model(ctx, "gpt-4o-mini")
	wantNew.MaxCost = 8_000 // raised back to what Redis learned
	if err != nil || !m.Equal(wantNew) {
		t.Fatalf("imported %+v %v, want %+v", m, err, wantNew)
	}
	store2, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, AllowEviction: true}) // no cache
	if err != nil {
		t.Fatal(err)
	}
	if v, err := store2.ModelMax(ctx, "gpt-4o-mini"); err != nil || v != 8_000 {
		t.Fatalf("learned max in Redis: %d %v, want 8000 kept", v, err)
	}
	if m, err := l.Model(ctx, "new-model"); err != nil || m.Prices[pricing.Input] != 3_000_000 || m.Prices[pricing.CachedInput] != 300_000 || m.Prices[pricing.Output] != 15_000_000 ||
		m.MaxInputTokens != 200_000 || m.MaxOutputTokens != 8192 || m.MaxCost != 0 {
		t.Fatalf("new model %+v %v", m, err)
	}
	again, err := ops.ImportPrices(ctx, tab, false)
	if err != nil || len(again.New)+len(again.Changed) != 0 || len(again.Unchanged) != 3 {
		t.Fatalf("second import: %+v %v", again, err)
	}
}

// TestImportCacheWrite: a table's cache-write price (LiteLLM's cache_creation_input_token_cost,
// the CSV's seventh column) is stored as the class pricing.CacheWrite; a table without one keeps the
// model's current cache-write price.
func TestImportCacheWrite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	ledger := memledger.New()
	store, err := balance.New(ctx, env.Client, &balance.Config{Ledger: ledger, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	ops := accounting.NewOps(newWorker(t, ledger, store, nil))
	tab, err := pricing.ParsePriceTable([]byte(`{"claude-x":{"mode":"chat","input_cost_per_token":1e-06,"output_cost_per_token":5e-06,
		"cache_read_input_token_cost":1e-07,"cache_creation_input_token_cost":1.25e-06}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := ops.ImportPrices(ctx, tab, true)
	if err != nil || len(r.New) != 1 || r.New[0].Prices[pricing.CacheWrite] != 1_250_000 {
		t.Fatalf("dry run: %+v %v", r, err)
	}
	if _, err := ops.ImportPrices(ctx, tab, false); err != nil {
		t.Fatal(err)
	}
	m, err := ledger.Model(ctx, "claude-x")
	if err != nil || !maps.Equal(m.Prices, pricing.Prices{pricing.Input: 1_000_000, pricing.CachedInput: 100_000, pricing.Output: 5_000_000, pricing.CacheWrite: 1_250_000}) {
		t.Fatalf("imported: %+v %v", m, err)
	}
	// A CSV without the column keeps it; with it, changes it (the diff shows old → new).
	csv, err := pricing.ParsePriceTable([]byte("claude-x,1,5,0.1\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := ops.ImportPrices(ctx, csv, false); err != nil || len(r.Unchanged) != 1 {
		t.Fatalf("CSV without a cache-write price: %+v %v", r, err)
	}
	csv, err = pricing.ParsePriceTable([]byte(pricing.CSVHeader+"\nclaude-x,1,5,0.1,,,1.5\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err = ops.ImportPrices(ctx, csv, true)
	if err != nil || len(r.Changed) != 1 || r.Changed[0].Old.Prices[pricing.CacheWrite] != 1_250_000 || r.Changed[0].New.Prices[pricing.CacheWrite] != 1_500_000 {
		t.Fatalf("CSV with a cache-write price: %+v %v", r, err)
	}
}

// TestImportCacheWrite1h: a table's 1-hour cache-write price (LiteLLM's
// cache_creation_input_token_cost_above_1hr, the CSV's eighth column) is stored as
// the class pricing.CacheWrite1h; a table without one keeps the model's (0 for a new model: billed at
// 2× the input price), and a model whose table prices bill the same is unchanged.
func TestImportCacheWrite1h(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := testutil.Redis(t)
	ledger := memledger.New()
	store, err := balance.New(ctx, env.Client, &balance.Config{Ledger: ledger, Prefix: env.Prefix, AllowEviction: true})
	if err != nil {
		t.Fatal(err)
	}
	ops := accounting.NewOps(newWorker(t, ledger, store, nil))
	tab, err := pricing.ParsePriceTable([]byte(`{"claude-x":{"mode":"chat","input_cost_per_token":1e-06,"output_cost_per_token":5e-06,
		"cache_read_input_token_cost":1e-07,"cache_creation_input_token_cost":1.25e-06,"cache_creation_input_token_cost_above_1hr":2.000001e-06},
		"plain":{"mode":"chat","input_cost_per_token":2e-06,"output_cost_per_token":8e-06}}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ops.ImportPrices(ctx, tab, false); err != nil {
		t.Fatal(err)
	}
	m, err := ledger.Model(ctx, "claude-x")
	if err != nil || m.Prices[pricing.CacheWrite1h] != 2_000_001 {
		t.Fatalf("imported: %+v %v", m, err)
	}
	p, err := ledger.Model(ctx, "plain")
	if err != nil || !maps.Equal(p.Prices, pricing.Prices{pricing.Input: 2_000_000, pricing.CachedInput: 2_000_000, pricing.Output: 8_000_000}) ||
		p.WithDefaults()[pricing.CacheWrite1h] != 4_000_000 || p.WithDefaults()[pricing.CacheWrite] != 2_000_000 {
		t.Fatalf("imported without cache-write prices: %+v %v", p, err)
	}
	csv, err := pricing.ParsePriceTable([]byte(pricing.CSVHeader+"\nclaude-x,1,5,0.1,,,1.25\nplain,2,8,,,,,4\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	// claude-x keeps its 1-hour price (column empty); plain's 4 is its default already.
	r, err := ops.ImportPrices(ctx, csv, true)
	if err != nil || len(r.Unchanged) != 2 {
		t.Fatalf("CSV: %+v %v", r, err)
	}
	csv, err = pricing.ParsePriceTable([]byte("claude-x,1,5,0.1,,,1.25,3\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err = ops.ImportPrices(ctx, csv, true)
	if err != nil || len(r.Changed) != 1 || r.Changed[0].Old.Prices[pricing.CacheWrite1h] != 2_000_001 || r.Changed[0].New.Prices[pricing.CacheWrite1h] != 3_000_000 {
		t.Fatalf("CSV with a 1-hour price: %+v %v", r, err)
	}
	if bad, _ := pricing.ParsePriceTable([]byte("x,1,5,0.1,,,1.25,3,9\n"), nil); len(bad.Skipped) != 1 {
		t.Fatalf("9 columns: %+v", bad)
	}
}
