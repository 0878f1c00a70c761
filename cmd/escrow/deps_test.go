package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestNoTestDoublesInBinary: the production binary links neither the fake upstream nor
// miniredis nor the test helpers; only examples/proxy (and tests) bring them.
func TestNoTestDoublesInBinary(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 || !slices.Contains(deps, "github.com/llmescrow/escrow/server") {
		t.Fatalf("go list -deps gave an implausible list: %q", deps)
	}
	for _, banned := range []string{
		"github.com/llmescrow/escrow/internal/fakeupstream",
		"github.com/llmescrow/escrow/internal/testutil",
		"github.com/alicebob/miniredis/v2",
	} {
		if slices.Contains(deps, banned) {
			t.Errorf("cmd/escrow depends on %s", banned)
		}
	}
}

// layers are DESIGN.md's arrows: the module's packages each may import (directly). A package
// may also import whatever those import in turn (imports point down only); a package missing
// here fails the test, so a new one gets its place in the layering first.
var layers = map[string][]string{
	"lua":                   nil,
	"migrations":            nil,
	"balance":               {"lua"},
	"pricing":               {"balance"},                                                                                                        // prices, costs, price tables
	"ledger":                {"balance", "pricing"},                                                                                             // domain types, role interfaces, SQL-free shared logic
	"ledger/topup":          {"ledger"},                                                                                                         // the payments role: auto top-up settings and attempts
	"ledger/job":            {"ledger"},                                                                                                         // the jobs role: background responses and batches, leased and settled once
	"ledger/batchfile":      {"balance", "pricing"},                                                                                             // the batch files role: a batch input's bound, every file's org
	"ledger/access":         {"ledger"},                                                                                                         // the admin tokens role: scoped admin API tokens
	"ledger/grant":          {"ledger"},                                                                                                         // the grants role: credits that expire, spending order
	"ledger/memledger":      {"ledger", "ledger/topup", "ledger/access", "ledger/grant", "ledger/job", "ledger/batchfile"},                      // the in-memory store
	"ledger/pgledger":       {"ledger", "ledger/topup", "ledger/access", "ledger/grant", "ledger/job", "ledger/batchfile", "migrations"},        // the Postgres store
	"ledger/ledgertest":     {"ledger", "ledger/topup", "ledger/access", "ledger/grant", "ledger/job", "ledger/batchfile", "internal/testutil"}, // the conformance suite both stores run
	"accounting":            {"ledger", "ledger/topup", "ledger/access", "ledger/grant", "ledger/job", "balance", "internal/startstop"},         // recorder, worker, journal, Ops: never a store
	"async":                 {"ledger/job", "internal/startstop"},                                                                               // the job core's process side: recording, leasing, polling, settling jobs
	"endpoint":              {"pricing"},                                                                                                        // one spec per endpoint: data the middleware dispatches through
	"middleware":            {"accounting", "async", "balance", "endpoint", "ledger/access", "ledger/batchfile", "ledger/job"},
	"admin":                 {"accounting", "internal/csvcell"},
	"console":               {"admin", "accounting"},                                                                                          // the web console: reads through Ops, writes through the admin API
	".":                     {"accounting", "admin", "balance", "middleware", "migrations", "webhook", "ledger/memledger", "ledger/pgledger"}, // the root package escrow: New
	"server":                {".", "accounting", "admin", "async", "balance", "console", "endpoint", "middleware", "migrations", "payment", "webhook", "ledger/memledger", "ledger/pgledger"},
	"payment":               {"accounting"}, // processor webhooks → ledger entries, auto top-up (stripe-go)
	"cmd/escrow":            {"server", "internal/csvcell"},
	"examples/proxy":        {"server", "internal/fakeupstream"},
	"bench":                 {"server", "internal/fakeupstream", "internal/testutil"},
	"balance/balancetest":   {"balance", "internal/testutil"},
	"webhook":               {"ledger"},
	"internal/fakeupstream": nil,
	"internal/testutil":     {"ledger/pgledger", "migrations"}, // PostgresLedger: a migrated Postgres ledger per test
	"internal/startstop":    nil,                               // the one Start/Stop base of the worker, the recorder and the journal fallback
	"internal/modelcheck":   nil,                               // tests only: the SPIN model check and its replay
	"internal/csvcell":      nil,                               // CSV cells a spreadsheet will not run as formulas
	"scripts/image":         nil,                               // make image: the OCI image writer (a build tool)
}

const module = "github.com/llmescrow/escrow"

// relPath is an import path of the module relative to it ("." for the root package escrow).
func relPath(p string) (string, bool) {
	if p == module {
		return ".", true
	}
	return strings.CutPrefix(p, module+"/")
}

