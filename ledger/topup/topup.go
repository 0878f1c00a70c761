// Package topup is the ledger's role for money coming in: each org's auto top-up settings and
// attempts, and the org a payment was credited to. It is split from package ledger by role (as
// DESIGN.md "Layout" asks of a package that grows); memledger and pgledger implement Store.
package topup

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// Store is the ledger side of money coming in (DESIGN.md "Money in"): each org's auto
// top-up settings and attempts, and which org a processor's payment was credited to. Both
// ledgers implement it and pass the same conformance suite (ledgertest); nothing here speaks to
// a processor. A ledger without it has no auto top-up (the payment package checks).
type Store interface {
	// PutTopUp creates or replaces the org's top-up settings (ledger.ErrUnknownOrg, ErrInvalid).
	// Replacing them clears Stopped: a declined charge stops further tries until the settings
	// are updated.
	PutTopUp(ctx context.Context, s Settings) (Settings, error)
	// TopUp returns the org's settings (ErrNoSettings).
	TopUp(ctx context.Context, org string) (Settings, error)
	// DeleteTopUp removes the org's settings (ErrNoSettings); its attempts stay on record.
	DeleteTopUp(ctx context.Context, org string) error
	// TopUpOrgs lists the orgs whose top-up may start (settings present, not stopped).
	TopUpOrgs(ctx context.Context) ([]string, error)
	// OrgOfCustomer is the org whose top-up settings name the processor's customer
	// (ErrNoSettings when none does).
	OrgOfCustomer(ctx context.Context, customer string) (string, error)

	// BeginTopUp starts a top-up attempt of the org at now, atomically with its checks, so that
	// any number of callers in any number of processes start at most one: ErrNoSettings,
	// ErrStopped, ErrNotNeeded (the ledger balance is not below the threshold),
	// ErrInFlight (an attempt is pending and has its payment), ErrCap (the amount
	// would pass the daily or monthly cap, counting the attempts pending or succeeded that
	// started in now's UTC day and month). A pending attempt whose payment was never made (the
	// processor did not answer) is returned again, with its own id, for the caller to retry
	// with the same idempotency key.
	BeginTopUp(ctx context.Context, org string, now time.Time) (Attempt, error)
	// SetTopUpPayment records the processor's payment id of a pending attempt
	// (ErrUnknownAttempt).
	SetTopUpPayment(ctx context.Context, id, payment string) error
	// FinishTopUp ends a pending attempt: succeeded, or failed with a reason, which also stops
	// the org's top-ups (Settings.Stopped) until its settings are updated. Finishing an
	// attempt that has ended already changes nothing and returns it as it is (ErrUnknownAttempt).
	FinishTopUp(ctx context.Context, id string, succeeded bool, reason string, now time.Time) (Attempt, error)
	// TopUpAttempts lists the org's attempts, newest first, at most limit (≤ 0: 100).
	TopUpAttempts(ctx context.Context, org string, limit int) ([]Attempt, error)

	// CreditOrg is the org of the credit entry with reference ref (ErrUnknownReference): how
	// a refund or a dispute of a payment finds the org that payment was credited to.
	CreditOrg(ctx context.Context, ref string) (string, error)
}

// Sentinel errors of Store.
var (
	ErrNoSettings       = errors.New("accounting: no top-up settings")
	ErrInvalid          = errors.New("accounting: invalid top-up settings")
	ErrUnknownAttempt   = errors.New("accounting: unknown top-up attempt")
	ErrStopped          = errors.New("accounting: top-ups stopped until the settings are updated")
	ErrNotNeeded        = errors.New("accounting: balance not below the top-up threshold")
	ErrInFlight         = errors.New("accounting: a top-up is in flight")
	ErrCap              = errors.New("accounting: top-up cap reached")
	ErrUnknownReference = errors.New("accounting: unknown reference")
)

// Settings are an org's auto top-up: when a charge leaves its ledger balance below
// Threshold, Amount (in the smallest unit of Currency) is charged to Customer's PaymentMethod
// and credited when the processor confirms the payment (at the configured rate of Currency).
type Settings struct {
	Org           string `json:"org"`
	Threshold     int64  `json:"threshold"` // micro-units of ledger balance
	Amount        int64  `json:"amount"`    // charged per top-up, smallest currency unit (cents)
	Currency      string `json:"currency"`  // ISO code, lower case ("usd")
	Customer      string `json:"customer"`  // the processor's customer (Stripe: cus_…)
	PaymentMethod string `json:"payment_method"`
	DailyCap      int64  `json:"daily_cap"`   // most charged per UTC day, smallest currency unit
	MonthlyCap    int64  `json:"monthly_cap"` // most charged per UTC calendar month
	// Stopped says why top-ups stopped (a declined charge); "" when they may run. Only
	// PutTopUp clears it.
	Stopped   string    `json:"stopped,omitempty"`
	UpdatedAt time.Time `json:"updated_at"`
}

// Status is where an attempt stands.
type Status string

// Attempt statuses.
const (
	Pending   Status = "pending"   // started; credited only by the processor's webhook
	Succeeded Status = "succeeded" // the payment's webhook credited it
	Failed    Status = "failed"    // declined: the org's top-ups are stopped
)

// Attempt is one top-up. Its ID is the processor's idempotency key.
type Attempt struct {
	ID         string     `json:"id"`
	Org        string     `json:"org"`
	Amount     int64      `json:"amount"`
	Currency   string     `json:"currency"`
	Status     Status     `json:"status"`
	Payment    string     `json:"payment,omitempty"` // the processor's payment id once made
	Reason     string     `json:"reason,omitempty"`  // why it failed
	CreatedAt  time.Time  `json:"created_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
}

// NewAttemptID is a new attempt id (and idempotency key).
func NewAttemptID() string { return "tu_" + ledger.RandomHex(16) }

// Check validates settings and returns them normalized (currency in lower case).
func Check(s Settings) (Settings, error) {
	if err := balance.ValidateOrg(s.Org); err != nil {
		return s, err
	}
	s.Currency = strings.ToLower(strings.TrimSpace(s.Currency))
	bad := func(format string, args ...any) (Settings, error) {
		return s, fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
	}
	switch {
	case s.Threshold < -balance.MaxAmount || s.Threshold > balance.MaxAmount:
		return bad("threshold %d outside ±%d", s.Threshold, balance.MaxAmount)
	case s.Amount <= 0 || s.Amount > balance.MaxAmount:
		return bad("amount must be in (0, %d]", balance.MaxAmount)
	case len(s.Currency) != 3 || strings.Trim(s.Currency, "abcdefghijklmnopqrstuvwxyz") != "":
		return bad("currency must be a three-letter ISO code")
	case !token(s.Customer) || !token(s.PaymentMethod):
		return bad("customer and payment_method are required (letters, digits, _ and -)")
	case s.DailyCap < s.Amount || s.MonthlyCap < s.Amount:
		return bad("daily_cap and monthly_cap must each allow at least one amount")
	case s.DailyCap > s.MonthlyCap:
		return bad("daily_cap must not exceed monthly_cap")
	case s.MonthlyCap > balance.MaxAmount:
		return bad("monthly_cap above %d", balance.MaxAmount)
	}
	return s, nil
}

// token: a processor id (1–255 characters of letters, digits, '_' and '-').
func token(s string) bool {
	if s == "" || len(s) > 255 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// Windows are the starts of now's UTC day and calendar month, the windows the caps count.
func Windows(now time.Time) (day, month time.Time) {
	day, _ = balance.Day.Bounds(now)
	month, _ = balance.Month.Bounds(now)
	return day, month
}
