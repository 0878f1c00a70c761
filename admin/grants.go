package admin

import (
	"errors"
	"net/http"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger/grant"
)

// The answers of the grants' errors, after the shared ones.
func init() {
	refusals = append(refusals,
		refusal{grant.ErrInvalid, http.StatusBadRequest, "invalid_value", ""},
		refusal{accounting.ErrNoGrants, http.StatusNotImplemented, "grants_unsupported", ""},
	)
}

// registerGrants adds GET /orgs/:org/grants (docs/grants.md): the org's grants in spending order,
// the expired last. A credit with terms is POST /orgs/:org/credits with expires_at or priority.
func (a *API) registerGrants(add func(method, path string, h echo.HandlerFunc)) {
	add(http.MethodGet, "/orgs/:org/grants", a.listGrants)
}

func (a *API) listGrants(c echo.Context) error {
	gs, err := a.ops.Grants(c.Request().Context(), c.Param("org"))
	if err != nil {
		return a.fail(c, err)
	}
	if gs == nil {
		gs = []grant.Grant{}
	}
	return writeJSON(c, http.StatusOK, Page[grant.Grant]{Data: gs}) // one page: an org has few grants
}

// creditRequest is POST /orgs/:org/credits: a payment, and optionally its grant terms (a
// priority, 0 promotional … 100 paid, the default; an expiry, RFC 3339, in the future).
type creditRequest struct {
	Amount    *int64     `json:"amount"`
	Reference string     `json:"reference"`
	ExpiresAt *time.Time `json:"expires_at"`
	Priority  *int       `json:"priority"`
}

// credit: POST /orgs/:org/credits, a payment (amount > 0), maybe a grant that expires or comes
// first.
func (a *API) credit(c echo.Context) error {
	var req creditRequest
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Amount == nil || *req.Amount <= 0 || req.Reference == "" {
		return invalid(c, "amount (> 0, micro-units) and reference are required")
	}
	terms := grant.Paid
	if req.Priority != nil {
		terms.Priority = *req.Priority
	}
	if req.ExpiresAt != nil {
		terms.ExpiresAt = *req.ExpiresAt
	}
	ctx := c.Request().Context()
	e, created, err := a.ops.CreditGrant(ctx, c.Param("org"), *req.Amount, req.Reference, terms)
	if errors.Is(err, accounting.ErrNoGrants) && terms == grant.Paid {
		e, created, err = a.ops.Credit(ctx, c.Param("org"), *req.Amount, req.Reference)
	}
	if err != nil && !errors.Is(err, accounting.ErrHotBalance) {
		return a.fail(c, err)
	}
	return writeJSON(c, entryStatus(c, created, err), e)
}
