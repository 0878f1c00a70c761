package admin

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/csvcell"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// answer writes v with 200, or the refusal err maps to.
func (a *API) answer(c echo.Context, v any, err error) error {
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, v)
}

// read is the handler of a route that is one read (of accounting.Ops or of the ledger's
// Console): get of the route's param.
func read[T any](a *API, param string, get func(context.Context, string) (T, error)) echo.HandlerFunc {
	return func(c echo.Context) error {
		v, err := get(c.Request().Context(), c.Param(param))
		return a.answer(c, v, err)
	}
}

// writeJSON answers v as JSON without HTML escaping ('>' stays '>', not \u003e): the admin API's
// readers are programs and people at a terminal, never an HTML page.
func writeJSON(c echo.Context, status int, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("admin: encode answer: %w", err)
	}
	return c.Blob(status, echo.MIMEApplicationJSON, buf.Bytes())
}

// wantsCSV: ?format=csv, or an Accept header asking for text/csv (and ?format=json overrides it).
func wantsCSV(c echo.Context) bool {
	switch c.QueryParam("format") {
	case "csv":
		return true
	case "json":
		return false
	}
	return strings.Contains(c.Request().Header.Get(echo.HeaderAccept), "text/csv")
}

// writeList answers one page: {"data":[…],"next":"cursor"|null} in JSON, or a CSV table with a
// header row (the next cursor, if any, in the X-Escrow-Next header), its cells made safe for
// spreadsheets (csvcell.Safe).
func writeList[T any](c echo.Context, data []T, next string, header []string, row func(T) []string) error {
	if data == nil {
		data = []T{}
	}
	if wantsCSV(c) {
		if next != "" {
			c.Response().Header().Set("X-Escrow-Next", next)
		}
		var buf bytes.Buffer
		w := csv.NewWriter(&buf)
		_ = w.Write(header)
		for _, d := range data {
			_ = w.Write(csvcell.Row(row(d)))
		}
		w.Flush()
		return c.Blob(http.StatusOK, "text/csv; charset=utf-8", buf.Bytes())
	}
	var n *string
	if next != "" {
		n = &next
	}
	return writeJSON(c, http.StatusOK, Page[T]{Data: data, Next: n})
}

func i64(v int64) string { return strconv.FormatInt(v, 10) }

func ts(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// listQuery reads ?cursor= and ?limit=.
func listQuery(c echo.Context) (ledger.ListQuery, error) {
	q := ledger.ListQuery{Cursor: c.QueryParam("cursor")}
	if s := c.QueryParam("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > ledger.MaxPageSize {
			return q, fmt.Errorf("limit must be an integer from 1 to %d", ledger.MaxPageSize)
		}
		q.Limit = n
	}
	return q, nil
}

// timeRange reads the from and to parameters (timeParam).
func timeRange(c echo.Context) (from, to time.Time, err error) {
	if from, err = timeParam(c, "from"); err != nil {
		return from, to, err
	}
	to, err = timeParam(c, "to")
	return from, to, err
}

// timeParam reads an RFC 3339 time or a UTC date (2006-01-02) from the query; "" is a zero time.
func timeParam(c echo.Context, name string) (time.Time, error) {
	s := c.QueryParam(name)
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if t, err := time.Parse(time.DateOnly, s); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("%s must be an RFC 3339 time or a date (YYYY-MM-DD), not %q", name, s)
}

func (a *API) listOrgs(c echo.Context) error {
	q, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	p, err := a.ops.ListOrgs(c.Request().Context(), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next, []string{"id", "name", "ledger_balance", "available", "held", "ledger_seq", "settled_seq", "created_at"},
		func(o accounting.OrgView) []string {
			avail := ""
			if o.Available != nil {
				avail = i64(*o.Available)
			}
			return []string{o.ID, o.Name, i64(o.Balance), avail, i64(o.Held), i64(o.LedgerSeq), i64(o.SettledSeq), ts(o.CreatedAt)}
		})
}

func (a *API) getOrg(c echo.Context) error { return read(a, "org", a.ops.Org)(c) }

type nameRequest struct {
	Name *string `json:"name"`
}

