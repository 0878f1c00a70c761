//go:build !race

package accounting_test

const raceEnabled = false
