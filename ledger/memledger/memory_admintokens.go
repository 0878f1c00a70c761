package memledger

import (
	"context"
	"crypto/sha256"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
)

var _ access.Tokens = (*Ledger)(nil)

// memTokens is the memory ledger's admin tokens; Ledger.mu guards them.
type memTokens struct {
	byID   map[string]*memToken
	byHash map[[32]byte]*memToken
	order  []*memToken // by creation
}

type memToken struct {
	tok  access.Token
	hash [32]byte
}

func (m *Ledger) liveTokenLocked(t *memToken, now time.Time) bool {
	return t != nil && t.tok.RevokedAt == nil && (t.tok.ExpiresAt == nil || t.tok.ExpiresAt.After(now))
}

func now() time.Time { return time.Now().UTC().Truncate(time.Microsecond) }

func (m *Ledger) addTokenLocked(name, scope string) (access.Token, string) {
	if m.tokens.byID == nil {
		m.tokens.byID, m.tokens.byHash = map[string]*memToken{}, map[[32]byte]*memToken{}
	}
	id, secret := access.NewToken()
	t := &memToken{tok: access.Token{ID: id, Name: name, Scope: scope, CreatedAt: now()},
		hash: sha256.Sum256([]byte(secret))}
	m.tokens.byID[t.tok.ID], m.tokens.byHash[t.hash] = t, t
	m.tokens.order = append(m.tokens.order, t)
	return t.tok, secret
}

// CreateAdminToken makes a scoped admin token; its secret is not stored.
func (m *Ledger) CreateAdminToken(ctx context.Context, name, scope string) (access.Token, string, error) {
	if err := access.CheckScope(scope); err != nil {
		return access.Token{}, "", err
	}
	if err := ledger.CheckName(name); err != nil {
		return access.Token{}, "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	t, secret := m.addTokenLocked(name, scope)
	return t, secret, nil
}

// LookupAdminToken resolves a secret; unknown, revoked and expired tokens are
// ErrUnknownAdminToken.
func (m *Ledger) LookupAdminToken(ctx context.Context, secret string) (access.Token, error) {
	h := sha256.Sum256([]byte(secret))
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tokens.byHash[h]
	if !m.liveTokenLocked(t, time.Now()) {
		return access.Token{}, access.ErrUnknownToken
	}
	return t.tok, nil
}

// ListAdminTokens lists every token by creation.
func (m *Ledger) ListAdminTokens(ctx context.Context) ([]access.Token, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]access.Token, 0, len(m.tokens.order))
	for _, t := range m.tokens.order {
		out = append(out, t.tok)
	}
	return out, nil
}

// RotateAdminToken makes a successor of a live token and lets the old one expire after overlap.
func (m *Ledger) RotateAdminToken(ctx context.Context, id string, overlap time.Duration) (access.Token, string, error) {
	if overlap < 0 {
		return access.Token{}, "", fmt.Errorf("%w: negative overlap", ledger.ErrInvalidQuery)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	old := m.tokens.byID[id]
	n := now()
	if !m.liveTokenLocked(old, n) {
		return access.Token{}, "", fmt.Errorf("%w: %q", access.ErrUnknownToken, id)
	}
	next, secret := m.addTokenLocked(old.tok.Name, old.tok.Scope)
	exp := n.Add(overlap)
	if old.tok.ExpiresAt == nil || exp.Before(*old.tok.ExpiresAt) {
		old.tok.ExpiresAt = &exp
	}
	old.tok.RotatedTo = next.ID
	return next, secret, nil
}

// RevokeAdminToken ends a token at once.
func (m *Ledger) RevokeAdminToken(ctx context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.tokens.byID[id]
	if t == nil {
		return fmt.Errorf("%w: %q", access.ErrUnknownToken, id)
	}
	if t.tok.RevokedAt == nil {
		n := now()
		t.tok.RevokedAt = &n
	}
	return nil
}

// KeyOrg returns the org of an API key by id.
func (m *Ledger) KeyOrg(ctx context.Context, keyID string) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys[keyID]
	if k == nil {
		return "", fmt.Errorf("%w: %q", ledger.ErrUnknownKey, keyID)
	}
	return k.key.Org, nil
}

var _ access.KeyModels = (*Ledger)(nil)

// SetKeyModels sets a key's allow-list of models.
func (m *Ledger) SetKeyModels(ctx context.Context, keyID string, models []string) error {
	if err := access.CheckKeyModels(models); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	k := m.keys[keyID]
	if k == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, keyID)
	}
	if len(models) == 0 {
		k.key.Models = nil
	} else {
		k.key.Models = append([]string(nil), models...)
	}
	return nil
}

var _ access.OrgFlags = (*Ledger)(nil)

// SetOrgExempt sets or clears an org's exempt flag.
func (m *Ledger) SetOrgExempt(ctx context.Context, org string, exempt bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	a := m.accounts[org]
	if a == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	a.exempt = exempt
	return nil
}
