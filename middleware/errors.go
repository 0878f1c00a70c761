package middleware

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
)

// OpenAI error types and codes the middleware answers with.
const (
	TypeInvalidRequest     = "invalid_request_error"
	TypeAuthentication     = "authentication_error" // not used by OpenAI for 401s; kept for hooks
	TypeInsufficientQuota  = "insufficient_quota"
	TypeRateLimit          = "rate_limit_exceeded"
	TypeServiceUnavailable = "service_unavailable"
	TypeServer             = "server_error"

	CodeInvalidAPIKey      = "invalid_api_key"
	CodeInsufficientQuota  = "insufficient_quota"
	CodeRateLimit          = "rate_limit_exceeded"
	CodeModelNotFound      = "model_not_found"
	CodeNotFound           = "not_found"
	CodeMethodNotAllowed   = "method_not_allowed"
	CodeInvalidJSON        = "invalid_json"
	CodeRequestTooLarge    = "request_too_large"
	CodeInvalidValue       = "invalid_value"
	CodeMissingField       = "missing_required_parameter"
	CodeUnsupported        = "unsupported_feature"
	CodeUnsupportedParam   = "unsupported_parameter" // a cap field the endpoint does not define
	CodeServiceUnavailable = "service_unavailable"
	CodeInternal           = "internal_error"
	CodeBillingFailed      = "billing_unavailable"
	CodeBudgetExceeded     = "budget_exceeded" // 429: a limit (cap per key, project or org and window) is reached
	CodeAccountFrozen      = "account_frozen"  // 403: the org is frozen
	CodeKeyFrozen          = "key_frozen"      // 403: the API key, or its project, is frozen
)

// HeaderLimitReset is the header of a 429 budget_exceeded that says when the limit's window
// resets (RFC 3339, UTC); absent for a lifetime limit, which never resets.
const HeaderLimitReset = "x-escrow-limit-reset"

// Error is a refusal in OpenAI's shape:
//
//	{"error":{"message":"…","type":"…","param":null,"code":"…"}}
//
// with an HTTP status and the headers clients act on (Retry-After, x-should-retry).
type Error struct {
	Status     int
	Message    string
	Type       string
	Param      string        // "" is written as null
	Code       string        // "" is written as null
	RetryAfter time.Duration // > 0: Retry-After header (whole seconds, at least 1)
	NoRetry    bool          // header x-should-retry: false (the official SDKs retry 429s otherwise)
	// Anthropic: the body is in Anthropic's shape, {"type":"error","error":{"type":"…",
	// "message":"…"}} (the Messages API's routes; see forAnthropic).
	Anthropic bool
	// Limit is the limit a 429 budget_exceeded names: written as "limit" in the error object,
	// and its reset time as the x-escrow-limit-reset header. nil: none.
	Limit *LimitInfo
	// Header holds more headers to send with the error (a rate limit's x-ratelimit-*).
	Header http.Header
}

// LimitInfo is the limit that refused a request, as the error body has it:
//
//	"limit":{"id":"lim_1","scope":"key","scope_id":"key_x","window":"day","cap":50000,
//	         "used":49990,"resets_at":"2026-12-02T00:00:00Z"}
//
// scope is org, project or key; scope_id is the project or key id (null for the org); window
// is lifetime, minute, hour, day, week or month; unit is money, requests or tokens; cap and used
// are in the unit (micro-units for money; used: the window's spend and holds when the request
// came); resets_at is the next window's start, RFC 3339 UTC (null for lifetime).
type LimitInfo struct {
	ID       string  `json:"id"`
	Scope    string  `json:"scope"`
	ScopeID  *string `json:"scope_id"`
	Window   string  `json:"window"`
	Unit     string  `json:"unit,omitempty"` // requests or tokens; absent for money
	Cap      int64   `json:"cap"`
	Used     int64   `json:"used"`
	ResetsAt *string `json:"resets_at"`
}

func (e *Error) Error() string {
	return "middleware: " + strconv.Itoa(e.Status) + " " + e.Code + ": " + e.Message
}

// Body returns the JSON body of the error.
func (e *Error) Body() []byte {
	if e.Anthropic {
		type inner struct {
			Type    string     `json:"type"`
			Message string     `json:"message"`
			Limit   *LimitInfo `json:"limit,omitempty"`
		}
		b, _ := json.Marshal(struct {
			Type  string `json:"type"`
			Error inner  `json:"error"`
		}{"error", inner{Type: e.Type, Message: e.Message, Limit: e.Limit}})
		return b
	}
	type inner struct {
		Message string     `json:"message"`
		Type    string     `json:"type"`
		Param   *string    `json:"param"`
		Code    *string    `json:"code"`
		Limit   *LimitInfo `json:"limit,omitempty"`
	}
	in := inner{Message: e.Message, Type: e.Type, Limit: e.Limit}
	if e.Param != "" {
		in.Param = &e.Param
	}
	if e.Code != "" {
		in.Code = &e.Code
	}
	b, _ := json.Marshal(struct {
		Error inner `json:"error"`
	}{in})
	return b
}

