package admin

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
)

// Scoped admin tokens (issue 36): the bootstrap token of Config.Token is an admin; tokens made
// through POST /tokens carry one scope each (ScopeRead, ScopeAdmin or
// "org:<id>"), are stored hashed, rotated with an overlap and revoked. Authenticate and
// Authorize are the seam other front ends (the web console) call to apply the same rules.

// Admin token scopes. A scope is ScopeRead, ScopeAdmin or ScopeOrgPrefix followed by an org id.
const (
	// ScopeRead reads everything (every GET) and writes nothing.
	ScopeRead = "read"
	// ScopeAdmin does everything, tokens included.
	ScopeAdmin = "admin"
	// ScopeOrgPrefix starts the scope of one org: its keys, limits, usage and credits only.
	ScopeOrgPrefix = "org:"
)

// ErrInvalidScope: a scope that is not read, admin or org:<valid org id>.
var ErrInvalidScope = errors.New("admin: invalid admin token scope")

// ScopeOrg returns the org of an org:<id> scope ("" for read and admin).
func ScopeOrg(scope string) string {
	org, ok := strings.CutPrefix(scope, ScopeOrgPrefix)
	if !ok {
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

// DefaultRotationOverlap is how long a rotated token stays valid beside its successor when the
// rotation names no overlap.
const DefaultRotationOverlap = 24 * time.Hour

// Errors of Authenticate and Authorize.
var (
	// ErrUnauthorized: no token, or one that is unknown, revoked or expired (401).
	ErrUnauthorized = errors.New("admin: missing or wrong admin token")
	// ErrForbidden: the token's scope does not allow the route (403).
	ErrForbidden = errors.New("admin: the token's scope does not allow this")
	// ErrOtherOrg: an org token on another org's route (answered 404, like an org that does not
	// exist, so an org token learns nothing of other orgs).
	ErrOtherOrg = errors.New("admin: not found")
)

// Principal is who an admin request authenticated as.
type Principal struct {
	TokenID string // "" for the bootstrap token
	Name    string
	Scope   string // ScopeRead, ScopeAdmin or "org:<id>"
}

// Bootstrap reports whether p is the bootstrap token of the configuration.
func (p Principal) Bootstrap() bool { return p.TokenID == "" }

// orgRoutes are the routes an org:<id> token may call (on its own org, and on keys of its org):
// the org's keys, limits, usage and credits. Freezes, adjustments, models, webhooks, epochs,
// tokens and the audit trail are not among them.
var orgRoutes = map[string]bool{
	"GET /orgs/:org":                      true,
	"GET /orgs/:org/balance":              true,
	"GET /orgs/:org/keys":                 true,
	"POST /orgs/:org/keys":                true,
	"GET /orgs/:org/entries":              true,
	"GET /orgs/:org/usage":                true,
	"POST /orgs/:org/credits":             true,
	"POST /orgs/:org/projects":            true,
	"GET /orgs/:org/limits":               true,
	"POST /orgs/:org/limits":              true,
	"PATCH /orgs/:org/limits/:id":         true,
	"DELETE /orgs/:org/limits/:id":        true,
	"GET /orgs/:org/limits/:id/end_users": true,
	"PATCH /keys/:id":                     true,
	"DELETE /keys/:id":                    true,
	"PUT /keys/:id/project":               true,
	"PUT /keys/:id/models":                true,
	"GET /orgs/:org/jobs":                 true, // its background responses and batches
}

// Authenticate resolves a bearer secret: the bootstrap token (compared in constant time) or a
// live scoped token of the ledger. ErrUnauthorized for anything else; a ledger that cannot be
// reached is its own error (ledger.ErrLedgerUnavailable), never a 401.
func (a *API) Authenticate(ctx context.Context, secret string) (Principal, error) {
	if secret == "" {
		return Principal{}, ErrUnauthorized
	}
	if subtle.ConstantTimeCompare([]byte(secret), a.token) == 1 {
		return Principal{Name: "admin", Scope: ScopeAdmin}, nil
	}
	if a.tokens == nil || !strings.HasPrefix(secret, access.TokenPrefix) {
		return Principal{}, ErrUnauthorized
	}
	t, err := a.tokens.LookupAdminToken(ctx, secret)
	if errors.Is(err, access.ErrUnknownToken) {
		return Principal{}, ErrUnauthorized
	}
	if err != nil {
		return Principal{}, err
	}
	return Principal{TokenID: t.ID, Name: t.Name, Scope: t.Scope}, nil
}

// Authorize says whether p may call the route (its path relative to the admin group, as
// registered: "/orgs/:org/keys") with method; param reads the route's parameters. nil,
// ErrForbidden, ErrOtherOrg, or the ledger's error when a key's org could not be read.
func (a *API) Authorize(ctx context.Context, p Principal, method, route string, param func(string) string) error {
	switch {
	case p.Scope == ScopeAdmin:
		return nil
	case p.Scope == ScopeRead:
		if method == http.MethodGet || method == http.MethodHead {
			return nil
		}
		return ErrForbidden
	}
	org := ScopeOrg(p.Scope)
	if org == "" {
		return ErrForbidden
	}
	m := method
	if m == http.MethodHead {
		m = http.MethodGet
	}
	if !orgRoutes[m+" "+route] {
		return ErrForbidden
	}
	if o := param("org"); o != "" {
		if o != org {
			return ErrOtherOrg
		}
		return nil
	}
	if strings.HasPrefix(route, "/keys/:id") {
		ko, err := a.tokens.KeyOrg(ctx, param("id"))
		if errors.Is(err, ledger.ErrUnknownKey) || (err == nil && ko != org) {
			return ErrOtherOrg
		}
		return err
	}
	return ErrForbidden
}

const principalKey = "escrow.admin.principal"

// PrincipalOf returns who the request authenticated as (set by the admin routes' check).
func PrincipalOf(c echo.Context) (Principal, bool) {
	p, ok := c.Get(principalKey).(Principal)
	return p, ok
}

// authFor is the token check of one route: authenticate, then authorize for the route.
func (a *API) authFor(method, route string) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			secret, _ := strings.CutPrefix(c.Request().Header.Get(echo.HeaderAuthorization), "Bearer ")
			ctx := c.Request().Context()
			p, err := a.Authenticate(ctx, secret)
			if err == nil {
				err = a.Authorize(ctx, p, method, route, c.Param)
			}
			switch {
			case err == nil:
				c.Set(principalKey, p)
				return next(c)
			case errors.Is(err, ErrUnauthorized):
				return writeError(c, apiError{status: http.StatusUnauthorized, typ: typeInvalid, code: "invalid_admin_token", msg: "missing or wrong admin token"})
			case errors.Is(err, ErrForbidden):
				return writeError(c, apiError{status: http.StatusForbidden, typ: typeInvalid, code: "insufficient_scope",
					msg: fmt.Sprintf("the token's scope (%s) does not allow %s %s", p.Scope, method, route)})
			case errors.Is(err, ErrOtherOrg):
				return writeError(c, apiError{status: http.StatusNotFound, typ: typeInvalid, code: "not_found", msg: "not found"})
			}
			return a.fail(c, err)
		}
	}
}

