package main

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/middleware"
)

// adminAPI serves /admin/v1: orgs, credits, balances, keys, models, reconciliation.
type adminAPI struct {
	token  string
	ledger accounting.Ledger
	store  *balance.Store
	worker *accounting.Worker
}

func (a *adminAPI) register(e *echo.Echo) {
	g := e.Group("/admin/v1", a.auth)
	g.POST("/orgs", a.createOrg)
	g.POST("/orgs/:org/credits", a.credit)
	g.POST("/orgs/:org/adjustments", a.adjust)
	g.GET("/orgs/:org/balance", a.balance)
	g.POST("/orgs/:org/reconcile", a.reconcile)
	g.POST("/orgs/:org/keys", a.createKey)
	g.DELETE("/keys/:id", a.revokeKey)
	g.PUT("/models/:model", a.putModel)
	g.GET("/models", a.models)
	g.POST("/ledger/epoch", a.raiseEpoch)
}

// writeError answers with an OpenAI-shaped error, the same shape and writer the middleware uses.
func writeError(c echo.Context, status int, typ, code, msg string) error {
	return middleware.WriteError(c, &middleware.Error{Status: status, Type: typ, Code: code, Message: msg})
}

// unavailable answers 503 with Retry-After.
func unavailable(c echo.Context, code, msg string) error {
	return middleware.WriteError(c, &middleware.Error{Status: http.StatusServiceUnavailable,
		Type: middleware.TypeServiceUnavailable, Code: code, Message: msg, RetryAfter: time.Second})
}

func (a *adminAPI) auth(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		h := c.Request().Header.Get(echo.HeaderAuthorization)
		tok, ok := strings.CutPrefix(h, "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(tok), []byte(a.token)) != 1 {
			return writeError(c, http.StatusUnauthorized, "invalid_request_error", "invalid_admin_token", "missing or wrong admin token")
		}
		return next(c)
	}
}

// ledgerError maps ledger errors to OpenAI-shaped responses.
func ledgerError(c echo.Context, err error) error {
	switch {
	case errors.Is(err, accounting.ErrUnknownOrg):
		return writeError(c, http.StatusNotFound, "invalid_request_error", "org_not_found", "no such org")
	case errors.Is(err, accounting.ErrOrgExists):
		return writeError(c, http.StatusConflict, "invalid_request_error", "org_exists", "the org already exists")
	case errors.Is(err, accounting.ErrReferenceConflict):
		return writeError(c, http.StatusConflict, "invalid_request_error", "reference_conflict", "this reference was already used for another credit")
	case errors.Is(err, accounting.ErrUnknownKey):
		return writeError(c, http.StatusNotFound, "invalid_request_error", "key_not_found", "no such key")
	case errors.Is(err, accounting.ErrUnknownModel):
		return writeError(c, http.StatusNotFound, "invalid_request_error", "model_not_found", "no such model")
	case errors.Is(err, balance.ErrInvalidOrg), errors.Is(err, accounting.ErrInvalidAmount),
		errors.Is(err, balance.ErrInvalidAmount), errors.Is(err, accounting.ErrCostOverflow):
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_value", err.Error())
	case errors.Is(err, accounting.ErrLedgerUnavailable):
		return unavailable(c, "ledger_unavailable", "the ledger is unavailable")
	default:
		c.Logger().Error(err)
		return writeError(c, http.StatusInternalServerError, "server_error", "internal_error", "internal error")
	}
}

func bind(c echo.Context, v any) error {
	dec := jsonDecoder(c.Request())
	if err := dec.Decode(v); err != nil {
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_json", "invalid JSON body: "+err.Error())
	}
	return nil
}

