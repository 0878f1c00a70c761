package ledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/llmescrow/escrow/balance"
)

// Scoped admin tokens (issue 36, DESIGN.md "Two planes"): besides the bootstrap token of the
// configuration, the admin API accepts tokens made through itself, each with one scope. Only the
// SHA-256 of a token's secret is stored.

// Admin token scopes. A scope is ScopeRead, ScopeAdmin or ScopeOrgPrefix followed by an org id.
const (
	// ScopeRead reads everything (every GET) and writes nothing.
	ScopeRead = "read"
	// ScopeAdmin does everything, tokens included.
	ScopeAdmin = "admin"
	// ScopeOrgPrefix starts the scope of one org: its keys, limits, usage and credits only.
	ScopeOrgPrefix = "org:"
)

// AdminTokenPrefix starts every admin token secret.
const AdminTokenPrefix = "esc-adm-"

// Sentinel errors of admin tokens.
var (
	// ErrUnknownAdminToken: no such token, or revoked, or past its expiry.
	ErrUnknownAdminToken = errors.New("accounting: unknown admin token")
	// ErrInvalidScope: a scope that is not read, admin or org:<valid org id>.
	ErrInvalidScope = errors.New("accounting: invalid admin token scope")
	// ErrNoAdminTokens: the ledger keeps no admin tokens (only the bootstrap token works).
	ErrNoAdminTokens = errors.New("accounting: the ledger has no admin tokens")
)

// AdminToken is a scoped admin API token as listed; the secret is never kept.
type AdminToken struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Scope     string    `json:"scope"`
	CreatedAt time.Time `json:"created_at"`
	// ExpiresAt is set on a rotated token: it stays valid until then, alongside its successor.
	ExpiresAt *time.Time `json:"expires_at"`
	RevokedAt *time.Time `json:"revoked_at"`
	// RotatedTo is the id of the token that replaced this one ("" for none).
	RotatedTo string `json:"rotated_to,omitempty"`
}

// ScopeOrg returns the org of an org:<id> scope ("" for read and admin).
func ScopeOrg(scope string) string {
	org, _ := strings.CutPrefix(scope, ScopeOrgPrefix)
	if org == scope {
		return ""
	}
	return org
}

// CheckScope validates an admin token scope (ErrInvalidScope).
func CheckScope(scope string) error {
	switch scope {
	case ScopeRead, ScopeAdmin:
		return nil
	}
	org, ok := strings.CutPrefix(scope, ScopeOrgPrefix)
	if !ok {
		return fmt.Errorf("%w: %q (read, admin or org:<id>)", ErrInvalidScope, scope)
	}
	if err := balance.ValidateOrg(org); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidScope, err)
	}
	return nil
}

// NewAdminTokenID is a new admin token id.
func NewAdminTokenID() string { return "adm_" + RandomHex(12) }

// NewAdminTokenSecret is a new admin token secret: AdminTokenPrefix and 32 random bytes.
func NewAdminTokenSecret() string { return AdminTokenPrefix + RandomHex(32) }

// AdminTokens is the role interface of a ledger that keeps scoped admin tokens (both ledgers
// implement it).
type AdminTokens interface {
	// CreateAdminToken makes a token with a display name and a scope (ErrInvalidScope); the
	// secret is returned once.
	CreateAdminToken(ctx context.Context, name, scope string) (AdminToken, string, error)
	// LookupAdminToken resolves a secret: unknown, revoked and expired tokens are
	// ErrUnknownAdminToken.
	LookupAdminToken(ctx context.Context, secret string) (AdminToken, error)
	// ListAdminTokens lists every token by creation, revoked and expired ones included.
	ListAdminTokens(ctx context.Context) ([]AdminToken, error)
	// RotateAdminToken makes a successor of a live token (same name and scope) and lets the old
	// one expire after overlap (an earlier expiry is kept; 0 ends it at once). Unknown, revoked or
	// expired: ErrUnknownAdminToken.
	RotateAdminToken(ctx context.Context, id string, overlap time.Duration) (AdminToken, string, error)
	// RevokeAdminToken ends a token at once (ErrUnknownAdminToken; revoking twice is fine).
	RevokeAdminToken(ctx context.Context, id string) error
	// KeyOrg returns the org of an API key by id, revoked keys included (ErrUnknownKey): what
	// an org:<id> token's check needs on the routes named by a key.
	KeyOrg(ctx context.Context, keyID string) (string, error)
}
