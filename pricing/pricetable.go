package pricing

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
)

// ErrInvalidPriceTable is wrapped by the errors of ParsePriceTable for a file that cannot be
// read at all (a bad row or entry is skipped instead, with its reason).
var ErrInvalidPriceTable = errors.New("pricing: invalid price table")

// PriceRow is one model's prices as a price table gives them, converted to micro-units per
// 1,000,000 tokens (DecimalMicros; fractions rounded up). A nil token limit is one the table
// does not give: the import keeps the model's current value.
type PriceRow struct {
	Model  string `json:"model"`
	Prices        // CachedInput is Input when the table gives no cache-read price
	// CacheWrite is the cache-write price (Prices.CacheWriteInput) when the table gives one,
	// CacheWrite1h the 1-hour one (Prices.CacheWrite1hInput); nil: the import keeps the
	// model's current price (0 for a new model: its default, Prices.WithDefaults).
	CacheWrite      *int64   `json:"cache_write_input_price,omitempty"`
	CacheWrite1h    *int64   `json:"cache_write_1h_input_price,omitempty"`
	MaxInputTokens  *int64   `json:"max_input_tokens,omitempty"`
	MaxOutputTokens *int64   `json:"max_output_tokens,omitempty"`
	Provider        string   `json:"provider,omitempty"`
	Mode            string   `json:"mode,omitempty"`
	RoundedUp       []string `json:"rounded_up,omitempty"` // the prices that were not whole micro-units and were rounded up
}

// SkippedPrice is a table entry that was not imported, and why.
type SkippedPrice struct {
	Model  string `json:"model"`
	Reason string `json:"reason"`
}

// PriceTable is a parsed price table: the rows to import (sorted by model) and the entries
// skipped.
type PriceTable struct {
	Rows    []PriceRow     `json:"rows"`
	Skipped []SkippedPrice `json:"skipped"`
}

// maxImportTokens bounds a token limit read from a table.
const maxImportTokens = 1 << 40

// importModes are the LiteLLM modes escrow prices (per token, on a priced endpoint).
var importModes = []string{"chat", "completion", "responses", "embedding"}

// ParsePriceTable reads a price table: LiteLLM's model_prices_and_context_window.json (a JSON
// object; its first non-blank byte is "{") or a CSV file (see ParsePriceCSV). providers, when
// not empty, keeps only the LiteLLM entries of those litellm_provider values.
//
// LiteLLM's prices are currency units per token (input_cost_per_token,
// output_cost_per_token, cache_read_input_token_cost, cache_creation_input_token_cost: the
// cache-write price, Prices.CacheWriteInput; cache_creation_input_token_cost_above_1hr: the
// 1-hour one, Prices.CacheWrite1hInput), read
// exactly from their decimal text (1.5e-07 per token is 150,000 micro-units per 1M tokens,
// assuming the table's currency, USD, is the deployment's: 1 USD = 1,000,000 micro-units) and
// rounded up when not whole, so an import never under-charges. Entries whose mode is not chat,
// completion, responses or embedding, or that have no per-token input price, are skipped with
// the reason. A missing cache-read price is the input price (no discount is assumed); a
// missing output price is 0 only for embeddings.
func ParsePriceTable(b []byte, providers []string) (PriceTable, error) {
	if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '{' {
		return parseLiteLLM(t, providers)
	}
	if len(providers) > 0 {
		return PriceTable{}, fmt.Errorf("%w: a provider filter applies to LiteLLM's JSON only", ErrInvalidPriceTable)
	}
	return ParsePriceCSV(b)
}

