package console

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
)

// The writes. Each turns its form into the admin API's request and sends it, in process, to the
// admin API's handler with the operator's token: the admin API checks the token (its scope,
// once scoped tokens land), validates, calls accounting.Ops and records the audit trail, so no
// rule of a write is repeated here. The answer comes back to the org's page as a message.

// forward sends one admin API request and returns its status and body.
func (c *Console) forward(ctx context.Context, sess *session, method, path string, body any) (int, []byte) {
	var rd *bytes.Reader
	if body != nil {
		j, err := json.Marshal(body)
		if err != nil {
			return http.StatusInternalServerError, nil
		}
		rd = bytes.NewReader(j)
	}
	var req *http.Request
	if rd != nil {
		req, _ = http.NewRequestWithContext(ctx, method, c.prefix+path, rd)
	} else {
		req, _ = http.NewRequestWithContext(ctx, method, c.prefix+path, http.NoBody)
	}
	req.Header.Set("Authorization", "Bearer "+sess.token)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(admin.ActorHeader, "console")
	w := &answer{header: http.Header{}}
	c.admin.ServeHTTP(w, req)
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.status, w.body.Bytes()
}

// answer is an in-memory http.ResponseWriter for forward.
type answer struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (a *answer) Header() http.Header { return a.header }
func (a *answer) Write(p []byte) (int, error) {
	if a.status == 0 {
		a.status = http.StatusOK
	}
	return a.body.Write(p)
}
func (a *answer) WriteHeader(s int) {
	if a.status == 0 {
		a.status = s
	}
}

// errorMessage is the message of an admin API error answer.
func errorMessage(status int, body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
		return e.Error.Message
	}
	return http.StatusText(status)
}

// write sends the request and redirects to the org's page with its outcome as a message (ok
// says what succeeded, from the answer's body).
func (c *Console) write(ec echo.Context, method, path string, body any, ok func(body []byte) flash) error {
	sess := sessionOf(ec)
	status, out := c.forward(ec.Request().Context(), sess, method, path, body)
	if status >= 300 {
		c.sessions.addFlash(sess, flash{Error: true, Text: errorMessage(status, out)})
	} else {
		c.sessions.addFlash(sess, ok(out))
	}
	return ec.Redirect(http.StatusSeeOther, "/console/orgs/"+url.PathEscape(ec.Param("org")))
}

// refuse redirects to the org's page with a message about the form.
func (c *Console) refuse(ec echo.Context, msg string) error {
	c.sessions.addFlash(sessionOf(ec), flash{Error: true, Text: msg})
	return ec.Redirect(http.StatusSeeOther, "/console/orgs/"+url.PathEscape(ec.Param("org")))
}

func orgPath(ec echo.Context) string { return "/orgs/" + url.PathEscape(ec.Param("org")) }

func done(text string) func([]byte) flash { return func([]byte) flash { return flash{Text: text} } }

// parseAmount reads a form amount: for money, currency units as an exact decimal ("1.5" is
// 1,500,000 micro-units, never through a float); for requests and tokens, an integer.
func parseAmount(s string, money bool) (int64, error) {
	s = strings.TrimSpace(s)
	neg := strings.HasPrefix(s, "-")
	if neg {
		s = s[1:]
	}
	var v int64
	var err error
	if money {
		v, _, err = pricing.DecimalMicros(s, 6, false)
	} else {
		v, err = strconv.ParseInt(s, 10, 64)
		if err == nil && v < 0 {
			err = fmt.Errorf("not a whole number ≥ 0")
		}
	}
	if err != nil {
		return 0, fmt.Errorf("%q is not an amount: %w", s, err)
	}
	if neg {
		v = -v
	}
	return v, nil
}

// credit: a credit (amount > 0) or an adjustment (kind=adjust, either sign), in currency units;
// the reference comes with the form, so sending it twice credits once.
func (c *Console) credit(ec echo.Context) error {
	amount, err := parseAmount(ec.FormValue("amount"), true)
	if err != nil {
		return c.refuse(ec, err.Error())
	}
	route := "/credits"
	if ec.FormValue("kind") == "adjust" {
		route = "/adjustments"
	}
	body := map[string]any{"amount": amount, "reference": ec.FormValue("reference")}
	return c.write(ec, http.MethodPost, orgPath(ec)+route, body, done("Recorded "+Money(amount)+"."))
}

func (c *Console) createKey(ec echo.Context) error {
	body := map[string]any{"name": ec.FormValue("name")}
	return c.write(ec, http.MethodPost, orgPath(ec)+"/keys", body, func(out []byte) flash {
		var k admin.NewKey
		_ = json.Unmarshal(out, &k)
		return flash{Text: "Key " + k.ID + " created. Copy its secret now: it is not shown again.", Secret: k.Key}
	})
}

func (c *Console) revokeKey(ec echo.Context) error {
	return c.write(ec, http.MethodDelete, "/keys/"+url.PathEscape(ec.Param("id")), nil, done("Key "+ec.Param("id")+" revoked."))
}

func (c *Console) createLimit(ec echo.Context) error {
	unit := ec.FormValue("unit")
	capV, err := parseAmount(ec.FormValue("cap"), isMoney(unit))
	if err != nil {
		return c.refuse(ec, "cap (unit "+unit+"): "+err.Error())
	}
	body := map[string]any{"scope": ec.FormValue("scope"), "window": ec.FormValue("window"), "unit": unit, "cap": capV}
	if id := strings.TrimSpace(ec.FormValue("scope_id")); id != "" {
		body["scope_id"] = id
	}
	return c.write(ec, http.MethodPost, orgPath(ec)+"/limits", body, func(out []byte) flash {
		var l admin.Limit
		_ = json.Unmarshal(out, &l)
		return flash{Text: "Limit " + l.ID + " created."}
	})
}

// isMoney: a limit's unit is money (the form's "money", or none: balance.Money is "").
func isMoney(unit string) bool { return unit == "money" || unit == string(balance.Money) }

func (c *Console) setLimitCap(ec echo.Context) error {
	unit := ec.FormValue("unit")
	capV, err := parseAmount(ec.FormValue("cap"), isMoney(unit))
	if err != nil {
		return c.refuse(ec, err.Error())
	}
	return c.write(ec, http.MethodPatch, orgPath(ec)+"/limits/"+url.PathEscape(ec.Param("id")), map[string]any{"cap": capV},
		done("Limit "+ec.Param("id")+" changed."))
}

func (c *Console) deleteLimit(ec echo.Context) error {
	return c.write(ec, http.MethodDelete, orgPath(ec)+"/limits/"+url.PathEscape(ec.Param("id")), nil, done("Limit "+ec.Param("id")+" deleted."))
}

func (c *Console) freeze(frozen bool) echo.HandlerFunc {
	route, text := "/freeze", "Org frozen: new requests are refused."
	if !frozen {
		route, text = "/unfreeze", "Org unfrozen."
	}
	return func(ec echo.Context) error { return c.write(ec, http.MethodPost, orgPath(ec)+route, nil, done(text)) }
}
