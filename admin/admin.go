// Package admin is escrow's admin API as an Echo group anyone embedding escrow can mount: orgs,
// credits, adjustments, balances, keys, models, reconciliation and the ledger epoch. Its
// handlers are thin: each decodes a request, makes one call to accounting.Ops, and maps the
// result to an answer. Every route needs the bearer token (compared in constant time).
//
//	api, err := admin.New(accounting.NewOps(worker), &admin.Config{Token: token})
//	api.Register(e.Group("/admin/v1"))
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/access"
	"github.com/llmescrow/escrow/pricing"
)

// MaxBodyBytes bounds an admin request's body.
const MaxBodyBytes = 1 << 20

// ErrNoToken is returned by New without a token: an admin API open to anyone is never built.
var ErrNoToken = errors.New("admin: no token")

// Config configures the admin API.
type Config struct {
	// Token is the bearer token every request must carry. Required.
	Token string
	// Logger receives unexpected errors. Default slog.Default().
	Logger *slog.Logger
	// CheckWebhookURL, when set, checks a webhook endpoint's URL before it is created; its error
	// is the 400's message (escrow.New sets the webhook package's address policy).
	CheckWebhookURL func(rawURL string) error
	// RotationOverlap is how long a rotated admin token stays valid beside its successor when the
	// rotation names no overlap. Default DefaultRotationOverlap (24 h).
	RotationOverlap time.Duration
}

// API serves the admin routes over one accounting.Ops, for the operations that have a
// hot-balance step or a rule, and over roles of its ledger (Ops.Ledger) for those that are one
// ledger call.
type API struct {
	ops          *accounting.Ops
	console      ledger.Console  // lists, names, reports, requests, the audit trail
	hooks        ledger.Webhooks // nil when the ledger has no webhook side (ledger.ErrNoWebhooks)
	token        []byte
	log          *slog.Logger
	checkWebhook func(string) error
	tokens       access.Tokens // nil when the ledger keeps none: only the bootstrap token works
	overlap      time.Duration
}

