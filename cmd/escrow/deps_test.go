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
