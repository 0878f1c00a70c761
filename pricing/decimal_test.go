package pricing_test

import (
	"errors"
	"testing"

	"github.com/llmescrow/escrow/pricing"
)

// TestDecimalMicros: prices written as decimals become whole micro-units exactly, from their
// text (never a float); a fraction of a micro-unit rounds up, or is an error when exactness is
// required.
func TestDecimalMicros(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in    string
		shift int
		want  int64
		exact bool
	}{
		// LiteLLM: currency units per token → micro-units per 1M tokens (shift 12).
		{"1.5e-07", 12, 150_000, true},
		{"2.5e-06", 12, 2_500_000, true},
		{"0.00001", 12, 10_000_000, true},
		{"1e-05", 12, 10_000_000, true},
		{"1E-5", 12, 10_000_000, true},
		{"1.25e-05", 12, 12_500_000, true},
		{"5.46875e-07", 12, 546_875, true},
		{"2.1875e-06", 12, 2_187_500, true},
		{"0", 12, 0, true},
		{"0.0", 12, 0, true},
		{"0e-999", 12, 0, true},
		{"3e-12", 12, 3, true},
		{"1.1e-13", 12, 1, false},               // 0.11 micro-units: rounded up to 1
		{"1.0000001e-06", 12, 1_000_001, false}, // 1,000,000.1 → 1,000,001
		{"3.333333333333e-07", 12, 333_334, false},
		{"1e-30", 12, 1, false},
		{"7e+1", 12, 70_000_000_000_000, true},
		{"0.00000000000000000000000000001", 12, 1, false},
		// Currency units → micro-units (shift 6).
		{"0.15", 6, 150_000, true},
		{"2", 6, 2_000_000, true},
		{"0.0000001", 6, 1, false},
		{"100000000", 6, 100_000_000_000_000, true},
		{"00.5", 6, 500_000, true},
	} {
		got, exact, err := pricing.DecimalMicros(tc.in, tc.shift, true)
		if err != nil || got != tc.want || exact != tc.exact {
			t.Errorf("%s (shift %d): %d exact=%v %v, want %d exact=%v", tc.in, tc.shift, got, exact, err, tc.want, tc.exact)
		}
		got, _, err = pricing.DecimalMicros(tc.in, tc.shift, false)
		if tc.exact != (err == nil) || (err == nil && got != tc.want) {
			t.Errorf("%s exactly: %d %v", tc.in, got, err)
		}
	}
	for _, in := range []string{"", "-1e-6", "+1", "1.", ".5", "1e", "0x10", "1,5", "NaN", "Infinity", "1e99999", " 1", "100000000.000001",
		"1e15", "99999999999999999999999", "1" + string(make([]byte, 70))} {
		if got, _, err := pricing.DecimalMicros(in, 6, true); err == nil || !errors.Is(err, pricing.ErrInvalidDecimal) {
			t.Errorf("%q: %d %v, want ErrInvalidDecimal", in, got, err)
		}
	}
	// The largest value: 10^14 micro-units; one more is refused, also when rounded up to it.
	if v, _, err := pricing.DecimalMicros("1e-4", 18, true); err != nil || v != 100_000_000_000_000 {
		t.Errorf("10^14: %d %v", v, err)
	}
	if _, _, err := pricing.DecimalMicros("100000000000000.1", 0, true); err == nil {
		t.Error("10^14 + a fraction rounded up: accepted")
	}
}
