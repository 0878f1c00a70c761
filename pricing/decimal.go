package pricing

import (
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strconv"
	"strings"

	"github.com/llmescrow/escrow/balance"
)

// ErrInvalidDecimal is wrapped by the errors of DecimalMicros.
var ErrInvalidDecimal = errors.New("pricing: invalid decimal")

// decimalText is a non-negative decimal: digits, an optional fraction, an optional exponent
// (JSON's number grammar without the sign, leading zeros allowed).
var decimalText = regexp.MustCompile(`^([0-9]+)(?:\.([0-9]+))?(?:[eE]([+-]?[0-9]{1,4}))?$`)

// maxDecimalText bounds the text DecimalMicros reads, so that no number makes a huge big.Int.
const maxDecimalText = 64

// DecimalMicros is the one rule that turns a price written as a decimal into micro-units: it
// returns the value of the decimal text s ("0.15", "1.5e-07"; digits, an optional fraction,
// an optional exponent, no sign) times 10^shift, as a whole number within [0, 10^14]. The text
// is read digit by digit, never through a float. When the product is not whole it is rounded
// up if up is set (never under-charge; exact is then false) and an error otherwise.
//
// Shifts in use: 6 for currency units → micro-units (1 unit = 1,000,000 micro-units; "0.15"
// per 1M tokens is 150,000), and 12 for currency units per token → micro-units per 1,000,000
// tokens (1.5e-07 per token is 150,000).
func DecimalMicros(s string, shift int, up bool) (v int64, exact bool, err error) {
	if len(s) > maxDecimalText {
		return 0, false, fmt.Errorf("%w: %.20q… is longer than %d characters", ErrInvalidDecimal, s, maxDecimalText)
	}
	m := decimalText.FindStringSubmatch(s)
	if m == nil {
		return 0, false, fmt.Errorf("%w: %q is not a plain non-negative decimal such as 0.15 or 1.5e-07", ErrInvalidDecimal, s)
	}
	exp := 0
	if m[3] != "" {
		exp, _ = strconv.Atoi(m[3]) // at most 4 digits: cannot fail
	}
	// value = digits × 10^(exp − len(fraction)); times 10^shift.
	digits, _ := new(big.Int).SetString(m[1]+m[2], 10)
	e := exp - len(m[2]) + shift
	n := new(big.Int)
	exact = true
	switch {
	case digits.Sign() == 0:
	case e >= 0:
		if len(strings.TrimLeft(m[1]+m[2], "0"))+e > 20 { // far above 10^14 whatever the digits
			return 0, false, fmt.Errorf("%w: %q is above 10^14 micro-units", ErrInvalidDecimal, s)
		}
		n.Mul(digits, new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(e)), nil))
	case -e > len(m[1]+m[2])+1: // below one micro-unit: 0 with a remainder
		exact = false
	default:
		var r big.Int
		n.QuoRem(digits, new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(-e)), nil), &r)
		exact = r.Sign() == 0
	}
	if !exact {
		if !up {
			return 0, false, fmt.Errorf("%w: %q is not a whole number of micro-units", ErrInvalidDecimal, s)
		}
		n.Add(n, big.NewInt(1))
	}
	if n.Cmp(big.NewInt(balance.MaxAmount)) > 0 {
		return 0, false, fmt.Errorf("%w: %q is above 10^14 micro-units", ErrInvalidDecimal, s)
	}
	return n.Int64(), exact, nil
}
