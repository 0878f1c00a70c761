package middleware

import (
	"net/http"

	"github.com/labstack/echo/v4"
)

// identityKey is where the middleware leaves the Identity of an authenticated request on its
// echo.Context.
const identityKey = "escrow.identity"

// IdentityOf is who the middleware found the request to be from (Config.OrgFunc: by default
// the API key's org and key id), for a handler behind it — a PassThrough path such as the
// customer's own view of its balance. ok is false when the request did not pass the middleware
// (skipped, or refused before its identity was known).
func IdentityOf(c echo.Context) (id Identity, ok bool) {
	id, ok = c.Get(identityKey).(Identity)
	return id, ok
}

// SetHeaders sets on h the headers that go with e (Retry-After, x-should-retry,
// x-escrow-limit-reset), for a Config.ErrorHandler that writes e in a shape of its own.
func (e *Error) SetHeaders(h http.Header) { e.setHeaders(h) }