func (a *API) patchOrg(c echo.Context) error {
	var req struct {
		nameRequest
		LowBalanceThreshold json.RawMessage `json:"low_balance_threshold"` // webhooks.go
		Exempt              *bool           `json:"exempt"`                // exempt.go
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Name == nil && req.LowBalanceThreshold == nil && req.Exempt == nil {
		return invalid(c, "name, low_balance_threshold or exempt is required")
	}
	ctx := c.Request().Context()
	if req.Exempt != nil {
		if err := a.setExempt(c, *req.Exempt); err != nil || c.Response().Committed {
			return err
		}
	}
	if req.LowBalanceThreshold != nil {
		if err := a.setThreshold(c, req.LowBalanceThreshold); err != nil || c.Response().Committed {
			return err
		}
	}
	if req.Name != nil {
		if err := a.console.SetOrgName(ctx, c.Param("org"), *req.Name); err != nil {
			return a.fail(c, err)
		}
	}
	return a.getOrg(c)
}

func (a *API) listKeys(c echo.Context) error {
	q, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	p, err := a.console.ListKeys(c.Request().Context(), c.Param("org"), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next, []string{"id", "org", "name", "created_at", "revoked_at"},
		func(k ledger.KeyInfo) []string {
			rev := ""
			if k.RevokedAt != nil {
				rev = ts(*k.RevokedAt)
			}
			return []string{k.ID, k.Org, k.Name, ts(k.CreatedAt), rev}
		})
}

func (a *API) patchKey(c echo.Context) error {
	var req nameRequest
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if req.Name == nil {
		return invalid(c, "name is required")
	}
	if err := a.console.SetKeyName(c.Request().Context(), c.Param("id"), *req.Name); err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusOK, Named{ID: c.Param("id"), Name: *req.Name})
}

func (a *API) listEntries(c echo.Context) error {
	lq, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	q := ledger.EntryQuery{ListQuery: lq, Kind: ledger.EntryKind(c.QueryParam("kind"))}
	if q.From, q.To, err = timeRange(c); err != nil {
		return invalid(c, err.Error())
	}
	p, err := a.console.ListEntries(c.Request().Context(), c.Param("org"), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next,
		[]string{"seq", "kind", "delta", "reference", "created_at", "request_id", "key_id", "model",
			"prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost", "hold_amount", "estimated", "units"},
		func(e ledger.EntryInfo) []string {
			row := []string{i64(e.Seq), string(e.Kind), i64(e.Delta), e.Ref, ts(e.CreatedAt)}
			if r := e.Request; r != nil {
				return append(row, r.ID, r.KeyID, r.Model, i64(r.Usage.Prompt), i64(r.Usage.Of(pricing.CachedInput)), i64(r.Usage.Completion),
					i64(r.Usage.Reasoning), i64(r.Cost), i64(r.HoldAmount), strconv.FormatBool(r.Estimated), UnitsText(r.Usage.Units))
			}
			return append(row, e.HoldID, "", "", "", "", "", "", "", "", "", "")
		})
}

func (a *API) usage(c echo.Context) error {
	q := ledger.UsageQuery{GroupBy: c.QueryParam("group_by")}
	if q.GroupBy == "" {
		q.GroupBy = ledger.GroupByDay
	}
	var err error
	if q.From, q.To, err = timeRange(c); err != nil {
		return invalid(c, err.Error())
	}
	rows, err := a.console.UsageReport(c.Request().Context(), c.Param("org"), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, rows, "", []string{q.GroupBy, "requests", "cost", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "units"},
		func(r ledger.UsageRow) []string {
			return []string{r.Group, i64(r.Requests), i64(r.Cost), i64(r.Prompt), i64(r.Cached), i64(r.Completion), i64(r.Reasoning), UnitsText(r.Units)}
		})
}

// topSpenders: GET /usage/top?from=&to=&limit= — the orgs that spent the most, by cost.
func (a *API) topSpenders(c echo.Context) error {
	var q ledger.TopQuery
	lq, err := listQuery(c)
	if err == nil {
		q.Limit = lq.Limit
		q.From, q.To, err = timeRange(c)
	}
	if err != nil {
		return invalid(c, err.Error())
	}
	rows, err := a.console.TopSpenders(c.Request().Context(), q)
	if err != nil {
		return a.fail(c, err)
	}
	out := make([]Spender, len(rows))
	for i, r := range rows {
		out[i] = Spender{Org: r.Group, UsageRow: r}
	}
	return writeList(c, out, "", []string{"org", "requests", "cost", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "units"},
		func(r Spender) []string {
			return []string{r.Org, i64(r.Requests), i64(r.Cost), i64(r.Prompt), i64(r.Cached), i64(r.Completion), i64(r.Reasoning), UnitsText(r.Units)}
		})
}

// UnitsText is a CSV cell of a usage's units: "class=n" pairs in the registry's order,
// space-separated ("cached_input=900 audio_input=120"); empty for none.
func UnitsText(u pricing.Units) string {
	cs := make(pricing.Prices, len(u))
	for c := range u {
		cs[c] = 0
	}
	var b strings.Builder
	for _, c := range cs.Sorted() {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(string(c) + "=" + i64(u[c]))
	}
	return b.String()
}

