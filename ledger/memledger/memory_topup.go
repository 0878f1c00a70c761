package memledger

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

var _ ledger.Payments = (*Ledger)(nil)

// memTopUps is the memory ledger's top-up state; Ledger.mu guards it.
type memTopUps struct {
	settings map[string]ledger.TopUpSettings // by org
	attempts []*ledger.TopUpAttempt          // by creation
}

// PutTopUp creates or replaces the org's settings and clears Stopped.
func (m *Ledger) PutTopUp(ctx context.Context, s ledger.TopUpSettings) (ledger.TopUpSettings, error) {
	s, err := ledger.CheckTopUp(s)
	if err != nil {
		return s, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.accounts[s.Org]; !ok {
		return s, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, s.Org)
	}
	if m.topups.settings == nil {
		m.topups.settings = map[string]ledger.TopUpSettings{}
	}
	s.Stopped, s.UpdatedAt = "", time.Now().UTC()
	m.topups.settings[s.Org] = s
	return s, nil
}

// TopUp returns the org's settings.
func (m *Ledger) TopUp(ctx context.Context, org string) (ledger.TopUpSettings, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.topups.settings[org]
	if !ok {
		return s, fmt.Errorf("%w: %q", ledger.ErrNoTopUp, org)
	}
	return s, nil
}

// DeleteTopUp removes the org's settings.
func (m *Ledger) DeleteTopUp(ctx context.Context, org string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.topups.settings[org]; !ok {
		return fmt.Errorf("%w: %q", ledger.ErrNoTopUp, org)
	}
	delete(m.topups.settings, org)
	return nil
}

// TopUpOrgs lists the orgs whose top-ups may start.
func (m *Ledger) TopUpOrgs(ctx context.Context) ([]string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for org, s := range m.topups.settings {
		if s.Stopped == "" {
			out = append(out, org)
		}
	}
	slices.Sort(out)
	return out, nil
}

// OrgOfCustomer is the org whose settings name customer.
func (m *Ledger) OrgOfCustomer(ctx context.Context, customer string) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	found := ""
	for org, s := range m.topups.settings {
		if s.Customer == customer && (found == "" || org < found) {
			found = org // the first org by id, as pgledger answers
		}
	}
	if found == "" {
		return "", fmt.Errorf("%w: customer %q", ledger.ErrNoTopUp, customer)
	}
	return found, nil
}

// BeginTopUp starts an attempt under the ledger's lock (its transaction).
func (m *Ledger) BeginTopUp(ctx context.Context, org string, now time.Time) (ledger.TopUpAttempt, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.topups.settings[org]
	if !ok {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: %q", ledger.ErrNoTopUp, org)
	}
	if s.Stopped != "" {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: %s", ledger.ErrTopUpStopped, s.Stopped)
	}
	day, month := ledger.TopUpWindows(now)
	var daySum, monthSum int64
	for _, a := range m.topups.attempts {
		if a.Org != org {
			continue
		}
		if a.Status == ledger.TopUpPending {
			if a.Payment == "" {
				return *a, nil // never made: retried with the same idempotency key
			}
			return ledger.TopUpAttempt{}, fmt.Errorf("%w: %s", ledger.ErrTopUpInFlight, a.ID)
		}
		if a.Status == ledger.TopUpSucceeded && !a.CreatedAt.Before(month) {
			monthSum += a.Amount
			if !a.CreatedAt.Before(day) {
				daySum += a.Amount
			}
		}
	}
	acct := m.accounts[org]
	if acct == nil {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	if acct.balance >= s.Threshold {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: balance %d, threshold %d", ledger.ErrTopUpNotNeeded, acct.balance, s.Threshold)
	}
	if daySum+s.Amount > s.DailyCap || monthSum+s.Amount > s.MonthlyCap {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: %d today of %d, %d this month of %d, next %d",
			ledger.ErrTopUpCap, daySum, s.DailyCap, monthSum, s.MonthlyCap, s.Amount)
	}
	a := &ledger.TopUpAttempt{ID: ledger.NewTopUpID(), Org: org, Amount: s.Amount, Currency: s.Currency,
		Status: ledger.TopUpPending, CreatedAt: now.UTC()}
	m.topups.attempts = append(m.topups.attempts, a)
	return *a, nil
}

func (m *Ledger) attempt(id string) *ledger.TopUpAttempt {
	for _, a := range m.topups.attempts {
		if a.ID == id {
			return a
		}
	}
	return nil
}

// topUpFailedData is a topup.failed event's data.
type topUpFailedData struct {
	Attempt  string `json:"attempt"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Payment  string `json:"payment"`
	Reason   string `json:"reason"`
}

// SetTopUpPayment records a pending attempt's payment id.
func (m *Ledger) SetTopUpPayment(ctx context.Context, id, payment string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.attempt(id)
	if a == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownTopUp, id)
	}
	if a.Status == ledger.TopUpPending {
		a.Payment = payment
	}
	return nil
}

// FinishTopUp ends a pending attempt; a failure stops the org's top-ups.
func (m *Ledger) FinishTopUp(ctx context.Context, id string, succeeded bool, reason string, now time.Time) (ledger.TopUpAttempt, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.attempt(id)
	if a == nil {
		return ledger.TopUpAttempt{}, fmt.Errorf("%w: %q", ledger.ErrUnknownTopUp, id)
	}
	if a.Status != ledger.TopUpPending {
		return *a, nil
	}
	at := now.UTC()
	a.FinishedAt = &at
	if succeeded {
		a.Status = ledger.TopUpSucceeded
		return *a, nil
	}
	a.Status, a.Reason = ledger.TopUpFailed, reason
	if s, ok := m.topups.settings[a.Org]; ok {
		s.Stopped = "attempt " + a.ID + " failed: " + reason
		m.topups.settings[a.Org] = s
	}
	m.hooks.emit(ledger.EventTopUpFailed, a.Org, topUpFailedData{Attempt: a.ID, Amount: a.Amount, Currency: a.Currency,
		Payment: a.Payment, Reason: a.Reason})
	return *a, nil
}

// TopUpAttempts lists the org's attempts, newest first.
func (m *Ledger) TopUpAttempts(ctx context.Context, org string, limit int) ([]ledger.TopUpAttempt, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = 100
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []ledger.TopUpAttempt
	for i := len(m.topups.attempts) - 1; i >= 0 && len(out) < limit; i-- {
		if a := m.topups.attempts[i]; a.Org == org {
			out = append(out, *a)
		}
	}
	return out, nil
}

// CreditOrg is the org of the credit with reference ref.
func (m *Ledger) CreditOrg(ctx context.Context, ref string) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.refs[refKey{ledger.KindCredit, ref}]
	if !ok || ref == "" {
		return "", fmt.Errorf("%w: %q", ledger.ErrUnknownReference, ref)
	}
	return e.Org, nil
}