func (a *adminAPI) createOrg(c echo.Context) error {
	var req struct {
		ID string `json:"id"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if err := a.ledger.CreateOrg(c.Request().Context(), req.ID); err != nil {
		return ledgerError(c, err)
	}
	return c.JSON(http.StatusCreated, map[string]string{"id": req.ID})
}

type moneyRequest struct {
	Amount    *int64 `json:"amount"`
	Reference string `json:"reference"`
}

func (a *adminAPI) credit(c echo.Context) error {
	var req moneyRequest
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Amount == nil || *req.Amount <= 0 || req.Reference == "" {
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_value", "amount (> 0, micro-units) and reference are required")
	}
	e, created, err := a.worker.Credit(c.Request().Context(), c.Param("org"), *req.Amount, req.Reference)
	if err != nil && e.Seq == 0 {
		return ledgerError(c, err)
	}
	if err != nil { // durable, but the hot balance lags: say so, the worker applies it later
		c.Response().Header().Set("x-escrow-warning", "credit recorded; hot balance update pending")
	}
	status := http.StatusOK
	if created {
		status = http.StatusCreated
	}
	return c.JSON(status, e)
}

func (a *adminAPI) adjust(c echo.Context) error {
	var req moneyRequest
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Amount == nil || *req.Amount == 0 || req.Reference == "" {
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_value", "amount (≠ 0, micro-units) and reference are required")
	}
	ctx := c.Request().Context()
	e, created, err := a.ledger.Adjust(ctx, c.Param("org"), *req.Amount, req.Reference)
	if err != nil {
		return ledgerError(c, err)
	}
	if err := a.worker.SettleOrg(ctx, c.Param("org")); err != nil {
		a.worker.Notify(c.Param("org"))
	}
	status := http.StatusOK
	if created {
		status = http.StatusCreated
	}
	return c.JSON(status, e)
}

func (a *adminAPI) balance(c echo.Context) error {
	ctx := c.Request().Context()
	org := c.Param("org")
	acct, err := a.ledger.Account(ctx, org)
	if err != nil {
		return ledgerError(c, err)
	}
	st, err := a.store.State(ctx, org)
	if err == nil && !st.Exists {
		if err = a.store.Warm(ctx, org); err == nil {
			st, err = a.store.State(ctx, org)
		}
	}
	if err != nil {
		return unavailable(c, "redis_unavailable", "the hot balance is unavailable")
	}
	return c.JSON(http.StatusOK, map[string]any{
		"org":            org,
		"ledger_balance": acct.Balance,
		"available":      st.Balance,
		"held":           st.Held,
		"holds":          st.Holds,
		"ledger_seq":     acct.LedgerSeq,
		"settled_seq":    acct.SettledSeq,
		"watermark":      st.Watermark,
	})
}

func (a *adminAPI) reconcile(c echo.Context) error {
	d, err := a.worker.Reconcile(c.Request().Context(), c.Param("org"))
	if err != nil {
		return ledgerError(c, err)
	}
	return c.JSON(http.StatusOK, d)
}

func (a *adminAPI) createKey(c echo.Context) error {
	k, secret, err := a.ledger.CreateKey(c.Request().Context(), c.Param("org"))
	if err != nil {
		return ledgerError(c, err)
	}
	return c.JSON(http.StatusCreated, map[string]string{"id": k.ID, "org": k.Org, "key": secret})
}

func (a *adminAPI) revokeKey(c echo.Context) error {
	if err := a.ledger.RevokeKey(c.Request().Context(), c.Param("id")); err != nil {
		return ledgerError(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}

func (a *adminAPI) putModel(c echo.Context) error {
	var m accounting.Model
	if err := bind(c, &m); err != nil || c.Response().Committed {
		return err
	}
	m.Name = c.Param("model")
	if m.Input < 0 || m.CachedInput < 0 || m.Output < 0 || m.MaxCost < 0 || m.DefaultHold < 0 ||
		m.MaxInputTokens < 0 || m.MaxOutputTokens < 0 {
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_value", "prices, limits and holds must be ≥ 0")
	}
	if m.MaxCost > balance.MaxAmount || m.DefaultHold > balance.MaxAmount {
		return writeError(c, http.StatusBadRequest, "invalid_request_error", "invalid_value", "amounts must be ≤ 10^14 micro-units")
	}
	ctx := c.Request().Context()
	if err := a.ledger.PutModel(ctx, m); err != nil {
		return ledgerError(c, err)
	}
	if err := a.store.SetModelMax(ctx, m.Name, m.MaxCost); err != nil {
		return unavailable(c, "redis_unavailable", "model saved; learned max not updated in Redis")
	}
	return c.JSON(http.StatusOK, m)
}

func (a *adminAPI) models(c echo.Context) error {
	ms, err := a.ledger.Models(c.Request().Context())
	if err != nil {
		return ledgerError(c, err)
	}
	return c.JSON(http.StatusOK, map[string]any{"data": ms})
}

func jsonDecoder(r *http.Request) *json.Decoder {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, 1<<20))
	dec.DisallowUnknownFields()
	return dec
}

// raiseEpoch starts a new ledger epoch (run it after restoring the database from a backup): every
// hot balance of the old timeline is dropped and reseeded on its next use.
func (a *adminAPI) raiseEpoch(c echo.Context) error {
	e, err := a.ledger.RaiseEpoch(c.Request().Context())
	if err != nil {
		return ledgerError(c, err)
	}
	a.store.ObserveEpoch(e)
	return c.JSON(http.StatusOK, map[string]any{"generation": e.Gen, "id": e.ID})
}