// PriceClass is one price class as GET /price-classes lists it (pricing.ClassInfo).
type PriceClass struct {
	Name        pricing.Class `json:"class"`
	Unit        pricing.Unit  `json:"unit"`
	Side        string        `json:"side"`
	BoundsInput bool          `json:"bounds_input"`
	Default     string        `json:"default"`
	Doc         string        `json:"doc"`
}

// priceClasses: GET /price-classes — the price class registry (pricing.Classes): each class's
// name, unit, side, default rule and whether it bounds a request's input.
func (a *API) priceClasses(c echo.Context) error {
	var out []PriceClass
	for _, ci := range pricing.Classes() {
		side := map[pricing.Side]string{pricing.SideNone: "", pricing.SideInput: "input", pricing.SideOutput: "output"}[ci.Side]
		def := "0"
		switch {
		case ci.Default.From != "":
			def = fmt.Sprintf("%d× %s", ci.Default.Mul, ci.Default.From)
		case ci.Default.Refuse:
			def = "none: refused unless priced"
		}
		out = append(out, PriceClass{ci.Name, ci.Unit, side, ci.BoundsInput, def, ci.Doc})
	}
	return writeList(c, out, "", []string{"class", "unit", "side", "bounds_input", "default", "doc"}, func(x PriceClass) []string {
		return []string{string(x.Name), string(x.Unit), x.Side, strconv.FormatBool(x.BoundsInput), x.Default, x.Doc}
	})
}

