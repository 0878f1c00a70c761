//go:build race

package accounting_test

// raceEnabled: the race detector slows the simulation about fourfold; under it the default step
// count drops, and `make test` runs the full 10,000 steps in a separate run without it.
const raceEnabled = true
