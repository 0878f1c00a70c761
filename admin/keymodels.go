package admin

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger/access"
)

// KeyModels is the answer of PUT /keys/:id/models.
type KeyModels struct {
	ID     string   `json:"id"`
	Models []string `json:"models"`
}

// setKeyModels: PUT /keys/:id/models {"models": ["gpt-4o-mini", "claude-*"]} limits a key to
// those models (names, or prefixes ending in '*'); [] or null lifts the limit. Every process
// applies it within its key cache's TTL.
func (a *API) setKeyModels(c echo.Context) error {
	km, ok := a.console.(access.KeyModels)
	if !ok {
		return writeError(c, apiError{status: http.StatusNotImplemented, typ: typeInvalid, code: "key_models_unsupported", msg: "the ledger cannot limit keys to models"})
	}
	var req struct {
		Models []string `json:"models"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if err := km.SetKeyModels(c.Request().Context(), c.Param("id"), req.Models); err != nil {
		return a.fail(c, err)
	}
	if req.Models == nil {
		req.Models = []string{}
	}
	return writeJSON(c, http.StatusOK, KeyModels{ID: c.Param("id"), Models: req.Models})
}
