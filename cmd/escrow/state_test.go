package main

import (
	"os"
	"testing"
)

// TestMain gives the tests a state directory of their own: the proxy's default journal
// (ESCROW_JOURNAL_DIR=auto) goes under it, never under the machine's ~/.local/state.
func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "escrow-state-")
	if err != nil {
		panic(err)
	}
	os.Unsetenv("STATE_DIRECTORY")
	os.Setenv("XDG_STATE_HOME", dir)
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}