func parseLiteLLM(b []byte, providers []string) (PriceTable, error) {
	var entries map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&entries); err != nil {
		return PriceTable{}, fmt.Errorf("%w: not a LiteLLM price file (a JSON object of models): %w", ErrInvalidPriceTable, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return PriceTable{}, fmt.Errorf("%w: data after the JSON object", ErrInvalidPriceTable)
	}
	var t PriceTable
	names := make([]string, 0, len(entries))
	for name := range entries {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		row, why := liteLLMRow(name, entries[name], providers)
		if why != "" {
			t.Skipped = append(t.Skipped, SkippedPrice{Model: name, Reason: why})
			continue
		}
		t.Rows = append(t.Rows, row)
	}
	return t, nil
}

// liteLLMRow reads one entry; a non-empty reason says why it is skipped.
func liteLLMRow(name string, raw json.RawMessage, providers []string) (PriceRow, string) {
	var e map[string]json.RawMessage
	if err := json.Unmarshal(raw, &e); err != nil {
		return PriceRow{}, "not a JSON object"
	}
	str := func(k string) string {
		var s string
		_ = json.Unmarshal(e[k], &s)
		return s
	}
	row := PriceRow{Model: name, Provider: str("litellm_provider"), Mode: str("mode")}
	switch {
	case len(providers) > 0 && !slices.Contains(providers, row.Provider):
		return row, "provider " + strconv.Quote(row.Provider) + " not selected"
	case row.Mode == "":
		return row, "no mode"
	case !slices.Contains(importModes, row.Mode):
		return row, "mode " + strconv.Quote(row.Mode) + " is not priced per token here"
	case name == "" || len(name) > 200:
		return row, "model name empty or longer than 200 bytes"
	}
	price := func(field, key string, dst *int64) (given bool, why string) {
		v, ok := e[key]
		if !ok || string(v) == "null" {
			return false, ""
		}
		n, exact, err := DecimalMicros(string(v), 12, true)
		if err != nil {
			return false, key + ": " + strings.TrimPrefix(err.Error(), "pricing: ")
		}
		if !exact {
			row.RoundedUp = append(row.RoundedUp, field)
		}
		*dst = n
		return true, ""
	}
	given, why := price("input_price", "input_cost_per_token", &row.Input)
	if why != "" {
		return row, why
	}
	if !given {
		return row, "no input_cost_per_token"
	}
	given, why = price("output_price", "output_cost_per_token", &row.Output)
	if why != "" {
		return row, why
	}
	if !given && row.Mode != "embedding" {
		return row, "no output_cost_per_token"
	}
	row.CachedInput = row.Input
	if _, why = price("cached_input_price", "cache_read_input_token_cost", &row.CachedInput); why != "" {
		return row, why
	}
	var cw, cw1h int64
	if given, why = price("cache_write_input_price", "cache_creation_input_token_cost", &cw); why != "" {
		return row, why
	} else if given {
		row.CacheWriteInput, row.CacheWrite = cw, &cw
	}
	if given, why = price("cache_write_1h_input_price", "cache_creation_input_token_cost_above_1hr", &cw1h); why != "" {
		return row, why
	} else if given {
		row.CacheWrite1hInput, row.CacheWrite1h = cw1h, &cw1h
	}
	for _, f := range []struct {
		key string
		dst **int64
	}{{"max_input_tokens", &row.MaxInputTokens}, {"max_output_tokens", &row.MaxOutputTokens}} {
		v, ok := e[f.key]
		if !ok || string(v) == "null" {
			continue
		}
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil || n < 0 || n > maxImportTokens {
			return row, f.key + ": not a whole number of tokens"
		}
		*f.dst = &n
	}
	return row, ""
}

// CSVHeader is the header of a CSV price table.
const CSVHeader = "model,input_per_1m,output_per_1m,cached_input_per_1m,max_input_tokens,max_output_tokens,cache_write_input_per_1m,cache_write_1h_input_per_1m"

