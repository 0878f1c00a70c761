package main

import (
	"os"
	"testing"

	"github.com/llmescrow/escrow/internal/testutil"
)

// TestMain runs the tests with a state directory of their own (testutil.RunWithStateDir).
func TestMain(m *testing.M) { os.Exit(testutil.RunWithStateDir(m)) }
