package memledger

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
)

var _ topup.Store = (*Ledger)(nil)

// memTopUps is the memory ledger's top-up state; Ledger.mu guards it.
type memTopUps struct {
	settings map[string]topup.Settings // by org
	attempts []*topup.Attempt          // by creation
}

// PutTopUp creates or replaces the org's settings and clears Stopped.
func (m *Ledger) PutTopUp(ctx context.Context, s topup.Settings) (topup.Settings, error) {
	s, err := topup.Check(s)
	if err != nil {
		return s, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.accounts[s.Org]; !ok {
		return s, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, s.Org)
	}
	if m.topups.settings == nil {
		m.topups.settings = map[string]topup.Settings{}
	}
	s.Stopped, s.UpdatedAt = "", time.Now().UTC()
	m.topups.settings[s.Org] = s
	return s, nil
}

// TopUp returns the org's settings.
func (m *Ledger) TopUp(ctx context.Context, org string) (topup.Settings, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.topups.settings[org]
	if !ok {
		return s, fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
	}
	return s, nil
}

// DeleteTopUp removes the org's settings.
func (m *Ledger) DeleteTopUp(ctx context.Context, org string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.topups.settings[org]; !ok {
		return fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
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
		return "", fmt.Errorf("%w: customer %q", topup.ErrNoSettings, customer)
	}
	return found, nil
}

// BeginTopUp starts an attempt under the ledger's lock (its transaction).
func (m *Ledger) BeginTopUp(ctx context.Context, org string, now time.Time) (topup.Attempt, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.topups.settings[org]
	if !ok {
		return topup.Attempt{}, fmt.Errorf("%w: %q", topup.ErrNoSettings, org)
	}
	if s.Stopped != "" {
		return topup.Attempt{}, fmt.Errorf("%w: %s", topup.ErrStopped, s.Stopped)
	}
	day, month := topup.Windows(now)
	var daySum, monthSum int64
	for _, a := range m.topups.attempts {
		if a.Org != org {
			continue
		}
		if a.Status == topup.Pending {
			if a.Payment == "" {
				return *a, nil // never made: retried with the same idempotency key
			}
			return topup.Attempt{}, fmt.Errorf("%w: %s", topup.ErrInFlight, a.ID)
		}
		if a.Status == topup.Succeeded && !a.CreatedAt.Before(month) {
			monthSum += a.Amount
			if !a.CreatedAt.Before(day) {
				daySum += a.Amount
			}
		}
	}
	acct := m.accounts[org]
	if acct == nil {
		return topup.Attempt{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	if acct.balance >= s.Threshold {
		return topup.Attempt{}, fmt.Errorf("%w: balance %d, threshold %d", topup.ErrNotNeeded, acct.balance, s.Threshold)
	}
	if daySum+s.Amount > s.DailyCap || monthSum+s.Amount > s.MonthlyCap {
		return topup.Attempt{}, fmt.Errorf("%w: %d today of %d, %d this month of %d, next %d",
			topup.ErrCap, daySum, s.DailyCap, monthSum, s.MonthlyCap, s.Amount)
	}
	a := &topup.Attempt{ID: topup.NewAttemptID(), Org: org, Amount: s.Amount, Currency: s.Currency,
		Status: topup.Pending, CreatedAt: now.UTC()}
	m.topups.attempts = append(m.topups.attempts, a)
	return *a, nil
}

func (m *Ledger) attempt(id string) *topup.Attempt {
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
		return fmt.Errorf("%w: %q", topup.ErrUnknownAttempt, id)
	}
	if a.Status == topup.Pending {
		a.Payment = payment
	}
	return nil
}

// FinishTopUp ends a pending attempt; a failure stops the org's top-ups.
func (m *Ledger) FinishTopUp(ctx context.Context, id string, succeeded bool, reason string, now time.Time) (topup.Attempt, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.attempt(id)
	if a == nil {
		return topup.Attempt{}, fmt.Errorf("%w: %q", topup.ErrUnknownAttempt, id)
	}
	if a.Status != topup.Pending {
		return *a, nil
	}
	at := now.UTC()
	a.FinishedAt = &at
	if succeeded {
		a.Status = topup.Succeeded
		return *a, nil
	}
	a.Status, a.Reason = topup.Failed, reason
	if s, ok := m.topups.settings[a.Org]; ok {
		s.Stopped = "attempt " + a.ID + " failed: " + reason
		m.topups.settings[a.Org] = s
	}
	m.hooks.emit(ledger.EventTopUpFailed, a.Org, topUpFailedData{Attempt: a.ID, Amount: a.Amount, Currency: a.Currency,
		Payment: a.Payment, Reason: a.Reason})
	return *a, nil
}

// TopUpAttempts lists the org's attempts, newest first.
func (m *Ledger) TopUpAttempts(ctx context.Context, org string, limit int) ([]topup.Attempt, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = 100
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []topup.Attempt
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
		return "", fmt.Errorf("%w: %q", topup.ErrUnknownReference, ref)
	}
	return e.Org, nil
}
