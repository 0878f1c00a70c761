// Package testutil holds the helpers the tests share: isolated Redis and Postgres namespaces,
// private servers, and a TCP fault proxy.
//
// Environment:
//
//	ESCROW_TEST_REDIS_URL     a real Redis; tests get their own random key prefix on it
//	ESCROW_TEST_DATABASE_URL  a real Postgres; tests get their own fresh schema in it
//	ESCROW_REQUIRE_SERVICES=1 a configured service that does not answer fails the test instead of skipping it
//
// With neither URL set, Redis tests run on miniredis and Postgres tests are skipped (the
// memory ledger still runs the shared suites), so a plain `go test ./...` passes on a laptop.
package testutil

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
)

// RequireServices reports whether a missing service must fail the test (CI) rather than skip it.
func RequireServices() bool { return os.Getenv("ESCROW_REQUIRE_SERVICES") == "1" }

// unavailable skips or fails the test, depending on RequireServices.
func unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if RequireServices() {
		tb.Fatalf("required service unavailable: "+format, args...)
	}
	tb.Skipf("service unavailable: "+format, args...)
}

// RandomName returns prefix followed by 12 random hex digits.
func RandomName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}
