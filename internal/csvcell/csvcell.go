// Package csvcell keeps the cells of escrow's CSV exports from being run as formulas when the
// file is opened in a spreadsheet (CSV injection).
package csvcell

// Safe returns s as a CSV cell a spreadsheet shows as text: a cell that starts with =, +, -,
// @, a tab or a carriage return gets a single quote in front, as OWASP advises, unless it is a
// plain decimal number ("-5", "+1.25"), which a spreadsheet reads as a number and never as a
// formula.
func Safe(s string) string {
	if s == "" {
		return s
	}
	switch s[0] {
	case '=', '+', '-', '@', '\t', '\r':
		if !decimal(s) {
			return "'" + s
		}
	}
	return s
}

// Row applies Safe to each cell of row, in place, and returns row.
func Row(row []string) []string {
	for i, s := range row {
		row[i] = Safe(s)
	}
	return row
}

// decimal reports whether s is a sign, digits, and optionally a point and more digits.
func decimal(s string) bool {
	if s[0] == '+' || s[0] == '-' {
		s = s[1:]
	}
	digits, point := 0, false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= '0' && c <= '9':
			digits++
		case c == '.' && !point && digits > 0 && i+1 < len(s):
			point = true
		default:
			return false
		}
	}
	return digits > 0
}
