package csvcell

import "testing"

func TestSafe(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                     "",
		"acme":                 "acme",
		"=HYPERLINK(\"x\")":    "'=HYPERLINK(\"x\")",
		"+cmd|' /C calc'!A0":   "'+cmd|' /C calc'!A0",
		"-2+3":                 "'-2+3",
		"@SUM(A1)":             "'@SUM(A1)",
		"\t=1":                 "'\t=1",
		"\r=1":                 "'\r=1",
		"-5":                   "-5",
		"+1.25":                "+1.25",
		"-":                    "'-",
		"-1.":                  "'-1.",
		"-.5":                  "'-.5",
		"-1e5":                 "'-1e5",
		"2026-01-01T00:00:00Z": "2026-01-01T00:00:00Z",
		"a=b":                  "a=b",
	} {
		if got := Safe(in); got != want {
			t.Errorf("Safe(%q) = %q, want %q", in, got, want)
		}
	}
}
