package main

import (
	"strings"
	"testing"
)

// TestCLITopUp: escrow topup set, show, attempts and delete through the admin API.
func TestCLITopUp(t *testing.T) {
	c, _ := startCLIProxy(t)
	c.ok("orgs", "create", "acme")
	if _, err := c.run("topup", "set", "acme", "--threshold", "x"); err == nil {
		t.Fatal("topup set without numbers succeeded")
	}
	c.ok("topup", "set", "acme", "--threshold", "5000000", "--amount", "2000", "--customer", "cus_1",
		"--payment-method", "pm_1", "--daily-cap", "4000", "--monthly-cap", "20000")
	out := c.ok("topup", "acme")
	for _, want := range []string{"THRESHOLD", "5000000", "cus_1", "pm_1", "usd", "20000"} {
		if !strings.Contains(out, want) {
			t.Fatalf("escrow topup acme lacks %q:\n%s", want, out)
		}
	}
	var shown struct {
		Org      string `json:"org"`
		Amount   int64  `json:"amount"`
		Attempts []any  `json:"attempts"`
	}
	c.json(&shown, "topup", "acme")
	if shown.Org != "acme" || shown.Amount != 2000 || shown.Attempts == nil {
		t.Fatalf("topup --json: %+v", shown)
	}
	if out := c.ok("topup", "attempts", "acme"); !strings.Contains(out, "STATUS") {
		t.Fatalf("attempts: %q", out)
	}
	c.ok("topup", "delete", "acme")
	if _, err := c.run("topup", "acme"); err == nil {
		t.Fatal("topup of an org without one succeeded")
	}
}