func (a *API) deleteModel(c echo.Context) error {
	if err := a.ops.DeleteModel(c.Request().Context(), c.Param("model")); err != nil {
		return a.fail(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}

// patchModel changes the fields given. Each price class is given as "<class>_price" in
// micro-units per the class's unit as an integer (input_price, cached_input_price,
// audio_output_price …, as PUT takes them; null removes the class's price, which then takes
// its default), or in currency units as a decimal, a string or a number: "<class>_per_1m" for a
// class quoted per 1M tokens or characters (input_per_1m: "0.15" is 150000 micro-units),
// "<class>_per_unit" for one quoted per item or second (per_image_1024x1024_hd_per_unit),
// read from its text so no float ever touches a price. A cached or cache-write price never
// given (or given as 0) is billed at its default (pricing.Prices.Price), which the answer
// shows. No class has code of its own here: the classes are pricing's registry.
func (a *API) patchModel(c echo.Context) error {
	var req map[string]json.RawMessage
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	p := accounting.ModelPatch{Prices: pricing.Prices{}}
	ints := map[string]**int64{"max_input_tokens": &p.MaxInputTokens, "max_output_tokens": &p.MaxOutputTokens,
		"max_cost": &p.MaxCost, "default_hold": &p.DefaultHold}
	given := map[pricing.Class]string{}
	for key, raw := range req {
		if dst, ok := ints[key]; ok {
			var v *int64
			if err := json.Unmarshal(raw, &v); err != nil {
				return invalid(c, key+": not an integer")
			}
			*dst = v
			continue
		}
		cl, decimal, err := patchPriceKey(key)
		if err != nil {
			return invalid(c, err.Error())
		}
		if other, ok := given[cl]; ok {
			return invalid(c, fmt.Sprintf("give %s or %s, not both", other, key))
		}
		given[cl] = key
		var v int64
		switch {
		case string(raw) == "null" && !decimal:
			p.Clear = append(p.Clear, cl)
			continue
		case decimal:
			if v, err = DecimalMicros(raw); err != nil {
				return invalid(c, key+": "+err.Error())
			}
		default:
			if err := json.Unmarshal(raw, &v); err != nil {
				return invalid(c, key+": not an integer")
			}
		}
		p.Prices[cl] = v
	}
	if err := p.Prices.Check(); err != nil {
		return invalid(c, strings.TrimPrefix(err.Error(), "accounting: "))
	}
	for name, v := range map[string]*int64{"max_input_tokens": p.MaxInputTokens, "max_output_tokens": p.MaxOutputTokens, "max_cost": p.MaxCost, "default_hold": p.DefaultHold} {
		if v != nil && (*v < 0 || *v > balance.MaxAmount) {
			return invalid(c, fmt.Sprintf("%s must be from 0 to 10^14", name))
		}
	}
	m, err := a.ops.PatchModel(c.Request().Context(), c.Param("model"), p)
	return a.answer(c, m, err)
}

// patchPriceKey reads a PATCH member naming a price: "<class>_price" (decimal false), or
// "<class>_per_1m" / "<class>_per_unit" as the class's unit is quoted (decimal true).
func patchPriceKey(key string) (cl pricing.Class, decimal bool, err error) {
	name, suffix := key, ""
	for _, s := range []string{ledger.PriceSuffix, "_per_1m", "_per_unit"} {
		if n, ok := strings.CutSuffix(key, s); ok {
			name, suffix = n, s
			break
		}
	}
	info, ok := pricing.Lookup(pricing.Class(name))
	switch {
	case suffix == "" || !ok:
		return "", false, fmt.Errorf("unknown field %q (a price is <class>_price, <class>_per_1m or <class>_per_unit; classes: GET /price-classes)", key)
	case suffix == "_per_1m" && info.Unit != pricing.PerMTokens && info.Unit != pricing.PerMCharacters,
		suffix == "_per_unit" && (info.Unit == pricing.PerMTokens || info.Unit == pricing.PerMCharacters):
		return "", false, fmt.Errorf("%s: %s is priced per %s", key, name, info.Unit)
	}
	return info.Name, suffix != ledger.PriceSuffix, nil
}

// DecimalMicros converts a JSON number or string holding a non-negative decimal (currency units)
// to micro-units exactly: "0.15" → 150000. A value that is not a whole number of micro-units, a
// sign or a value above 10^14 micro-units is an error saying so; the text is parsed digit by
// digit, never through a float (pricing.DecimalMicros, the one rule for decimal prices).
func DecimalMicros(raw json.RawMessage) (int64, error) {
	s := strings.TrimSpace(string(raw))
	if strings.HasPrefix(s, `"`) {
		if err := json.Unmarshal(raw, &s); err != nil {
			return 0, fmt.Errorf("not a string or a number")
		}
		s = strings.TrimSpace(s)
	}
	v, _, err := pricing.DecimalMicros(s, 6, false)
	if err != nil {
		return 0, errors.New(message(err))
	}
	return v, nil
}

func (a *API) auditLog(c echo.Context) error {
	q, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	p, err := a.console.AuditLog(c.Request().Context(), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next, []string{"id", "at", "actor", "action", "target", "status", "detail"},
		func(r ledger.AuditRecord) []string {
			return []string{i64(r.ID), ts(r.At), r.Actor, r.Action, r.Target, strconv.Itoa(r.Status), r.Detail}
		})
}

// ActorHeader names who makes an admin write, for the audit trail (the CLI sends $USER); the
// token itself is never recorded.
const ActorHeader = "X-Escrow-Actor"

// audited records every write (a method other than GET and HEAD) after it is answered: who
// (ActorHeader, else "admin"), what (method and route), on what (the org, key or model in the
// path), when, the answer's status and the request body (bounded; no admin request body holds a
// secret).
func (a *API) audited(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		r := c.Request()
		if r.Method == http.MethodGet || r.Method == http.MethodHead {
			return next(c)
		}
		var body []byte
		if r.Body != nil {
			var err error
			body, err = io.ReadAll(io.LimitReader(r.Body, MaxBodyBytes+1))
			if err != nil {
				return invalid(c, "could not read the request body")
			}
			// What was not read (a body above MaxBodyBytes, for the routes that take one) follows.
			r.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), r.Body))
		}
		err := next(c)
		actor := strings.TrimSpace(r.Header.Get(ActorHeader))
		p, _ := PrincipalOf(c)
		if actor == "" || len(actor) > 200 {
			actor = "admin"
			if !p.Bootstrap() {
				actor = "token " + p.ID()
			}
		}
		target := c.Param("org")
		for _, p := range []string{"id", "model"} {
			if v := c.Param(p); v != "" {
				target = v
			}
		}
		if org, id := c.Param("org"), c.Param("id"); org != "" && id != "" {
			target = org + "/" + id // a project or limit of the org
		}
		status := c.Response().Status
		if !c.Response().Committed && err != nil {
			status = http.StatusInternalServerError
		}
		detail := string(body)
		if d, ok := c.Get(auditDetail).(string); ok {
			detail = d
		}
		if len(detail) > 4096 {
			detail = detail[:4096]
		}
		// Recorded even when the client has gone: the write may have happened.
		if _, aerr := a.console.RecordAudit(context.WithoutCancel(r.Context()), ledger.AuditRecord{
			Actor: actor, Token: p.TokenID, Action: r.Method + " " + c.Path(), Target: target, Status: status, Detail: detail,
		}); aerr != nil {
			a.log.Error("admin audit record failed", "action", r.Method+" "+c.Path(), "err", aerr)
		}
		return err
	}
}
