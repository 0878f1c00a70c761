package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Scoped admin tokens (issue 36, DESIGN.md "Two planes"): besides the bootstrap token of the
// configuration, the admin API accepts tokens made through itself, each with one scope. Only the
// SHA-256 of a token's secret is stored.

// AdminTokenPrefix starts every admin token secret.
const AdminTokenPrefix = "esc-adm-"

// Sentinel errors of admin tokens.
var (
	// ErrUnknownAdminToken: no such token, or revoked, or past its expiry.
	ErrUnknownAdminToken = errors.New("accounting: unknown admin token")
)

// AdminToken is a scoped admin API token as listed; the secret is never kept.
type AdminToken struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Scope     string    `json:"scope"` // read, admin or org:<id> (admin.CheckScope)
	CreatedAt time.Time `json:"created_at"`
	// ExpiresAt is set on a rotated token: it stays valid until then, alongside its successor.
	ExpiresAt *time.Time `json:"expires_at"`
	RevokedAt *time.Time `json:"revoked_at"`
	// RotatedTo is the id of the token that replaced this one ("" for none).
	RotatedTo string `json:"rotated_to,omitempty"`
}

// NewAdminToken is a new admin token's id and secret (AdminTokenPrefix and 32 random bytes).
func NewAdminToken() (id, secret string) {
	return "adm_" + RandomHex(12), AdminTokenPrefix + RandomHex(32)
}

// AdminTokens is the role interface of a ledger that keeps scoped admin tokens (both ledgers
// implement it).
type AdminTokens interface {
	// CreateAdminToken makes a token with a display name and a scope (1 to 200 bytes; what a
	// scope allows is the admin API's business: admin.CheckScope); the secret is returned once.
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

// CheckTokenScope checks what a ledger stores as a scope: 1 to 200 bytes (ErrInvalidQuery).
func CheckTokenScope(scope string) error {
	if scope == "" || len(scope) > MaxNameLen {
		return fmt.Errorf("%w: an admin token scope has 1 to %d bytes", ErrInvalidQuery, MaxNameLen)
	}
	return nil
}