// setHeaders sets the headers that go with the error on h.
func (e *Error) setHeaders(h http.Header) {
	if e.RetryAfter > 0 {
		s := int64((e.RetryAfter + time.Second - 1) / time.Second)
		h.Set("Retry-After", strconv.FormatInt(max(s, 1), 10))
	}
	if e.NoRetry {
		h.Set("x-should-retry", "false")
	}
	if e.Limit != nil && e.Limit.ResetsAt != nil {
		h.Set(HeaderLimitReset, *e.Limit.ResetsAt)
	}
	for k, v := range e.Header {
		h[k] = v
	}
}

// WriteError is the default Config.ErrorHandler: it writes e as OpenAI's JSON error body.
func WriteError(c echo.Context, e *Error) error {
	e.setHeaders(c.Response().Header())
	return c.JSONBlob(e.Status, e.Body())
}

// writeErrorTo writes e straight to an http.ResponseWriter whose header has not gone out.
func writeErrorTo(w http.ResponseWriter, e *Error) {
	h := w.Header()
	h.Del("Content-Length")
	h.Del("Content-Encoding")
	h.Set("Content-Type", "application/json")
	e.setHeaders(h)
	body := e.Body()
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}

func errInvalid(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Code: CodeInvalidValue, Message: msg}
}

func errMissing(param, msg string) *Error {
	return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: param, Code: CodeMissingField, Message: msg}
}

func errUnavailable(msg string, retry time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServiceUnavailable, Code: CodeServiceUnavailable, Message: msg, RetryAfter: retry}
}

func errInternal(msg string) *Error {
	return &Error{Status: http.StatusInternalServerError, Type: TypeServer, Code: CodeInternal, Message: msg}
}

// limitRefusal is the 429 of a hold a limit refused: type insufficient_quota (the SDKs' "stop,
// do not retry"), code budget_exceeded, x-should-retry: false, and the limit in the body and
// (its reset time) in a header.
func limitRefusal(le *balance.LimitError) *Error {
	e := &Error{Status: http.StatusTooManyRequests, Type: TypeInsufficientQuota, Code: CodeBudgetExceeded, NoRetry: true,
		Message: "A spending limit of your organization is reached; this request was not started."}
	l := le.Limit
	if l.ID == "" {
		return e
	}
	info := &LimitInfo{ID: l.ID, Scope: string(l.Scope.Kind), Window: string(l.Window), Unit: string(l.Unit), Cap: l.Cap, Used: le.Used}
	if l.Scope.ID != "" { // none: the org, or each end user apart (the request's own counter)
		id := l.Scope.ID
		info.ScopeID = &id
	}
	reset := "it does not reset"
	if !le.ResetsAt.IsZero() {
		r := le.ResetsAt.UTC().Format(time.RFC3339)
		info.ResetsAt = &r
		reset = "resets " + r
	}
	e.Limit = info
	e.Message = fmt.Sprintf("%s %s limit of %d reached: %d used, %d needed; %s.", scopeName(l.Scope), windowAdjective(l.Window), l.Cap, le.Used, le.Amount, reset)
	return e
}

// scopeName names a limit's scope at the start of a refusal: "Organization", "Key <id>",
// "Project <id>".
func scopeName(s balance.Scope) string {
	switch {
	case s.Kind == balance.ScopeOrg:
		return "Organization"
	case s.Kind == balance.ScopeEndUser && s.ID == "":
		return "End user's" // a limit of each end user apart: this request's end user's counter
	case s.Kind == balance.ScopeEndUser:
		return "End user " + s.ID
	}
	k := string(s.Kind)
	return strings.ToUpper(k[:1]) + k[1:] + " " + s.ID
}

func windowAdjective(w balance.Window) string {
	switch w {
	case balance.Minute:
		return "per-minute"
	case balance.Hour:
		return "hourly"
	case balance.Day:
		return "daily"
	case balance.Week:
		return "weekly"
	case balance.Month:
		return "monthly"
	}
	return string(w) // lifetime
}

// frozenRefusal is the 403 of a hold refused because a scope of the request is frozen:
// account_frozen for the org, key_frozen for the key or its project (the message says which).
func frozenRefusal(s balance.Scope) *Error {
	e := &Error{Status: http.StatusForbidden, Type: TypeInvalidRequest, Code: CodeKeyFrozen, NoRetry: true}
	switch s.Kind {
	case balance.ScopeKey:
		e.Message = "This API key (" + s.ID + ") is frozen: its new requests are refused until it is unfrozen."
	case balance.ScopeProject:
		e.Message = "The project " + s.ID + " of this API key is frozen: its keys' new requests are refused until it is unfrozen."
	default:
		e.Code = CodeAccountFrozen
		e.Message = "Your organization is frozen: its new requests are refused until it is unfrozen."
	}
	return e
}
