// Package access is the ledger's roles for who may do what (issue 36, DESIGN.md "Two planes"):
// scoped admin tokens (besides the bootstrap token of the configuration, the admin API accepts
// tokens made through itself, each with one scope; only the SHA-256 of a secret is stored), keys
// limited to models, and exempt orgs. It is split from package ledger by role; memledger and
// pgledger implement its interfaces and ledgertest checks them.
package access

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// TokenPrefix starts every admin token secret.
const TokenPrefix = "esc-adm-"

// Sentinel errors of admin tokens.
var (
	// ErrUnknownToken: no such token, or revoked, or past its expiry.
	ErrUnknownToken = errors.New("access: unknown admin token")
)

// Token is a scoped admin API token as listed; the secret is never kept.
type Token struct {
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

// NewToken is a new admin token's id and secret (TokenPrefix and 32 random bytes).
func NewToken() (id, secret string) {
	return "adm_" + ledger.RandomHex(12), TokenPrefix + ledger.RandomHex(32)
}

// Tokens is the role interface of a ledger that keeps scoped admin tokens (both ledgers
// implement it).
type Tokens interface {
	// CreateAdminToken makes a token with a display name and a scope (1 to 200 bytes; what a
	// scope allows is the admin API's business: admin.CheckScope); the secret is returned once.
	CreateAdminToken(ctx context.Context, name, scope string) (Token, string, error)
	// LookupAdminToken resolves a secret: unknown, revoked and expired tokens are
	// ErrUnknownToken.
	LookupAdminToken(ctx context.Context, secret string) (Token, error)
	// ListAdminTokens lists every token by creation, revoked and expired ones included.
	ListAdminTokens(ctx context.Context) ([]Token, error)
	// RotateAdminToken makes a successor of a live token (same name and scope) and lets the old
	// one expire after overlap (an earlier expiry is kept; 0 ends it at once). Unknown, revoked or
	// expired: ErrUnknownToken.
	RotateAdminToken(ctx context.Context, id string, overlap time.Duration) (Token, string, error)
	// RevokeAdminToken ends a token at once (ErrUnknownToken; revoking twice is fine).
	RevokeAdminToken(ctx context.Context, id string) error
	// KeyOrg returns the org of an API key by id, revoked keys included (ledger.ErrUnknownKey): what
	// an org:<id> token's check needs on the routes named by a key.
	KeyOrg(ctx context.Context, keyID string) (string, error)
}

// CheckScope checks what a ledger stores as a scope: 1 to 200 bytes (ledger.ErrInvalidQuery).
func CheckScope(scope string) error {
	if scope == "" || len(scope) > ledger.MaxNameLen {
		return fmt.Errorf("%w: an admin token scope has 1 to %d bytes", ledger.ErrInvalidQuery, ledger.MaxNameLen)
	}
	return nil
}