// Token is a new or rotated admin token with its secret (shown once).
type Token struct {
	storedToken
	Token string `json:"token"`
}

// Info is the token as listed (without its secret).
func (t Token) Info() access.Token { return t.storedToken }

// storedToken names the listed token embedded in Token (whose own Token is the secret).
type storedToken = access.Token

func (a *API) tokenStore(c echo.Context) (access.Tokens, error) {
	if a.tokens == nil {
		return nil, writeError(c, apiError{status: http.StatusNotImplemented, typ: typeInvalid, code: "tokens_unsupported", msg: "the ledger keeps no admin tokens"})
	}
	return a.tokens, nil
}

// listTokens: GET /tokens.
func (a *API) listTokens(c echo.Context) error {
	ts, err := a.tokenStore(c)
	if ts == nil {
		return err
	}
	list, err := ts.ListAdminTokens(c.Request().Context())
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, list, "", []string{"id", "name", "scope", "created_at", "expires_at", "revoked_at", "rotated_to"},
		func(t access.Token) []string {
			return []string{t.ID, t.Name, t.Scope, t.CreatedAt.Format(time.RFC3339), timePtr(t.ExpiresAt), timePtr(t.RevokedAt), t.RotatedTo}
		})
}

func timePtr(t *time.Time) string {
	if t == nil {
		return ""
	}
	return t.Format(time.RFC3339)
}

// createToken: POST /tokens {"name", "scope"}.
func (a *API) createToken(c echo.Context) error {
	ts, err := a.tokenStore(c)
	if ts == nil {
		return err
	}
	var req struct {
		Name  string `json:"name"`
		Scope string `json:"scope"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if err := CheckScope(req.Scope); err != nil {
		return a.fail(c, err)
	}
	t, secret, err := ts.CreateAdminToken(c.Request().Context(), req.Name, req.Scope)
	if err != nil {
		return a.fail(c, err)
	}
	c.Set(auditDetail, fmt.Sprintf(`{"id":%q,"name":%q,"scope":%q}`, t.ID, t.Name, t.Scope))
	return writeJSON(c, http.StatusCreated, Token{storedToken: t, Token: secret})
}

// rotateToken: POST /tokens/:id/rotate {"overlap_seconds"} — a successor; the old token stays
// valid for the overlap (default Config.RotationOverlap).
func (a *API) rotateToken(c echo.Context) error {
	ts, err := a.tokenStore(c)
	if ts == nil {
		return err
	}
	var req struct {
		OverlapSeconds *int64 `json:"overlap_seconds"`
	}
	if c.Request().ContentLength != 0 {
		if err := bind(c, &req); err != nil || c.Response().Committed {
			return err
		}
	}
	overlap := a.overlap
	if req.OverlapSeconds != nil {
		if *req.OverlapSeconds < 0 || *req.OverlapSeconds > 365*24*3600 {
			return invalid(c, "overlap_seconds must be between 0 and a year")
		}
		overlap = time.Duration(*req.OverlapSeconds) * time.Second
	}
	t, secret, err := ts.RotateAdminToken(c.Request().Context(), c.Param("id"), overlap)
	if err != nil {
		return a.fail(c, err)
	}
	c.Set(auditDetail, fmt.Sprintf(`{"successor":%q,"overlap_seconds":%d}`, t.ID, int64(overlap/time.Second)))
	return writeJSON(c, http.StatusCreated, Token{storedToken: t, Token: secret})
}

// revokeToken: DELETE /tokens/:id.
func (a *API) revokeToken(c echo.Context) error {
	ts, err := a.tokenStore(c)
	if ts == nil {
		return err
	}
	if err := ts.RevokeAdminToken(c.Request().Context(), c.Param("id")); err != nil {
		return a.fail(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}

// ID names the principal in the audit trail: the token's name and id, or "admin" for the
// bootstrap token.
func (p Principal) ID() string {
	switch {
	case p.Bootstrap():
		return "admin"
	case p.Name != "":
		return p.Name + " (" + p.TokenID + ")"
	}
	return p.TokenID
}
