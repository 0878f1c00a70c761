package admin_test

import (
	"encoding/csv"
	"slices"
	"strings"
	"testing"
)

// TestCSVFormulaCells (issue 22 item 5): text a client or an operator chose (an org's name, an
// entry's reference) that a spreadsheet would run as a formula is exported with a quote in
// front; numbers, negative ones too, stay numbers.
func TestCSVFormulaCells(t *testing.T) {
	t.Parallel()
	c := newConsole(t)
	c.ok("POST", "/orgs", `{"id":"acme","name":"=HYPERLINK(\"http://evil.example\",\"x\")"}`, 201, nil)
	c.ok("POST", "/orgs/acme/credits", `{"amount":100,"reference":"+cmd|' /C calc'!A0"}`, 201, nil)
	c.ok("POST", "/orgs/acme/adjustments", `{"amount":-5,"reference":"@SUM(1+1)*cmd"}`, 201, nil)
	c.ok("POST", "/orgs/acme/adjustments", `{"amount":-7,"reference":"\t=1+2"}`, 201, nil)
	c.ok("POST", "/orgs/acme/adjustments", `{"amount":-9,"reference":"-2+3"}`, 201, nil)

	read := func(path string) [][]string {
		t.Helper()
		rec := c.do("GET", path, "")
		if rec.Code != 200 {
			t.Fatalf("%s: %d %s", path, rec.Code, rec.Body)
		}
		rows, err := csv.NewReader(strings.NewReader(rec.Body.String())).ReadAll()
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		return rows
	}
	col := func(rows [][]string, name string) []string {
		i := slices.Index(rows[0], name)
		if i < 0 {
			t.Fatalf("no column %q in %v", name, rows[0])
		}
		var out []string
		for _, r := range rows[1:] {
			out = append(out, r[i])
		}
		return out
	}
	if names := col(read("/orgs?format=csv"), "name"); !slices.Contains(names, `'=HYPERLINK("http://evil.example","x")`) {
		t.Errorf("org names %q: want the formula quoted", names)
	}
	rows := read("/orgs/acme/entries?format=csv")
	refs, deltas := col(rows, "reference"), col(rows, "delta")
	for _, want := range []string{"'+cmd|' /C calc'!A0", "'@SUM(1+1)*cmd", "'\t=1+2", "'-2+3"} {
		if !slices.Contains(refs, want) {
			t.Errorf("references %q: want %q", refs, want)
		}
	}
	for _, want := range []string{"100", "-5", "-7", "-9"} {
		if !slices.Contains(deltas, want) {
			t.Errorf("deltas %q: want the number %s as it is", deltas, want)
		}
	}
}
