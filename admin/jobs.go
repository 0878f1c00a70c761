package admin

import (
	"net/http"
	"strconv"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger/job"
)

func init() {
	refusals = append(refusals,
		refusal{accounting.ErrNoJobs, http.StatusNotImplemented, "jobs_unsupported", ""},
	)
}

// registerJobs adds the job listings (docs/jobs.md): every org's (GET /jobs) and one org's
// (GET /orgs/:org/jobs), newest first, with ?kind=, ?live=true and ?limit= (default 100, at most
// 1000).
func (a *API) registerJobs(add func(method, path string, h echo.HandlerFunc)) {
	add(http.MethodGet, "/jobs", a.listJobs)
	add(http.MethodGet, "/orgs/:org/jobs", a.listJobs)
}

func (a *API) listJobs(c echo.Context) error {
	q := job.Query{Org: c.Param("org"), Kind: job.Kind(c.QueryParam("kind"))}
	q.Live, _ = strconv.ParseBool(c.QueryParam("live"))
	if s := c.QueryParam("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return writeError(c, apiError{status: http.StatusBadRequest, typ: typeInvalid, code: "invalid_value", msg: "limit must be a positive integer"})
		}
		q.Limit = n
	}
	js, err := a.ops.Jobs(c.Request().Context(), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, map[string]any{"jobs": js})
}
