// Package modelcheck holds the tests that tie escrow's Promela model (docs/model/escrow.pml) to
// the code: TestModelCheck runs SPIN on the intact model (no counterexample may exist) and on one
// mutation per rule (each must yield one), and TestReplay replays every mutation's counterexample
// as calls to the real Lua scripts through balance.Store on miniredis, with the memory ledger,
// asserting the invariant after each step. It has no non-test code.
package modelcheck
