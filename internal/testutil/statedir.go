package testutil

import (
	"os"
	"testing"
)

// RunWithStateDir runs a package's tests (a TestMain's m.Run) with a state directory of their
// own: a proxy's default journal (ESCROW_JOURNAL_DIR=auto) goes under it, never under the
// machine's ~/.local/state. It returns m.Run's exit code.
func RunWithStateDir(m *testing.M) int {
	dir, err := os.MkdirTemp("", "escrow-state-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	os.Unsetenv("STATE_DIRECTORY")
	os.Setenv("XDG_STATE_HOME", dir)
	return m.Run()
}