// ParsePriceCSV reads a CSV price table: model, input_per_1m, output_per_1m and optionally
// cached_input_per_1m, max_input_tokens, max_output_tokens, cache_write_input_per_1m (Anthropic's
// prompt-cache writes; empty: the model's current one is kept), cache_write_1h_input_per_1m (its
// 1-hour cache writes; the same), prices in currency units per 1M
// tokens as decimals ("0.15" is 150,000 micro-units), rounded up to whole micro-units like
// LiteLLM's. A first row starting with "model" is the header; blank cells are "not given" (an
// empty cached price is the input price); lines starting with # are comments. A row that
// cannot be read is skipped with the reason.
func ParsePriceCSV(b []byte) (PriceTable, error) {
	b = bytes.TrimPrefix(b, []byte("\ufeff")) // a spreadsheet's byte order mark
	r := csv.NewReader(bytes.NewReader(b))
	r.FieldsPerRecord = -1
	r.Comment = '#'
	r.TrimLeadingSpace = true
	var t PriceTable
	seen := map[string]bool{}
	for line := 0; ; line++ {
		rec, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return PriceTable{}, fmt.Errorf("%w: CSV: %w", ErrInvalidPriceTable, err)
		}
		if line == 0 && strings.EqualFold(strings.TrimSpace(rec[0]), "model") {
			continue
		}
		row, why := csvRow(rec)
		switch {
		case why == "" && seen[row.Model]:
			why = "listed twice"
		case why == "":
			seen[row.Model] = true
			t.Rows = append(t.Rows, row)
			continue
		}
		t.Skipped = append(t.Skipped, SkippedPrice{Model: row.Model, Reason: why})
	}
	slices.SortFunc(t.Rows, func(a, b PriceRow) int { return strings.Compare(a.Model, b.Model) })
	return t, nil
}

func csvRow(rec []string) (PriceRow, string) {
	cell := func(i int) string {
		if i < len(rec) {
			return strings.TrimSpace(rec[i])
		}
		return ""
	}
	row := PriceRow{Model: cell(0)}
	switch {
	case row.Model == "" || len(row.Model) > 200:
		return row, "model name empty or longer than 200 bytes"
	case len(rec) < 3 || len(rec) > 8:
		return row, "want 3 to 8 columns: " + CSVHeader
	}
	price := func(field string, i int, dst *int64) (bool, string) {
		if cell(i) == "" {
			return false, ""
		}
		n, exact, err := DecimalMicros(cell(i), 6, true)
		if err != nil {
			return false, field + ": " + strings.TrimPrefix(err.Error(), "pricing: ")
		}
		if !exact {
			row.RoundedUp = append(row.RoundedUp, field)
		}
		*dst = n
		return true, ""
	}
	for _, f := range []struct {
		name string
		i    int
		dst  *int64
	}{{"input_price", 1, &row.Input}, {"output_price", 2, &row.Output}} {
		given, why := price(f.name, f.i, f.dst)
		if why != "" {
			return row, why
		}
		if !given {
			return row, strings.TrimSuffix(f.name, "_price") + "_per_1m is required"
		}
	}
	row.CachedInput = row.Input
	if _, why := price("cached_input_price", 3, &row.CachedInput); why != "" {
		return row, why
	}
	var cw, cw1h int64
	if given, why := price("cache_write_input_price", 6, &cw); why != "" {
		return row, why
	} else if given {
		row.CacheWriteInput, row.CacheWrite = cw, &cw
	}
	if given, why := price("cache_write_1h_input_price", 7, &cw1h); why != "" {
		return row, why
	} else if given {
		row.CacheWrite1hInput, row.CacheWrite1h = cw1h, &cw1h
	}
	for _, f := range []struct {
		name string
		i    int
		dst  **int64
	}{{"max_input_tokens", 4, &row.MaxInputTokens}, {"max_output_tokens", 5, &row.MaxOutputTokens}} {
		if cell(f.i) == "" {
			continue
		}
		n, err := strconv.ParseInt(cell(f.i), 10, 64)
		if err != nil || n < 0 || n > maxImportTokens {
			return row, f.name + ": not a whole number of tokens"
		}
		*f.dst = &n
	}
	return row, ""
}
