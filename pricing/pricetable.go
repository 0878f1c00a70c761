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
	Model string `json:"model"`
	// Prices are the classes the table gives: always Input, CachedInput (the input price when
	// the table gives no cache-read price: no discount is assumed) and Output; any other class
	// only when given — the import keeps the model's current price of a class the row does not
	// give (none for a new model: the class's default, Prices.Price).
	Prices          Prices   `json:"prices"`
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
// LiteLLM's prices are currency units per token (its fields map to classes in liteLLMClasses:
// input_cost_per_token is Input, cache_creation_input_token_cost CacheWrite,
// input_cost_per_audio_token AudioInput …), read exactly from their decimal text (1.5e-07 per token is 150,000 micro-units per 1M tokens,
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

// liteLLMClasses maps LiteLLM's price fields to classes. Its prices are currency units per
// token (shift 12: micro-units per 1M tokens), per character (12: per 1M characters) or per
// second (6: micro-units per second).
var liteLLMClasses = []struct {
	key   string
	class Class
	shift int
}{
	{"input_cost_per_token", Input, 12},
	{"output_cost_per_token", Output, 12},
	{"cache_read_input_token_cost", CachedInput, 12},
	{"cache_creation_input_token_cost", CacheWrite, 12},
	{"cache_creation_input_token_cost_above_1hr", CacheWrite1h, 12},
	{"input_cost_per_audio_token", AudioInput, 12},
	{"output_cost_per_audio_token", AudioOutput, 12},
	{"input_cost_per_image_token", ImageInput, 12},
	{"output_cost_per_image_token", ImageOutput, 12},
	{"input_cost_per_character", Characters, 12},
	{"input_cost_per_second", AudioSecond, 6},
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
	price := func(field, key string, shift int, dst *int64) (given bool, why string) {
		v, ok := e[key]
		if !ok || string(v) == "null" {
			return false, ""
		}
		n, exact, err := DecimalMicros(string(v), shift, true)
		if err != nil {
			return false, key + ": " + strings.TrimPrefix(err.Error(), "pricing: ")
		}
		if !exact {
			row.RoundedUp = append(row.RoundedUp, field)
		}
		*dst = n
		return true, ""
	}
	row.Prices = Prices{}
	for _, f := range liteLLMClasses {
		var v int64
		given, why := price(string(f.class)+"_price", f.key, f.shift, &v)
		switch {
		case why != "":
			return row, why
		case given:
			row.Prices[f.class] = v
		}
	}
	if _, ok := row.Prices[Input]; !ok {
		return row, "no input_cost_per_token"
	}
	if _, ok := row.Prices[Output]; !ok && row.Mode != "embedding" {
		return row, "no output_cost_per_token"
	}
	row.Prices[Output] = row.Prices[Output] // an embedding's: 0
	if _, ok := row.Prices[CachedInput]; !ok {
		row.Prices[CachedInput] = row.Prices[Input]
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

// CSVHeader is the header of a CSV price table: the legacy columns, in the order a file without
// a header gives them.
const CSVHeader = "model,input_per_1m,output_per_1m,cached_input_per_1m,max_input_tokens,max_output_tokens,cache_write_input_per_1m,cache_write_1h_input_per_1m"

// ParsePriceCSV reads a CSV price table. A first row starting with "model" is the header and
// names the columns: model, max_input_tokens, max_output_tokens, and one column per class,
// "<class>_per_1m" for a class quoted per 1M tokens or characters (input_per_1m,
// audio_output_per_1m …) or "<class>_per_unit" for one quoted per item or second
// (per_image_1024x1024_hd_per_unit, audio_second_per_unit); input_per_1m and output_per_1m
// are required. Without a header the columns are CSVHeader's. Prices are in currency units
// as decimals ("0.15" per 1M tokens is 150,000 micro-units), rounded up to whole micro-units
// like LiteLLM's. Blank cells are "not given" (an empty cached price is the input price;
// another class keeps the model's current price); lines starting with # are comments. A row
// that cannot be read is skipped with the reason.
func ParsePriceCSV(b []byte) (PriceTable, error) {
	b = bytes.TrimPrefix(b, []byte("\ufeff")) // a spreadsheet's byte order mark
	r := csv.NewReader(bytes.NewReader(b))
	r.FieldsPerRecord = -1
	r.Comment = '#'
	r.TrimLeadingSpace = true
	var t PriceTable
	seen := map[string]bool{}
	cols, _ := csvColumns(strings.Split(CSVHeader, ","))
	for line := 0; ; line++ {
		rec, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return PriceTable{}, fmt.Errorf("%w: CSV: %w", ErrInvalidPriceTable, err)
		}
		if line == 0 && strings.EqualFold(strings.TrimSpace(rec[0]), "model") {
			if cols, err = csvColumns(rec); err != nil {
				return PriceTable{}, err
			}
			continue
		}
		row, why := csvRow(cols, rec)
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

// csvColumns reads a header: each column's class ("" for model and the token limits).
func csvColumns(header []string) ([]csvColumn, error) {
	cols := make([]csvColumn, len(header))
	for i, h := range header {
		h = strings.ToLower(strings.TrimSpace(h))
		cols[i].name = h
		if i == 0 || h == "max_input_tokens" || h == "max_output_tokens" {
			continue
		}
		name, ok := strings.CutSuffix(h, "_per_1m")
		if !ok {
			name, ok = strings.CutSuffix(h, "_per_unit")
		}
		info, known := Lookup(Class(name))
		if !ok || !known || (info.Unit.per() == 1) != strings.HasSuffix(h, "_per_unit") {
			return nil, fmt.Errorf("%w: CSV column %q is not <class>_per_1m (tokens, characters) or <class>_per_unit (items, seconds)", ErrInvalidPriceTable, h)
		}
		cols[i].class = info.Name
	}
	return cols, nil
}

type csvColumn struct {
	name  string
	class Class
}

func csvRow(cols []csvColumn, rec []string) (PriceRow, string) {
	cell := func(i int) string {
		if i < len(rec) {
			return strings.TrimSpace(rec[i])
		}
		return ""
	}
	row := PriceRow{Model: cell(0), Prices: Prices{}}
	switch {
	case row.Model == "" || len(row.Model) > 200:
		return row, "model name empty or longer than 200 bytes"
	case len(rec) < 3 || len(rec) > len(cols):
		return row, fmt.Sprintf("want 3 to %d columns", len(cols))
	}
	for i, col := range cols[1:] {
		i++
		if cell(i) == "" {
			continue
		}
		if col.class == "" {
			n, err := strconv.ParseInt(cell(i), 10, 64)
			if err != nil || n < 0 || n > maxImportTokens {
				return row, col.name + ": not a whole number of tokens"
			}
			if col.name == "max_input_tokens" {
				row.MaxInputTokens = &n
			} else {
				row.MaxOutputTokens = &n
			}
			continue
		}
		n, exact, err := DecimalMicros(cell(i), 6, true)
		if err != nil {
			return row, col.name + ": " + strings.TrimPrefix(err.Error(), "pricing: ")
		}
		if !exact {
			row.RoundedUp = append(row.RoundedUp, string(col.class)+"_price")
		}
		row.Prices[col.class] = n
	}
	for _, c := range []Class{Input, Output} {
		if _, ok := row.Prices[c]; !ok {
			return row, string(c) + "_per_1m is required"
		}
	}
	if _, ok := row.Prices[CachedInput]; !ok {
		row.Prices[CachedInput] = row.Prices[Input]
	}
	return row, ""
}
