package server

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/middleware"
)

// The customer's own view (DESIGN "Holds that fit"): with the API key the proxy takes, a
// customer reads what it may spend, in the shapes clients already read. The middleware
// authenticates these routes like any other (a PassThrough path: no hold, nothing billed) and
// leaves the caller's identity on the context (middleware.IdentityOf); a wrong or missing key
// gets 401 in the route's own error shape.
//
//   - OpenRouter's GET /api/v1/key (also /api/v1/auth/key) and GET /api/v1/credits, in
//     {"data":{…}}; errors as {"error":{"code":401,"message":"…"}}.
//   - The one-api family's GET /dashboard/billing/subscription and /dashboard/billing/usage
//     (also under /v1/), as chat UIs query them; errors in OpenAI's shape.
//
// Amounts are in the deployment's currency units (micro-units / 10^6), as those shapes expect,
// exact decimals (never a float); the usage route's total_usage is in hundredths (cents), as
// OpenAI's was. Throughout, total credits are every credit and adjustment the org got and the
// usage is what is gone from them — the charges and what requests in flight hold — so that
// credits − usage is the available balance, what a new request may hold.
var (
	openRouterPaths = []string{"/api/v1/key", "/api/v1/auth/key", "/api/v1/credits"}
	dashboardPaths  = []string{"/dashboard/billing/subscription", "/dashboard/billing/usage",
		"/v1/dashboard/billing/subscription", "/v1/dashboard/billing/usage"}
)

// viewPaths are the customer routes, for the middleware's PassThrough.
func viewPaths() []string { return append(append([]string{}, openRouterPaths...), dashboardPaths...) }

// mountView mounts the customer routes behind the middleware.
// Each is rate-limited per key (ESCROW_VIEW_RATE, ESCROW_VIEW_BURST: 429 rate_limit_exceeded
// with Retry-After beyond it) and reads on the ledger's view pool (ESCROW_VIEW_CONNS,
// ESCROW_VIEW_TIMEOUT), from sums the ledger keeps per org and key (issue 34).
func (s *Server) mountView(e *echo.Echo, mw echo.MiddlewareFunc) {
	lim := newViewLimiter(s.cfg.ViewRate, s.cfg.ViewBurst, time.Now)
	limited := func(h echo.HandlerFunc) echo.HandlerFunc { return s.limitView(lim, h) }
	e.GET("/api/v1/key", limited(s.openRouterKey), mw)
	e.GET("/api/v1/auth/key", limited(s.openRouterKey), mw)
	e.GET("/api/v1/credits", limited(s.openRouterCredits), mw)
	for _, prefix := range []string{"", "/v1"} {
		e.GET(prefix+"/dashboard/billing/subscription", limited(s.dashboardSubscription), mw)
		e.GET(prefix+"/dashboard/billing/usage", limited(s.dashboardUsage), mw)
	}
}

// limitView answers 429 rate_limit_exceeded, with Retry-After, in the route's shape when the
// caller's key has used its views' burst; else h.
func (s *Server) limitView(lim *viewLimiter, h echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		id, found := middleware.IdentityOf(c)
		if !found {
			return h(c) // customerView answers 401
		}
		bucket := "key:" + id.KeyID
		if id.KeyID == "" {
			bucket = "org:" + id.Org
		}
		if ok, wait := lim.allow(bucket); !ok {
			return s.writeRefusal(c, &middleware.Error{Status: http.StatusTooManyRequests, Type: middleware.TypeRateLimit,
				Code: middleware.CodeRateLimit, RetryAfter: max(wait, time.Second),
				Message: "Too many billing reads for this key; retry after the Retry-After header's seconds."})
		}
		return h(c)
	}
}

// isOpenRouterPath reports whether path answers in OpenRouter's shape.
func isOpenRouterPath(path string) bool { return strings.HasPrefix(path, "/api/v1/") }

// writeRefusal is the middleware's ErrorHandler: OpenRouter's error shape on its routes,
// OpenAI's (or Anthropic's, which the middleware chose already) elsewhere.
func (s *Server) writeRefusal(c echo.Context, e *middleware.Error) error {
	if !isOpenRouterPath(c.Request().URL.Path) || e.Anthropic {
		return middleware.WriteError(c, e)
	}
	e.SetHeaders(c.Response().Header())
	return c.JSON(e.Status, openRouterError{Error: openRouterErrorBody{Code: e.Status, Message: e.Message}})
}

// openRouterError is OpenRouter's error body: {"error":{"code":401,"message":"…"}}.
type openRouterError struct {
	Error openRouterErrorBody `json:"error"`
}

type openRouterErrorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// customerView reads the caller's view, or writes the error in the route's shape (ok false).
func (s *Server) customerView(c echo.Context) (v accounting.CustomerView, ok bool, err error) {
	id, found := middleware.IdentityOf(c)
	if !found { // the middleware always identifies these routes; a library mount might not
		return v, false, s.writeRefusal(c, &middleware.Error{Status: http.StatusUnauthorized, Type: middleware.TypeInvalidRequest,
			Code: middleware.CodeInvalidAPIKey, Message: "No API key was identified for this request."})
	}
	v, err = s.ops.CustomerView(c.Request().Context(), id.Org, id.KeyID)
	if err == nil {
		return v, true, nil
	}
	if errors.Is(err, ledger.ErrUnknownOrg) { // an identity whose org has no account yet: nothing
		return accounting.CustomerView{Org: id.Org, Key: accounting.KeyView{ID: id.KeyID, Limits: []accounting.LimitView{}}}, true, nil
	}
	s.log.Warn("customer view", "org", id.Org, "err", err)
	return v, false, s.writeRefusal(c, &middleware.Error{Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable,
		Code: middleware.CodeServiceUnavailable, RetryAfter: 5 * time.Second,
		Message: "The billing service cannot read your balance right now; please retry."})
}

// usage is the part of the credits that is gone: charged, or held by requests in flight.
func usage(v accounting.CustomerView) int64 { return max(v.Credited-v.Available, 0) }

// units is micro-units in currency units, an exact decimal: 1950810 → 1.95081.
func units(micro int64) json.Number { return decimal(micro, 6) }

// decimal is v / 10^places as an exact JSON number, trailing zeros dropped.
func decimal(v int64, places int) json.Number {
	neg := v < 0
	u := uint64(v)
	if neg {
		u = -u
	}
	digits := strconv.FormatUint(u, 10)
	if len(digits) <= places {
		digits = strings.Repeat("0", places-len(digits)+1) + digits
	}
	whole, frac := digits[:len(digits)-places], strings.TrimRight(digits[len(digits)-places:], "0")
	out := whole
	if frac != "" {
		out += "." + frac
	}
	if neg && out != "0" {
		out = "-" + out
	}
	return json.Number(out)
}

// orgMoney is the org's balance as every customer route shows it, besides its own fields.
type orgMoney struct {
	Available     json.Number `json:"available"`
	Held          json.Number `json:"held"`
	LedgerBalance json.Number `json:"ledger_balance"`
	// Grants: the credit grants not expired yet, in spending order (docs/grants.md).
	Grants []grantView `json:"grants"`
}

// grantView is a credit grant as a customer reads it, in currency units.
type grantView struct {
	Amount    json.Number `json:"amount"`
	Remaining json.Number `json:"remaining"`
	Priority  int         `json:"priority"`
	ExpiresAt *time.Time  `json:"expires_at"`
}

func moneyOf(v accounting.CustomerView) orgMoney {
	m := orgMoney{Available: units(v.Available), Held: units(v.Held), LedgerBalance: units(v.LedgerBalance), Grants: []grantView{}}
	for _, g := range v.Grants {
		gv := grantView{Amount: units(g.Amount), Remaining: units(g.Rest), Priority: g.Priority}
		if !g.ExpiresAt.IsZero() {
			at := g.ExpiresAt
			gv.ExpiresAt = &at
		}
		m.Grants = append(m.Grants, gv)
	}
	return m
}

// openRouterResets names a limit window as OpenRouter's limit_reset does (nil for lifetime).
func openRouterResets(w balance.Window) *string {
	r := map[balance.Window]string{balance.Hour: "hourly", balance.Day: "daily", balance.Week: "weekly", balance.Month: "monthly"}[w]
	if r == "" {
		return nil
	}
	return &r
}

// viewLimit is a limit in the key's scope, in currency units.
type viewLimit struct {
	ID        string         `json:"id"`
	Scope     string         `json:"scope"`
	ScopeID   *string        `json:"scope_id"`
	Window    balance.Window `json:"window"`
	Cap       json.Number    `json:"cap"`
	Used      json.Number    `json:"used"`
	Held      json.Number    `json:"held"`
	Remaining json.Number    `json:"remaining"`
	ResetsAt  *time.Time     `json:"resets_at"`
}

