package admin

import (
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger/topup"
)

// The answers of the auto top-up routes' errors, after the shared ones.
func init() {
	refusals = append(refusals,
		refusal{topup.ErrNoSettings, http.StatusNotFound, "topup_not_found", "the org has no auto top-up"},
		refusal{topup.ErrInvalid, http.StatusBadRequest, "invalid_value", ""},
		refusal{accounting.ErrNoPayments, http.StatusNotImplemented, "payments_unsupported", ""},
	)
}

// registerTopUp adds the auto top-up routes (docs/payments.md): GET (settings and latest
// attempts), PUT (create or replace; clears a stop after a declined charge) and DELETE.
func (a *API) registerTopUp(add func(method, path string, h echo.HandlerFunc)) {
	add(http.MethodGet, "/orgs/:org/topup", read(a, "org", a.ops.TopUp))
	add(http.MethodPut, "/orgs/:org/topup", a.putTopUp)
	add(http.MethodDelete, "/orgs/:org/topup", a.deleteTopUp)
}

// TopUpRequest is PUT /orgs/:org/topup's body: topup.Settings without the org (the path's)
// and the fields the ledger keeps.
type TopUpRequest struct {
	Threshold     int64  `json:"threshold"`
	Amount        int64  `json:"amount"`
	Currency      string `json:"currency"`
	Customer      string `json:"customer"`
	PaymentMethod string `json:"payment_method"`
	DailyCap      int64  `json:"daily_cap"`
	MonthlyCap    int64  `json:"monthly_cap"`
}

func (a *API) putTopUp(c echo.Context) error {
	var req TopUpRequest
	if err := bind(c, &req); err != nil {
		return err
	}
	s, err := a.ops.PutTopUp(c.Request().Context(), topup.Settings{
		Org: c.Param("org"), Threshold: req.Threshold, Amount: req.Amount, Currency: req.Currency, Customer: req.Customer,
		PaymentMethod: req.PaymentMethod, DailyCap: req.DailyCap, MonthlyCap: req.MonthlyCap,
	})
	return a.answer(c, s, err)
}

func (a *API) deleteTopUp(c echo.Context) error {
	if err := a.ops.DeleteTopUp(c.Request().Context(), c.Param("org")); err != nil {
		return a.fail(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}
