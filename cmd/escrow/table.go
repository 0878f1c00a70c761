package main

import (
	"encoding/csv"
	"encoding/json"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/llmescrow/escrow/internal/csvcell"
)

// output prints an answer as JSON (--json), as CSV (--csv) or as a table.
type output struct{ json, csv bool }

func (o *output) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.json, "json", false, "print the API's JSON")
	fs.BoolVar(&o.csv, "csv", false, "print CSV")
}

// print prints v as JSON (--json), or rows, their cells under cols, as CSV (--csv) or a table.
func (o output) print(v any, cols []string, rows [][]string) error {
	switch {
	case o.json:
		return printJSON(v)
	case o.csv:
		w := csv.NewWriter(stdout)
		_ = w.Write(cols)
		for _, r := range rows {
			_ = w.Write(csvcell.Row(r))
		}
		w.Flush()
		return w.Error()
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.ToUpper(strings.Join(cols, "\t")))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

// printJSON prints v (the API's JSON as it came, json.RawMessage, or values holding it) indented,
// each object's keys sorted, nothing HTML-escaped: the CLI's --json output.
func printJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var tree any // open-ended: whatever JSON the API answered
	if err := json.Unmarshal(b, &tree); err != nil {
		return err
	}
	enc := json.NewEncoder(stdout)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	return enc.Encode(tree)
}

// withFields is the JSON object obj with extra's fields (a struct's or a map's) added, replacing
// any of the same name: the columns a command flattens into its rows, in its --json output too.
func withFields(obj json.RawMessage, extra any) (json.RawMessage, error) {
	b, err := json.Marshal(extra)
	if err != nil {
		return nil, err
	}
	var fields, add map[string]json.RawMessage
	if err := json.Unmarshal(obj, &fields); err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &add); err != nil {
		return nil, err
	}
	for k, v := range add {
		fields[k] = v
	}
	return json.Marshal(fields)
}

// column is one column of a table of T: its name (the API's JSON field; upper-cased, the
// header) and its cell in a row.
type column[T any] struct {
	name string
	cell func(T) string
}

// table is how a T prints as a table or CSV: its columns, in order.
type table[T any] []column[T]

// print prints data with t's columns, or v (the API's JSON of data) with --json.
func (t table[T]) print(o *output, v any, data []T) error {
	cols := make([]string, len(t))
	for i, c := range t {
		cols[i] = c.name
	}
	rows := make([][]string, len(data))
	for i, d := range data {
		rows[i] = t.cells(d)
	}
	return o.print(v, cols, rows)
}

func (t table[T]) cells(d T) []string {
	out := make([]string, len(t))
	for i, c := range t {
		out[i] = c.cell(d)
	}
	return out
}

// only is t's columns of these names, in this order (a name t lacks is a programming error).
func (t table[T]) only(names ...string) table[T] {
	out := make(table[T], 0, len(names))
	for _, n := range names {
		i := slices.IndexFunc(t, func(c column[T]) bool { return c.name == n })
		if i < 0 {
			panic("escrow: no column " + n)
		}
		out = append(out, t[i])
	}
	return out
}

// via is t's columns for a U that holds a T (get gives it).
func via[U, T any](t table[T], get func(U) T) table[U] {
	out := make(table[U], len(t))
	for i, c := range t {
		out[i] = column[U]{c.name, func(u U) string { return c.cell(get(u)) }}
	}
	return out
}

// The cells: each as the API's JSON has the value (a missing or null one is empty).

func i64(n int64) string { return strconv.FormatInt(n, 10) }

func optI64(n *int64) string {
	if n == nil {
		return ""
	}
	return i64(*n)
}

// ts is t as its JSON has it (RFC 3339 with the zone it came in: the text the API sent).
func ts(t time.Time) string { return t.Format(time.RFC3339Nano) }

func optTS(t *time.Time) string {
	if t == nil {
		return ""
	}
	return ts(*t)
}

// jsonCell is a nested value (a list, an object) as compact JSON, an object's keys sorted.
func jsonCell(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return ""
	}
	var tree any
	if json.Unmarshal(b, &tree) != nil {
		return ""
	}
	b, _ = json.Marshal(tree)
	return string(b)
}
