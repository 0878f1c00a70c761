package admin

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger/access"
)

// setExempt sets or clears the org's exempt flag (PATCH /orgs/:org {"exempt": true}): an exempt
// org's requests are metered and charged but never held nor refused for balance. Every process
// applies it within its key cache's TTL. It answers only a refusal (the response is then
// committed).
func (a *API) setExempt(c echo.Context, exempt bool) error {
	of, ok := a.console.(access.OrgFlags)
	if !ok {
		return writeError(c, apiError{status: http.StatusNotImplemented, typ: typeInvalid, code: "exempt_unsupported", msg: "the ledger cannot exempt orgs"})
	}
	if err := of.SetOrgExempt(c.Request().Context(), c.Param("org"), exempt); err != nil {
		return a.fail(c, err)
	}
	return nil
}