// New returns the admin API over ops.
func New(ops *accounting.Ops, cfg *Config) (*API, error) {
	if ops == nil {
		return nil, errors.New("admin: nil ops")
	}
	if cfg == nil || cfg.Token == "" {
		return nil, ErrNoToken
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	hooks, _ := ops.Ledger().(ledger.Webhooks)
	tokens, _ := ops.Ledger().(access.Tokens)
	overlap := cfg.RotationOverlap
	if overlap <= 0 {
		overlap = DefaultRotationOverlap
	}
	return &API{ops: ops, console: ops.Ledger(), hooks: hooks, token: []byte(cfg.Token), log: log.With("component", "escrow.admin"),
		checkWebhook: cfg.CheckWebhookURL, tokens: tokens, overlap: overlap}, nil
}

// Register adds the routes, behind the token check (Authenticate, Authorize), to g (escrow's proxy mounts it at
// /admin/v1).
func (a *API) Register(g *echo.Group) {
	// The token check, the org-id check and the audit trail wrap each route rather than the group: a group's
	// middleware makes Echo answer every unknown method with 404 instead of 405 with Allow.
	add := func(method, path string, h echo.HandlerFunc) {
		g.Add(method, path, h, a.authFor(method, path), orgParam, a.audited)
	}
	add(http.MethodGet, "/orgs", a.listOrgs)
	add(http.MethodPost, "/orgs", a.createOrg)
	add(http.MethodGet, "/orgs/:org", a.getOrg)
	add(http.MethodPatch, "/orgs/:org", a.patchOrg)
	add(http.MethodPost, "/orgs/:org/credits", a.credit)
	add(http.MethodPost, "/orgs/:org/adjustments", a.adjust)
	add(http.MethodGet, "/orgs/:org/balance", read(a, "org", a.ops.Balance))
	add(http.MethodPost, "/orgs/:org/reconcile", read(a, "org", a.ops.Reconcile))
	add(http.MethodGet, "/orgs/:org/keys", a.listKeys)
	add(http.MethodPost, "/orgs/:org/keys", a.createKey)
	add(http.MethodGet, "/orgs/:org/entries", a.listEntries)
	add(http.MethodGet, "/orgs/:org/usage", a.usage)
	add(http.MethodPatch, "/keys/:id", a.patchKey)
	add(http.MethodDelete, "/keys/:id", a.revokeKey)
	add(http.MethodGet, "/usage/top", a.topSpenders)
	add(http.MethodGet, "/requests/:id", read(a, "id", a.console.Request))
	add(http.MethodGet, "/models", a.models)
	add(http.MethodGet, "/price-classes", a.priceClasses)
	add(http.MethodPost, "/models/import", a.importModels)
	add(http.MethodGet, "/models/:model", read(a, "model", a.ops.Model))
	add(http.MethodPut, "/models/:model", a.putModel)
	add(http.MethodPatch, "/models/:model", a.patchModel)
	add(http.MethodDelete, "/models/:model", a.deleteModel)
	add(http.MethodGet, "/ledger/epoch", a.epoch)
	add(http.MethodPost, "/ledger/epoch", a.raiseEpoch)
	add(http.MethodGet, "/audit", a.auditLog)
	// Webhook endpoints (the secret is in the 201 answer only) and each one's deliveries.
	add(http.MethodGet, "/webhooks", a.listWebhooks)
	add(http.MethodPost, "/webhooks", a.createWebhook)
	add(http.MethodDelete, "/webhooks/:id", a.deleteWebhook)
	add(http.MethodGet, "/webhooks/:id/deliveries", a.listDeliveries)
	// Limits, projects and freezes (limits.go).
	add(http.MethodPost, "/orgs/:org/projects", a.createProject)
	add(http.MethodPut, "/keys/:id/project", a.setKeyProject)
	add(http.MethodGet, "/orgs/:org/limits", a.listLimits)
	add(http.MethodPost, "/orgs/:org/limits", a.createLimit)
	add(http.MethodPatch, "/orgs/:org/limits/:id", a.patchLimit)
	add(http.MethodDelete, "/orgs/:org/limits/:id", a.deleteLimit)
	add(http.MethodGet, "/orgs/:org/limits/:id/end_users", a.limitEndUsers)
	a.registerTopUp(add)  // auto top-up settings (topup.go)
	a.registerJobs(add)   // background responses and batches (jobs.go)
	a.registerGrants(add) // credit grants (grants.go)
	for _, f := range []struct {
		path   string
		frozen bool
	}{{"freeze", true}, {"unfreeze", false}} {
		add(http.MethodPost, "/orgs/:org/"+f.path, a.freeze(balance.ScopeOrg, f.frozen))
		add(http.MethodPost, "/orgs/:org/projects/:id/"+f.path, a.freeze(balance.ScopeProject, f.frozen))
		add(http.MethodPost, "/keys/:id/"+f.path, a.freeze(balance.ScopeKey, f.frozen))
	}
	add(http.MethodPut, "/keys/:id/models", a.setKeyModels) // keymodels.go
	// Scoped admin tokens (tokens.go).
	add(http.MethodGet, "/tokens", a.listTokens)
	add(http.MethodPost, "/tokens", a.createToken)
	add(http.MethodPost, "/tokens/:id/rotate", a.rotateToken)
	add(http.MethodDelete, "/tokens/:id", a.revokeToken)
}

// apiError is an answer in OpenAI's error shape, like the proxy's own refusals, so one client
// parses both. (The middleware has the same shape; admin depends on accounting only.)
type apiError struct {
	status     int
	typ, code  string
	msg        string
	retryAfter time.Duration
}

const (
	typeInvalid     = "invalid_request_error"
	typeServer      = "server_error"
	typeUnavailable = "service_unavailable"
)

func writeError(c echo.Context, e apiError) error {
	if e.retryAfter > 0 {
		c.Response().Header().Set("Retry-After", strconv.Itoa(max(int(e.retryAfter/time.Second), 1)))
	}
	type inner struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	}
	return writeJSON(c, e.status, struct {
		Error inner `json:"error"`
	}{inner{Message: e.msg, Type: e.typ, Code: e.code}})
}

func invalid(c echo.Context, msg string) error {
	return writeError(c, apiError{status: http.StatusBadRequest, typ: typeInvalid, code: "invalid_value", msg: msg})
}

func unavailable(c echo.Context, code, msg string) error {
	return writeError(c, apiError{status: http.StatusServiceUnavailable, typ: typeUnavailable, code: code, msg: msg, retryAfter: time.Second})
}

// orgParam refuses an :org that breaks the one org-id rule (balance.ValidateOrg, which the ledger
// and the hot balance apply too) before any handler runs; the message says what is allowed.
func orgParam(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if org := c.Param("org"); org != "" {
			if err := balance.ValidateOrg(org); err != nil {
				return invalidOrg(c, err)
			}
		}
		return next(c)
	}
}

func invalidOrg(c echo.Context, err error) error {
	return writeError(c, apiError{status: http.StatusBadRequest, typ: typeInvalid, code: "invalid_org", msg: message(err)})
}

// refusal is the answer to one error of accounting.Ops: a status, a code and a message (""
// means the error's own message, without package prefixes).
type refusal struct {
	err       error
	status    int
	code, msg string
}

