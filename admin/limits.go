package admin

import (
	"errors"
	"net/http"
	"strconv"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

// Limits, projects and freezes (DESIGN.md "Limits"): each route is one call to accounting.Ops,
// which writes the ledger and pushes the change to the hot balance before it returns. When only
// the push failed, the change is durable: the answer is the usual one with an x-escrow-warning
// header (the reconciler pushes it later).

// limitAnswer writes v with status, after a change whose push may have failed (a warning
// header then), or the refusal err maps to.
func (a *API) limitAnswer(c echo.Context, status int, v any, err error) error {
	if err != nil && !errors.Is(err, accounting.ErrHotBalance) {
		return a.fail(c, err)
	}
	if err != nil {
		a.log.Warn("limit change recorded; hot state not updated", "path", c.Path(), "err", err)
		c.Response().Header().Set("x-escrow-warning", "change recorded; hot balance update pending")
	}
	if v == nil {
		return c.NoContent(status)
	}
	return writeJSON(c, status, v)
}

func (a *API) createProject(c echo.Context) error {
	var req struct {
		ID string `json:"id"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.ID == "" {
		return invalid(c, "id is required")
	}
	err := a.ops.CreateProject(c.Request().Context(), c.Param("org"), req.ID)
	return a.limitAnswer(c, http.StatusCreated, map[string]string{"id": req.ID, "org": c.Param("org")}, err)
}

func (a *API) setKeyProject(c echo.Context) error {
	var req struct {
		Project *string `json:"project"` // null: no project
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	project := ""
	if req.Project != nil {
		if *req.Project == "" {
			return invalid(c, `project is a project id, or null for none`)
		}
		project = *req.Project
	}
	err := a.ops.SetKeyProject(c.Request().Context(), c.Param("id"), project)
	return a.limitAnswer(c, http.StatusOK, map[string]any{"id": c.Param("id"), "project": req.Project}, err)
}

// toJSON is l as the routes answer it.
func toJSON(l balance.Limit) Limit {
	return Limit{ID: l.ID, Scope: string(l.Scope.Kind), ScopeID: l.Scope.ID, Window: string(l.Window), Unit: string(l.Unit), Cap: l.Cap, RequireEndUser: l.RequireEndUser}
}

func (a *API) createLimit(c echo.Context) error {
	var req struct {
		Scope   string  `json:"scope"`
		ScopeID *string `json:"scope_id"`
		Window  string  `json:"window"`
		Unit    string  `json:"unit"`
		Cap     *int64  `json:"cap"`
		// RequireEndUser (a limit of each end user apart only): refuse the org's requests
		// that name no end user.
		RequireEndUser bool `json:"require_end_user"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	s := balance.Scope{Kind: balance.ScopeKind(req.Scope)}
	unit, unitOK := ledger.ParseUnit(req.Unit)
	switch {
	case req.Scope != "org" && req.Scope != "project" && req.Scope != "key" && req.Scope != "end_user":
		return invalid(c, `scope must be "org", "project", "key" or "end_user"`)
	case req.Scope == "org" && req.ScopeID != nil && *req.ScopeID != "":
		return invalid(c, "an org limit has no scope_id")
	case (req.Scope == "project" || req.Scope == "key") && (req.ScopeID == nil || *req.ScopeID == ""):
		return invalid(c, "scope_id (the project or key id) is required")
	case req.Cap == nil:
		return invalid(c, "cap (> 0: micro-units, requests or tokens, by unit) is required")
	case !balance.Window(req.Window).Valid():
		return invalid(c, `window must be "lifetime", "minute", "hour", "day", "week" or "month"`)
	case !unitOK:
		return invalid(c, `unit must be "money" (the default), "requests" or "tokens"`)
	case req.RequireEndUser && (req.Scope != "end_user" || (req.ScopeID != nil && *req.ScopeID != "")):
		return invalid(c, "require_end_user is for a limit of scope end_user without scope_id (each end user apart)")
	}
	if req.ScopeID != nil && req.Scope != "org" {
		s.ID = *req.ScopeID
	}
	l, err := a.ops.AddLimit(c.Request().Context(), c.Param("org"), balance.Limit{Scope: s, Window: balance.Window(req.Window), Unit: unit, Cap: *req.Cap,
		RequireEndUser: req.RequireEndUser})
	return a.limitAnswer(c, http.StatusCreated, toJSON(l), err)
}

func (a *API) listLimits(c echo.Context) error {
	ls, err := a.ops.ListLimits(c.Request().Context(), c.Param("org"))
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, ls, "", []string{"id", "scope", "scope_id", "window", "cap", "used", "held", "resets_at", "end_users"},
		func(l accounting.LimitView) []string {
			reset, users := "", ""
			if l.ResetsAt != nil {
				reset = ts(*l.ResetsAt)
			}
			if l.EndUsers != nil {
				users = strconv.Itoa(*l.EndUsers)
			}
			return []string{l.ID, string(l.Scope), l.ScopeID, string(l.Window), i64(l.Cap), i64(l.Used), i64(l.Held), reset, users}
		})
}

// limitEndUsers: GET /orgs/:org/limits/:id/end_users, the end users of a limit of each end user
// apart with a counter in its current window, by id, paged.
func (a *API) limitEndUsers(c echo.Context) error {
	q, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	p, err := a.ops.LimitEndUsers(c.Request().Context(), c.Param("org"), c.Param("id"), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next, []string{"end_user", "used", "held"},
		func(u accounting.EndUserUsed) []string { return []string{u.EndUser, i64(u.Used), i64(u.Held)} })
}

func (a *API) patchLimit(c echo.Context) error {
	var req struct {
		Cap *int64 `json:"cap"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Cap == nil {
		return invalid(c, "cap (micro-units, > 0) is required; scope and window never change (create a new limit)")
	}
	l, err := a.ops.SetLimitCap(c.Request().Context(), c.Param("org"), c.Param("id"), *req.Cap)
	return a.limitAnswer(c, http.StatusOK, toJSON(l), err)
}

func (a *API) deleteLimit(c echo.Context) error {
	err := a.ops.DeleteLimit(c.Request().Context(), c.Param("org"), c.Param("id"))
	return a.limitAnswer(c, http.StatusNoContent, nil, err)
}

// freeze answers POST …/freeze and …/unfreeze of the org, a project (:id under the org) or a
// key (:id); the body is empty.
func (a *API) freeze(kind balance.ScopeKind, frozen bool) echo.HandlerFunc {
	return func(c echo.Context) error {
		s := balance.Scope{Kind: kind}
		if kind != balance.ScopeOrg {
			s.ID = c.Param("id")
		}
		ctx := c.Request().Context()
		var err error
		if frozen {
			err = a.ops.Freeze(ctx, c.Param("org"), s)
		} else {
			err = a.ops.Unfreeze(ctx, c.Param("org"), s)
		}
		out := map[string]any{"scope": string(kind), "frozen": frozen}
		if org := c.Param("org"); org != "" {
			out["org"] = org
		}
		if s.ID != "" {
			out["scope_id"] = s.ID
		}
		return a.limitAnswer(c, http.StatusOK, out, err)
	}
}