// openRouterKey answers GET /api/v1/key: the key's label (its name, else its id), the limit
// with the least room among the limits in its scope (org, project, key) as limit,
// limit_remaining and limit_reset (null when none), its charges as usage (all time, and this
// UTC day, week and month by reserve time), and, besides OpenRouter's fields, the org's
// available, held and ledger balance and every limit in scope.
func (s *Server) openRouterKey(c echo.Context) error {
	v, ok, err := s.customerView(c)
	if !ok {
		return err
	}
	k := v.Key
	zero := units(0)
	type rateLimit struct {
		Requests int    `json:"requests"`
		Interval string `json:"interval"`
		Note     string `json:"note"`
	}
	data := struct {
		Label              string       `json:"label"`
		Limit              *json.Number `json:"limit"`
		LimitRemaining     *json.Number `json:"limit_remaining"`
		LimitReset         *string      `json:"limit_reset"`
		Usage              json.Number  `json:"usage"`
		UsageDaily         json.Number  `json:"usage_daily"`
		UsageWeekly        json.Number  `json:"usage_weekly"`
		UsageMonthly       json.Number  `json:"usage_monthly"`
		ByokUsage          json.Number  `json:"byok_usage"`
		ByokUsageDaily     json.Number  `json:"byok_usage_daily"`
		ByokUsageWeekly    json.Number  `json:"byok_usage_weekly"`
		ByokUsageMonthly   json.Number  `json:"byok_usage_monthly"`
		IncludeByokInLimit bool         `json:"include_byok_in_limit"`
		IsFreeTier         bool         `json:"is_free_tier"`
		IsProvisioningKey  bool         `json:"is_provisioning_key"`
		IsManagementKey    bool         `json:"is_management_key"`
		CreatorUserID      *string      `json:"creator_user_id"`
		ExpiresAt          *time.Time   `json:"expires_at"`
		RateLimit          rateLimit    `json:"rate_limit"`
		orgMoney
		LimitHeld *json.Number `json:"limit_held"`
		Limits    []viewLimit  `json:"limits"`
	}{
		Label: k.Name, Usage: units(k.Charged), UsageDaily: units(k.ChargedDay), UsageWeekly: units(k.ChargedWeek),
		UsageMonthly: units(k.ChargedMonth), ByokUsage: zero, ByokUsageDaily: zero, ByokUsageWeekly: zero, ByokUsageMonthly: zero,
		RateLimit: rateLimit{Requests: -1, Interval: "10s", Note: "escrow limits spending, not requests per interval: see limits"},
		orgMoney:  moneyOf(v), Limits: []viewLimit{},
	}
	if data.Label == "" {
		data.Label = k.ID
	}
	if b := k.Binding; b != nil {
		limit, remaining, held := units(b.Cap), units(k.BindingRemains), units(b.Held)
		data.Limit, data.LimitRemaining, data.LimitReset, data.LimitHeld = &limit, &remaining, openRouterResets(b.Window), &held
	}
	for _, l := range k.Limits {
		vl := viewLimit{ID: l.ID, Scope: string(l.Scope), Window: l.Window, Cap: units(l.Cap), Used: units(l.Used), Held: units(l.Held),
			Remaining: units(max(l.Cap-l.Used, 0)), ResetsAt: l.ResetsAt}
		if l.ScopeID != "" {
			id := l.ScopeID
			vl.ScopeID = &id
		}
		data.Limits = append(data.Limits, vl)
	}
	return c.JSON(http.StatusOK, map[string]any{"data": data})
}

// openRouterCredits answers GET /api/v1/credits: total_credits (every credit and adjustment)
// and total_usage (charged and held), so that their difference is the available balance; the
// org's available, held and ledger balance besides.
func (s *Server) openRouterCredits(c echo.Context) error {
	v, ok, err := s.customerView(c)
	if !ok {
		return err
	}
	return c.JSON(http.StatusOK, map[string]any{"data": struct {
		TotalCredits json.Number `json:"total_credits"`
		TotalUsage   json.Number `json:"total_usage"`
		orgMoney
	}{units(v.Credited), units(usage(v)), moneyOf(v)}})
}

// dashboardSubscription answers GET /dashboard/billing/subscription as one-api does: the
// org's total credits as its hard (and soft) limit.
func (s *Server) dashboardSubscription(c echo.Context) error {
	v, ok, err := s.customerView(c)
	if !ok {
		return err
	}
	total := units(v.Credited)
	return c.JSON(http.StatusOK, struct {
		Object             string      `json:"object"`
		HasPaymentMethod   bool        `json:"has_payment_method"`
		SoftLimitUSD       json.Number `json:"soft_limit_usd"`
		HardLimitUSD       json.Number `json:"hard_limit_usd"`
		SystemHardLimitUSD json.Number `json:"system_hard_limit_usd"`
		AccessUntil        int64       `json:"access_until"`
		orgMoney
	}{"billing_subscription", true, total, total, total, 0, moneyOf(v)})
}

// dashboardUsage answers GET /dashboard/billing/usage as one-api does: total_usage in
// hundredths of the currency (OpenAI's cents), all time (its start_date and end_date are
// ignored, as one-api ignores them).
func (s *Server) dashboardUsage(c echo.Context) error {
	v, ok, err := s.customerView(c)
	if !ok {
		return err
	}
	return c.JSON(http.StatusOK, struct {
		Object     string      `json:"object"`
		TotalUsage json.Number `json:"total_usage"`
		orgMoney
	}{"list", decimal(usage(v), 4), moneyOf(v)})
}