// refusals are the errors with an answer of their own, checked in order (the webhook ones
// first); any other error is a 500.
var refusals = []refusal{
	{ledger.ErrUnknownWebhook, http.StatusNotFound, "webhook_not_found", "no such webhook"},
	{access.ErrUnknownToken, http.StatusNotFound, "token_not_found", "no such live admin token"},
	{ErrInvalidScope, http.StatusBadRequest, "invalid_value", ""},
	{ledger.ErrInvalidWebhook, http.StatusBadRequest, "invalid_value", ""},
	{ledger.ErrNoWebhooks, http.StatusNotImplemented, "webhooks_unsupported", ""},
	{ledger.ErrUnknownOrg, http.StatusNotFound, "org_not_found", "no such org"},
	{ledger.ErrOrgExists, http.StatusConflict, "org_exists", "the org already exists"},
	{ledger.ErrReferenceConflict, http.StatusConflict, "reference_conflict", "this reference was already used for another credit"},
	{ledger.ErrUnknownKey, http.StatusNotFound, "key_not_found", "no such key"},
	{ledger.ErrUnknownModel, http.StatusNotFound, "model_not_found", "no such model"},
	{ledger.ErrUnknownRequest, http.StatusNotFound, "request_not_found", "no request with this id in the ledger"},
	{ledger.ErrModelInUse, http.StatusConflict, "model_in_use", "the model has recorded usage and cannot be deleted"},
	{ledger.ErrModelInFlight, http.StatusConflict, "model_in_flight", "the model has requests in flight; retry once they are over"},
	{ledger.ErrUnknownProject, http.StatusNotFound, "project_not_found", "no such project in this org"},
	{ledger.ErrUnknownLimit, http.StatusNotFound, "limit_not_found", "no such limit in this org"},
	{ledger.ErrProjectExists, http.StatusConflict, "project_exists", "the project already exists"},
	{ledger.ErrInvalidLimit, http.StatusBadRequest, "invalid_value", ""},
	{balance.ErrInvalidOrg, http.StatusBadRequest, "invalid_org", ""},
	{ledger.ErrInvalidCursor, http.StatusBadRequest, "invalid_cursor", ""},
	{ledger.ErrInvalidQuery, http.StatusBadRequest, "invalid_value", ""},
	{ledger.ErrInvalidAmount, http.StatusBadRequest, "invalid_value", ""},
	{balance.ErrInvalidAmount, http.StatusBadRequest, "invalid_value", ""},
	{pricing.ErrCostOverflow, http.StatusBadRequest, "invalid_value", ""},
	{ledger.ErrLedgerUnavailable, http.StatusServiceUnavailable, "ledger_unavailable", "the ledger is unavailable"},
	{accounting.ErrHotBalance, http.StatusServiceUnavailable, "redis_unavailable", "the hot balance is unavailable"},
}

// answer is the refusal of err: a 503 is retried after a second, a 4xx is the client's error.
func (r refusal) answer(err error) apiError {
	e := apiError{status: r.status, typ: typeInvalid, code: r.code, msg: r.msg}
	if e.msg == "" {
		e.msg = message(err)
	}
	switch {
	case r.status == http.StatusServiceUnavailable:
		e.typ, e.retryAfter = typeUnavailable, time.Second
	case r.status >= 500:
		e.typ = typeServer
	}
	return e
}

// fail maps an error of accounting.Ops to an answer.
func (a *API) fail(c echo.Context, err error) error {
	for _, r := range refusals {
		if errors.Is(err, r.err) {
			return writeError(c, r.answer(err))
		}
	}
	a.log.Error("admin request failed", "path", c.Path(), "err", err)
	return writeError(c, apiError{status: http.StatusInternalServerError, typ: typeServer, code: "internal_error", msg: "internal error"})
}

// message is err's text for a client: without the Go package prefixes ("ledger: "), which
// say where in escrow an error was made, not what is wrong.
func message(err error) string {
	msg := err.Error()
	for _, p := range []string{"accounting: ", "balance: ", "admin: ", "pgledger: ", "memledger: ", "ledger: ", "pricing: "} { // pgledger before ledger
		msg = strings.ReplaceAll(msg, p, "")
	}
	return msg
}

// bind decodes the JSON body into v, refusing unknown fields; it answers the 400 itself (then
// the response is committed).
func bind(c echo.Context, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(c.Response(), c.Request().Body, MaxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return writeError(c, apiError{status: http.StatusBadRequest, typ: typeInvalid, code: "invalid_json", msg: "invalid JSON body: " + err.Error()})
	}
	return nil
}

// entryStatus is 201 for a new entry and 200 for a repeated reference; a durable entry whose
// hot-balance update failed carries a warning header (the worker applies it later).
func entryStatus(c echo.Context, created bool, err error) int {
	if err != nil {
		c.Response().Header().Set("x-escrow-warning", "entry recorded; hot balance update pending")
	}
	if created {
		return http.StatusCreated
	}
	return http.StatusOK
}

