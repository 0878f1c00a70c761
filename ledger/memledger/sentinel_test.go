package memledger

import (
	"context"
	"errors"
	"testing"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// TestSentinelsShareBalanceRules: an amount or org refused by the ledger is the same refusal as
// balance's, so a caller tests one sentinel whichever layer answered.
func TestSentinelsShareBalanceRules(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	m := New()
	if err := m.CreateOrg(ctx, "o"); err != nil {
		t.Fatal(err)
	}
	_, _, err := m.Credit(ctx, "o", 0, "zero")
	if !errors.Is(err, ledger.ErrInvalidAmount) || !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("credit of 0: %v; want both ErrInvalidAmount sentinels", err)
	}
	_, _, err = m.Credit(ctx, "o", balance.MaxAmount+1, "huge")
	if !errors.Is(err, ledger.ErrInvalidAmount) || !errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("credit above MaxAmount: %v; want both ErrInvalidAmount sentinels", err)
	}
	_, err = m.Account(ctx, "nobody")
	if !errors.Is(err, ledger.ErrUnknownOrg) || !errors.Is(err, balance.ErrUnknownOrg) {
		t.Fatalf("account of an unknown org: %v; want both ErrUnknownOrg sentinels", err)
	}
	if errors.Is(err, balance.ErrInvalidAmount) {
		t.Fatalf("unknown org matched the amount sentinel: %v", err)
	}
}
