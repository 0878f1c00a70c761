package admin

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/pricing"
)

// MaxImportBytes bounds a price table's size (LiteLLM's whole file is under 2 MiB).
const MaxImportBytes = 32 << 20

// auditDetail is where a handler leaves the audit trail's detail when the request body is not
// the right one (a price table of megabytes: its summary is recorded instead).
const auditDetail = "escrow.audit.detail"

// importModels imports a price table (the body: LiteLLM's model_prices_and_context_window.json
// or a CSV, see pricing.ParsePriceTable) through accounting.Ops.ImportPrices. ?dry_run=1
// writes nothing and answers what would change; ?provider=a,b keeps only those
// litellm_provider values. The answer is the accounting.ImportReport; the audit trail records
// its counts.
func (a *API) importModels(c echo.Context) error {
	dry, err := strconv.ParseBool(cmp.Or(c.QueryParam("dry_run"), "false"))
	if err != nil {
		return invalid(c, "dry_run must be true or false (1 or 0)")
	}
	var providers []string
	for _, p := range strings.Split(c.QueryParam("provider"), ",") {
		if p = strings.TrimSpace(p); p != "" {
			providers = append(providers, p)
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(c.Response(), c.Request().Body, MaxImportBytes))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return writeError(c, apiError{status: http.StatusRequestEntityTooLarge, typ: typeInvalid, code: "request_too_large",
			msg: fmt.Sprintf("the price table is larger than %d bytes", MaxImportBytes)})
	case err != nil:
		return invalid(c, "could not read the request body")
	}
	t, err := pricing.ParsePriceTable(body, providers)
	if err != nil {
		return invalid(c, message(err))
	}
	r, err := a.ops.ImportPrices(c.Request().Context(), t, dry)
	c.Set(auditDetail, fmt.Sprintf("price table of %d bytes, dry_run=%v, provider=%q: %d new, %d changed, %d unchanged, %d skipped, %d rounded up%s",
		len(body), dry, strings.Join(providers, ","), len(r.New), len(r.Changed), len(r.Unchanged), len(r.Skipped), len(r.RoundedUp),
		map[bool]string{true: "; stopped by an error", false: ""}[err != nil]))
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, r)
}
