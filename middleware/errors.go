package middleware

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"

	"github.com/labstack/echo/v4"
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
	CodeServiceUnavailable = "service_unavailable"
	CodeInternal           = "internal_error"
	CodeBillingFailed      = "billing_unavailable"
)

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
}

func (e *Error) Error() string {
	return "middleware: " + strconv.Itoa(e.Status) + " " + e.Code + ": " + e.Message
}

// Body returns the JSON body of the error.
func (e *Error) Body() []byte {
	if e.Anthropic {
		type inner struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		}
		b, _ := json.Marshal(struct {
			Type  string `json:"type"`
			Error inner  `json:"error"`
		}{"error", inner{Type: e.Type, Message: e.Message}})
		return b
	}
	type inner struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	}
	in := inner{Message: e.Message, Type: e.Type}
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

func errUnavailable(msg string, retry time.Duration) *Error {
	return &Error{Status: http.StatusServiceUnavailable, Type: TypeServiceUnavailable, Code: CodeServiceUnavailable, Message: msg, RetryAfter: retry}
}

func errInternal(msg string) *Error {
	return &Error{Status: http.StatusInternalServerError, Type: TypeServer, Code: CodeInternal, Message: msg}
}
