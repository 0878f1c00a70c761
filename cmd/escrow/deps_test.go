package main

import (
	"os/exec"
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
	"accounting":            {"balance", "migrations", "internal/startstop"},
	"middleware":            {"accounting", "balance"},
	"admin":                 {"accounting", "internal/csvcell"},
	".":                     {"accounting", "admin", "balance", "middleware", "migrations", "webhook"}, // the root package escrow: New
	"server":                {".", "accounting", "admin", "balance", "middleware", "migrations", "webhook"},
	"cmd/escrow":            {"server", "internal/csvcell"},
	"examples/proxy":        {"server", "internal/fakeupstream"},
	"bench":                 {"server", "internal/fakeupstream", "internal/testutil"},
	"balance/balancetest":   {"balance", "internal/testutil"},
	"accounting/ledgertest": {"accounting", "internal/testutil"},
	"webhook":               {"accounting"},
	"internal/fakeupstream": nil,
	"internal/testutil":     nil,
	"internal/startstop":    nil, // the one Start/Stop base of the worker, the recorder and the journal fallback
	"internal/modelcheck":   nil, // tests only: the SPIN model check and its replay
	"internal/csvcell":      nil, // CSV cells a spreadsheet will not run as formulas
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
	if bad := layerViolations(map[string][]string{"admin": {"middleware"}, "balance": {"accounting"}, "newpkg": nil}); len(bad) != 3 {
		t.Errorf("the checker missed a violation: %v", bad)
	}
}