func (a *API) createOrg(c echo.Context) error {
	var req struct {
		ID   string `json:"id"`
		Name string `json:"name"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if err := a.ops.CreateNamedOrg(c.Request().Context(), req.ID, req.Name); err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusCreated, Named{ID: req.ID, Name: req.Name})
}

type moneyRequest struct {
	Amount    *int64 `json:"amount"`
	Reference string `json:"reference"`
}

// adjust: POST /orgs/:org/adjustments, a correction either way (amount ≠ 0).
func (a *API) adjust(c echo.Context) error {
	return a.entry(c, func(n int64) bool { return n != 0 }, "amount (≠ 0, micro-units) and reference are required", a.ops.Adjust)
}

// entry writes a ledger entry of the body's amount (accepted by valid, else 400 need) and
// reference with write; a durable entry whose hot-balance update failed is answered too
// (entryStatus).
func (a *API) entry(c echo.Context, valid func(int64) bool, need string,
	write func(ctx context.Context, org string, amount int64, ref string) (ledger.LedgerEntry, bool, error)) error {
	var req moneyRequest
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Amount == nil || !valid(*req.Amount) || req.Reference == "" {
		return invalid(c, need)
	}
	e, created, err := write(c.Request().Context(), c.Param("org"), *req.Amount, req.Reference)
	if err != nil && !errors.Is(err, accounting.ErrHotBalance) {
		return a.fail(c, err)
	}
	return writeJSON(c, entryStatus(c, created, err), e)
}

func (a *API) createKey(c echo.Context) error {
	var req struct {
		Name string `json:"name"`
	}
	if c.Request().ContentLength != 0 { // the body is optional
		if err := bind(c, &req); err != nil || c.Response().Committed {
			return err
		}
	}
	k, secret, err := a.ops.CreateNamedKey(c.Request().Context(), c.Param("org"), req.Name)
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusCreated, NewKey{ID: k.ID, Key: secret, Name: k.Name, Org: k.Org})
}

func (a *API) revokeKey(c echo.Context) error {
	if err := a.ops.RevokeKey(c.Request().Context(), c.Param("id")); err != nil {
		return a.fail(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}

func (a *API) putModel(c echo.Context) error {
	var m ledger.Model
	if err := bind(c, &m); err != nil || c.Response().Committed {
		return err
	}
	m.Name = c.Param("model")
	if err := m.Prices.Check(); err != nil {
		return invalid(c, strings.TrimPrefix(err.Error(), "accounting: "))
	}
	if m.MaxCost < 0 || m.DefaultHold < 0 || m.MaxInputTokens < 0 || m.MaxOutputTokens < 0 {
		return invalid(c, "prices, limits and holds must be ≥ 0")
	}
	if m.MaxCost > balance.MaxAmount || m.DefaultHold > balance.MaxAmount {
		return invalid(c, "amounts must be ≤ 10^14 micro-units")
	}
	if err := a.ops.PutModel(c.Request().Context(), m); err != nil {
		if errors.Is(err, accounting.ErrHotBalance) {
			return unavailable(c, "redis_unavailable", "model saved; learned max not updated in Redis")
		}
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, m.Effective())
}

func (a *API) models(c echo.Context) error {
	ms, err := a.ops.Models(c.Request().Context())
	if err != nil {
		return a.fail(c, err)
	}
	// The CSV has one column per class any model prices (defaults filled in), in the
	// registry's order: a new class needs no column here.
	classes := modelClasses(ms)
	header := []string{"model"}
	for _, cl := range classes {
		header = append(header, string(cl)+ledger.PriceSuffix)
	}
	header = append(header, "max_input_tokens", "max_output_tokens", "max_cost", "default_hold")
	return writeList(c, ms, "", header, func(m ledger.Model) []string {
		row := []string{m.Name}
		for _, cl := range classes {
			v, ok := m.Prices[cl]
			if !ok {
				row = append(row, "")
				continue
			}
			row = append(row, i64(v))
		}
		return append(row, i64(m.MaxInputTokens), i64(m.MaxOutputTokens), i64(m.MaxCost), i64(m.DefaultHold))
	})
}

// modelClasses is every class the models price (ms have their defaults filled in), in the
// registry's order.
func modelClasses(ms []ledger.Model) []pricing.Class {
	all := pricing.Prices{}
	for _, m := range ms {
		for cl := range m.Prices {
			all[cl] = 0
		}
	}
	return all.Sorted()
}

// raiseEpoch starts a new ledger epoch (run it after restoring the database from a backup): every
// hot balance of the old timeline is dropped and reseeded on its next use.
func (a *API) epoch(c echo.Context) error {
	e, err := a.ops.SyncEpoch(c.Request().Context())
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, Epoch{Generation: e.Gen, ID: e.ID})
}

func (a *API) raiseEpoch(c echo.Context) error {
	e, err := a.ops.RaiseEpoch(c.Request().Context())
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, Epoch{Generation: e.Gen, ID: e.ID})
}