// layerViolations lists every import of imports (package → its module-internal imports, paths
// relative to the module) that the layers do not allow.
func layerViolations(imports map[string][]string) []string {
	var bad []string
	for pkg, deps := range imports {
		allowed, ok := reachable(pkg)
		if !ok {
			bad = append(bad, pkg+": not in the layering table")
			continue
		}
		for _, d := range deps {
			if !allowed[d] {
				bad = append(bad, pkg+" → "+d)
			}
		}
	}
	slices.Sort(bad)
	return bad
}

// reachable is the closure of pkg's arrows.
func reachable(pkg string) (map[string]bool, bool) {
	if _, ok := layers[pkg]; !ok {
		return nil, false
	}
	seen := map[string]bool{}
	var walk func(string)
	walk = func(p string) {
		for _, d := range layers[p] {
			if !seen[d] {
				seen[d] = true
				walk(d)
			}
		}
	}
	walk(pkg)
	return seen, true
}

// TestLayering: no package of the module imports (outside its tests) against DESIGN.md's
// arrows, as go list sees the imports.
func TestLayering(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, module+"/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	imports := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, ok := relPath(f[0])
		if !ok {
			continue
		}
		imports[pkg] = nil
		for _, d := range f[1:] {
			if rel, ok := relPath(d); ok {
				imports[pkg] = append(imports[pkg], rel)
			}
		}
	}
	if len(imports) < 10 || len(imports["server"]) == 0 {
		t.Fatalf("go list gave an implausible import map: %v", imports)
	}
	if bad := layerViolations(imports); len(bad) > 0 {
		t.Errorf("imports against the layering (DESIGN.md, Layout):\n  %s", strings.Join(bad, "\n  "))
	}
	// The checker itself finds a wrong arrow.
	if bad := layerViolations(map[string][]string{"admin": {"middleware"}, "balance": {"accounting"}, "newpkg": nil,
		"ledger/pgledger": {"accounting"}, "accounting": {"ledger/memledger"}}); len(bad) != 5 {
		t.Errorf("the checker missed a violation: %v", bad)
	}
}

// maxExported is the most names a library package of the module may export (DESIGN.md, Layout):
// past it, a package holds more than one role and is split by role.
const maxExported = 150

// exportedNames counts the exported names of a package's files: top-level types, funcs, vars and
// consts, and the methods of its exported types.
func exportedNames(files []*ast.File) int {
	n := 0
	for _, f := range files {
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.FuncDecl:
				if !d.Name.IsExported() {
					continue
				}
				if d.Recv != nil && len(d.Recv.List) > 0 {
					t := d.Recv.List[0].Type
					if s, ok := t.(*ast.StarExpr); ok {
						t = s.X
					}
					if g, ok := t.(*ast.IndexExpr); ok {
						t = g.X
					}
					if g, ok := t.(*ast.IndexListExpr); ok {
						t = g.X
					}
					if id, ok := t.(*ast.Ident); ok && !id.IsExported() {
						continue
					}
				}
				n++
			case *ast.GenDecl:
				for _, sp := range d.Specs {
					switch s := sp.(type) {
					case *ast.TypeSpec:
						if s.Name.IsExported() {
							n++
						}
					case *ast.ValueSpec:
						for _, name := range s.Names {
							if name.IsExported() {
								n++
							}
						}
					}
				}
			}
		}
	}
	return n
}

// TestExportedNames: no library package of the module (outside internal/, bench and commands)
// exports more than maxExported names.
func TestExportedNames(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}} {{.Name}} {{.Dir}}{{range .GoFiles}} {{.}}{{end}}`, module+"/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	counted := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		rel, ok := relPath(f[0])
		if !ok || f[1] == "main" || rel == "bench" || rel == "internal" || strings.HasPrefix(rel, "internal/") {
			continue
		}
		fset := token.NewFileSet()
		var files []*ast.File
		for _, name := range f[3:] {
			file, err := parser.ParseFile(fset, filepath.Join(f[2], name), nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, file)
		}
		counted++
		if n := exportedNames(files); n > maxExported {
			t.Errorf("%s exports %d names, more than %d: split it by role (DESIGN.md, Layout)", rel, n, maxExported)
		}
	}
	if counted < 10 {
		t.Fatalf("go list gave %d library packages, implausibly few:\n%s", counted, out)
	}
	// The counter itself counts what the limit is about.
	src := `package p
type T struct{}
type u struct{}
func (T) A() {}
func (*T) B() {}
func (u) C() {}
func D() {}
func e() {}
var V, w = 1, 2
const K = 1`
	file, err := parser.ParseFile(token.NewFileSet(), "p.go", src, 0)
	if err != nil {
		t.Fatal(err)
	}
	if n := exportedNames([]*ast.File{file}); n != 6 {
		t.Errorf("exportedNames counted %d names in the sample, want 6 (T, A, B, D, V, K)", n)
	}
}
