package console

import (
	"crypto/subtle"
	"errors"
	"net/http"
	"net/url"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger"
)

const sessionKey = "escrow.console.session"

func sessionOf(c echo.Context) *session { s, _ := c.Get(sessionKey).(*session); return s }

// setCookie sets a console cookie: HttpOnly, SameSite=Strict, path /console/, Secure over TLS.
func setCookie(c echo.Context, name, value string, maxAge int) {
	c.SetCookie(&http.Cookie{Name: name, Value: value, Path: "/console/", MaxAge: maxAge, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: c.Request().TLS != nil})
}

// sameOrigin refuses a write a browser says came from another site (Sec-Fetch-Site, Origin):
// besides the CSRF token and SameSite=Strict, a third check that costs nothing.
func sameOrigin(r *http.Request) bool {
	switch r.Header.Get("Sec-Fetch-Site") {
	case "", "same-origin", "none":
	default:
		return false
	}
	if o := r.Header.Get("Origin"); o != "" && o != "null" {
		u, err := url.Parse(o)
		if err != nil || u.Host != r.Host {
			return false
		}
	}
	return true
}

// session finds the request's session: without one a page redirects to the login and a write
// is refused; a write must carry the session's CSRF token (form field _csrf) and come from
// this origin.
func (c *Console) session(next echo.HandlerFunc) echo.HandlerFunc {
	return func(ec echo.Context) error {
		var sess *session
		if ck, err := ec.Cookie(CookieName); err == nil {
			sess = c.sessions.get(ck.Value)
		}
		r := ec.Request()
		if sess == nil {
			if r.Method == http.MethodGet {
				return ec.Redirect(http.StatusSeeOther, "/console/login")
			}
			return ec.String(http.StatusForbidden, "not logged in")
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			tok := ec.FormValue("_csrf")
			if !sameOrigin(r) || subtle.ConstantTimeCompare([]byte(tok), []byte(sess.csrf)) != 1 {
				return ec.String(http.StatusForbidden, "invalid CSRF token: reload the page and try again")
			}
		}
		ec.Set(sessionKey, sess)
		return next(ec)
	}
}

// operator lets only an operator's session through.
func (c *Console) operator(next echo.HandlerFunc) echo.HandlerFunc {
	return func(ec echo.Context) error {
		if !sessionOf(ec).operator {
			return ec.String(http.StatusForbidden, "operators only")
		}
		return next(ec)
	}
}

// customer lets only a customer's session through, and only while its key still works (a
// revoked key ends the session).
func (c *Console) customer(next echo.HandlerFunc) echo.HandlerFunc {
	return func(ec echo.Context) error {
		sess := sessionOf(ec)
		if sess.operator {
			return ec.Redirect(http.StatusSeeOther, "/console/orgs")
		}
		k, err := c.ops.Ledger().LookupKey(ec.Request().Context(), sess.secret)
		switch {
		case errors.Is(err, ledger.ErrUnknownKey) || (err == nil && (k.ID != sess.keyID || k.Org != sess.org)):
			c.sessions.drop(sess.id)
			return ec.Redirect(http.StatusSeeOther, "/console/login")
		case err != nil:
			return c.failPage(ec, err)
		}
		return next(ec)
	}
}

func (c *Console) home(ec echo.Context) error {
	if ck, err := ec.Cookie(CookieName); err == nil {
		if sess := c.sessions.get(ck.Value); sess != nil {
			if sess.operator {
				return ec.Redirect(http.StatusSeeOther, "/console/orgs")
			}
			return ec.Redirect(http.StatusSeeOther, "/console/me")
		}
	}
	return ec.Redirect(http.StatusSeeOther, "/console/login")
}

type loginData struct {
	CSRF     string
	Error    string
	Operator bool // the operator's form is offered
}

func (c *Console) loginPage(ec echo.Context) error {
	return c.renderLogin(ec, http.StatusOK, "")
}

func (c *Console) renderLogin(ec echo.Context, status int, msg string) error {
	tok := randomToken()
	setCookie(ec, loginCookie, tok, 3600)
	return c.render(ec, status, "login", nil, "Log in", loginData{CSRF: tok, Error: msg, Operator: c.admin != nil})
}

// login starts a session for an admin token (kind=operator) or an API key (kind=customer). The
// form's token must match the login cookie (double submit: a page of another site cannot
// log a browser in as someone else).
func (c *Console) login(ec echo.Context) error {
	r := ec.Request()
	ck, err := ec.Cookie(loginCookie)
	if err != nil || !sameOrigin(r) || subtle.ConstantTimeCompare([]byte(ec.FormValue("_csrf")), []byte(ck.Value)) != 1 {
		return c.renderLogin(ec, http.StatusForbidden, "The login form expired: try again.")
	}
	secret := strings.TrimSpace(ec.FormValue("secret"))
	sess := &session{}
	switch ec.FormValue("kind") {
	case "operator":
		if c.admin == nil || secret == "" || c.check(r.Context(), secret) != nil {
			return c.renderLogin(ec, http.StatusUnauthorized, "Wrong admin token.")
		}
		sess.operator, sess.token = true, secret
	case "customer":
		if secret == "" {
			return c.renderLogin(ec, http.StatusUnauthorized, "Wrong API key.")
		}
		k, err := c.ops.Ledger().LookupKey(r.Context(), secret)
		if errors.Is(err, ledger.ErrUnknownKey) {
			return c.renderLogin(ec, http.StatusUnauthorized, "Wrong API key.")
		}
		if err != nil {
			return c.failPage(ec, err)
		}
		sess.secret, sess.org, sess.keyID = secret, k.Org, k.ID
	default:
		return c.renderLogin(ec, http.StatusBadRequest, "Choose how to log in.")
	}
	sess = c.sessions.add(sess)
	setCookie(ec, loginCookie, "", -1)
	setCookie(ec, CookieName, sess.id, int(c.sessions.ttl.Seconds()))
	if sess.operator {
		return ec.Redirect(http.StatusSeeOther, "/console/orgs")
	}
	return ec.Redirect(http.StatusSeeOther, "/console/me")
}

func (c *Console) logout(ec echo.Context) error {
	c.sessions.drop(sessionOf(ec).id)
	setCookie(ec, CookieName, "", -1)
	return ec.Redirect(http.StatusSeeOther, "/console/login")
}
