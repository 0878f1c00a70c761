package pgledger

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
)

var _ access.Tokens = (*Ledger)(nil)

const sqlAdminTokenColumns = `id, name, scope, created_at, expires_at, revoked_at, COALESCE(rotated_to, '')`

func scanAdminToken(r pgx.CollectableRow) (access.Token, error) {
	var t access.Token
	err := r.Scan(&t.ID, &t.Name, &t.Scope, &t.CreatedAt, &t.ExpiresAt, &t.RevokedAt, &t.RotatedTo)
	t.CreatedAt, t.ExpiresAt, t.RevokedAt = t.CreatedAt.UTC(), utcPtr(t.ExpiresAt), utcPtr(t.RevokedAt)
	return t, err
}

// CreateAdminToken makes a scoped admin token; only the SHA-256 of the secret is stored.
func (p *Ledger) CreateAdminToken(ctx context.Context, name, scope string) (access.Token, string, error) {
	if err := access.CheckScope(scope); err != nil {
		return access.Token{}, "", err
	}
	if err := ledger.CheckName(name); err != nil {
		return access.Token{}, "", err
	}
	return p.insertAdminToken(ctx, p.pool, name, scope)
}

type queryRower interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

func (p *Ledger) insertAdminToken(ctx context.Context, q queryRower, name, scope string) (access.Token, string, error) {
	id, secret := access.NewToken()
	h := sha256.Sum256([]byte(secret))
	rows, _ := q.Query(ctx, `INSERT INTO admin_tokens (id, hash, name, scope) VALUES ($1, $2, $3, $4)
RETURNING `+sqlAdminTokenColumns, id, h[:], name, scope)
	t, err := pgx.CollectExactlyOneRow(rows, scanAdminToken)
	if err != nil {
		return access.Token{}, "", wrapPg("create admin token", err)
	}
	return t, secret, nil
}

// LookupAdminToken resolves a secret; unknown, revoked and expired tokens (by the database's
// clock) are ErrUnknownAdminToken.
func (p *Ledger) LookupAdminToken(ctx context.Context, secret string) (access.Token, error) {
	h := sha256.Sum256([]byte(secret))
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlAdminTokenColumns+` FROM admin_tokens
WHERE hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())`, h[:])
	t, err := pgx.CollectExactlyOneRow(rows, scanAdminToken)
	if errors.Is(err, pgx.ErrNoRows) {
		return access.Token{}, access.ErrUnknownToken
	}
	return t, wrapPg("lookup admin token", err)
}

// ListAdminTokens lists every token by creation.
func (p *Ledger) ListAdminTokens(ctx context.Context) ([]access.Token, error) {
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlAdminTokenColumns+` FROM admin_tokens ORDER BY created_at, id`)
	ts, err := pgx.CollectRows(rows, scanAdminToken)
	return ts, wrapPg("list admin tokens", err)
}

// RotateAdminToken makes a successor of a live token and sets the old one's expiry to now +
// overlap (an earlier expiry is kept), in one transaction.
func (p *Ledger) RotateAdminToken(ctx context.Context, id string, overlap time.Duration) (access.Token, string, error) {
	if overlap < 0 {
		return access.Token{}, "", fmt.Errorf("%w: negative overlap", ledger.ErrInvalidQuery)
	}
	var (
		next   access.Token
		secret string
	)
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		var name, scope string
		err := tx.QueryRow(ctx, `SELECT name, scope FROM admin_tokens
WHERE id = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now()) FOR UPDATE`, id).Scan(&name, &scope)
		if errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("%w: %q", access.ErrUnknownToken, id)
		}
		if err != nil {
			return err
		}
		if next, secret, err = p.insertAdminToken(ctx, tx, name, scope); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE admin_tokens SET rotated_to = $2,
expires_at = LEAST(COALESCE(expires_at, 'infinity'), now() + make_interval(secs => $3)) WHERE id = $1`,
			id, next.ID, overlap.Seconds())
		return err
	})
	if err != nil {
		if errors.Is(err, access.ErrUnknownToken) {
			return access.Token{}, "", err
		}
		return access.Token{}, "", wrapPg("rotate admin token", err)
	}
	return next, secret, nil
}

// RevokeAdminToken ends a token at once.
func (p *Ledger) RevokeAdminToken(ctx context.Context, id string) error {
	var ok bool
	err := p.pool.QueryRow(ctx, `WITH u AS (UPDATE admin_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM u)`, id).Scan(&ok)
	if err != nil {
		return wrapPg("revoke admin token", err)
	}
	if !ok {
		return fmt.Errorf("%w: %q", access.ErrUnknownToken, id)
	}
	return nil
}

// KeyOrg returns the org of an API key by id.
func (p *Ledger) KeyOrg(ctx context.Context, keyID string) (string, error) {
	var org string
	err := p.pool.QueryRow(ctx, `SELECT org_id FROM api_keys WHERE id = $1`, keyID).Scan(&org)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("%w: %q", ledger.ErrUnknownKey, keyID)
	}
	return org, wrapPg("key org", err)
}

var _ access.KeyModels = (*Ledger)(nil)

// SetKeyModels sets a key's allow-list of models (NULL for every model).
func (p *Ledger) SetKeyModels(ctx context.Context, keyID string, models []string) error {
	if err := access.CheckKeyModels(models); err != nil {
		return err
	}
	if len(models) == 0 {
		models = nil
	}
	return p.updateExisting(ctx, "set key models", ledger.ErrUnknownKey, keyID, `
WITH u AS (UPDATE api_keys SET models = $2 WHERE id = $1 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM u)`, keyID, models)
}

var _ access.OrgFlags = (*Ledger)(nil)

// SetOrgExempt sets or clears an org's exempt flag.
func (p *Ledger) SetOrgExempt(ctx context.Context, org string, exempt bool) error {
	return p.updateExisting(ctx, "set org exempt", ledger.ErrUnknownOrg, org, `
WITH u AS (UPDATE accounts SET exempt = $2 WHERE org_id = $1 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM u)`, org, exempt)
}
