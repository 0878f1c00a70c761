package ledger

// The checks and helpers both ledgers (memory.go, postgres.go) share, so that neither reaches
// into the other's file.

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"maps"
	"time"

	"github.com/google/uuid"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
)

// KeyPrefix starts every API key secret.
const KeyPrefix = "sk-esc-"

const (
	DefaultLimit       = 1000 // a batch's size when the caller asks for none (limit ≤ 0)
	SubscriptionBuffer = 1024 // orgs a ledger's subscription holds before it drops notes
)

// NormalizeEvent checks a usage event and returns it with its ID in canonical UUID form and a
// CreatedAt (now when unset).
func NormalizeEvent(ev UsageEvent) (UsageEvent, error) {
	id, err := uuid.Parse(ev.ID)
	if err != nil {
		return ev, fmt.Errorf("%w: event id %q is not a UUID", pricing.ErrInvalidUsage, ev.ID)
	}
	ev.ID = id.String()
	if err := balance.ValidateOrg(ev.Org); err != nil {
		return ev, fmt.Errorf("%w: event %s: %w", pricing.ErrInvalidUsage, ev.ID, err)
	}
	if ev.Model == "" {
		return ev, fmt.Errorf("%w: event %s has no model", pricing.ErrInvalidUsage, ev.ID)
	}
	if err := ev.Usage.Check(); err != nil {
		return ev, fmt.Errorf("%w: event %s: %w", pricing.ErrInvalidUsage, ev.ID, err)
	}
	ev.Usage.Units = maps.Clone(ev.Usage.Units) // a ledger keeps no map its caller may change
	if ev.Cost < 0 || ev.Cost > balance.MaxAmount || ev.HoldAmount < 0 || ev.HoldAmount > balance.MaxAmount {
		return ev, fmt.Errorf("%w: event %s: cost %d or hold %d outside [0, %d]", ErrInvalidAmount, ev.ID, ev.Cost, ev.HoldAmount, balance.MaxAmount)
	}
	if ev.CreatedAt.IsZero() {
		ev.CreatedAt = time.Now()
	}
	// Postgres keeps microseconds; so does the memory ledger, so both order events alike.
	ev.CreatedAt = ev.CreatedAt.Round(0).Truncate(time.Microsecond)
	if !ev.ReservedAt.IsZero() { // a Redis clock reading: whole milliseconds, kept exactly
		ev.ReservedAt = ev.ReservedAt.Round(0).Truncate(time.Millisecond).UTC()
	}
	return ev, nil
}

// ValidateModel refuses a model with no name, a price or amount outside [0, balance.MaxAmount]
// or a negative token limit.
func ValidateModel(m Model) error {
	if m.Name == "" {
		return fmt.Errorf("%w: empty model name", ErrInvalidAmount)
	}
	if err := m.Prices.Check(); err != nil {
		return fmt.Errorf("%w: model %q: %w", ErrInvalidAmount, m.Name, err)
	}
	for _, v := range []int64{m.MaxCost, m.DefaultHold} {
		if v < 0 || v > balance.MaxAmount {
			return fmt.Errorf("%w: model %q: amount %d outside [0, %d]", ErrInvalidAmount, m.Name, v, balance.MaxAmount)
		}
	}
	if m.MaxInputTokens < 0 || m.MaxOutputTokens < 0 {
		return fmt.Errorf("%w: model %q: negative token limit", ErrInvalidAmount, m.Name)
	}
	return nil
}

// RandomHex is n random bytes, hex-encoded.
func RandomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func NewKeyID() string { return "key_" + RandomHex(12) }

// NewSecret is a new API key secret: KeyPrefix and 32 random bytes.
func NewSecret() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return KeyPrefix + base64.RawURLEncoding.EncodeToString(b)
}
