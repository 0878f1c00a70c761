// Package console is escrow's web console, served under /console/ by `escrow serve`: pages an
// operator reads (orgs, balances, usage charts by day and model, entries, holds in flight, keys,
// limits, webhooks, the audit trail, models and prices) and a page of their own for each
// customer (balance, credits, usage charts, requests), rendered on the server with html/template
// from embedded files; no script runs in the browser (charts are inline SVG drawn here).
//
// Every number on a page is read through accounting.Ops (and the ledger roles it hands out),
// the same calls the admin API and the customer views answer from; every write is sent, in
// process, to the admin API's own handler (Config.Admin) with the operator's token, so each
// rule, check and audit record of a write lives in one place.
//
// Security: an operator logs in with an admin token (checked through Config.CheckAdmin), a
// customer with one of their API keys; either gets a session cookie (HttpOnly, SameSite=Strict,
// Secure over TLS, path /console/) naming a session kept in this process's memory; every form
// carries the session's CSRF token; answers carry a Content-Security-Policy that allows no script,
// no inline style and no framing.
//
//	con, err := console.New(esc.Ops(), &console.Config{Admin: adminHandler, Token: token})
//	con.Register(e.Group("/console"))
package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
)

// Defaults of Config.
const (
	DefaultAdminPrefix = "/admin/v1"
	DefaultSessionTTL  = 12 * time.Hour
	DefaultMaxSessions = 10_000
)

// CookieName is the session cookie's name.
const CookieName = "escrow_console"

// loginCookie carries the login form's CSRF token (double submit) before there is a session.
const loginCookie = "escrow_console_login"

// ErrBadToken is what a Config.CheckAdmin answers for a token that is not an operator's.
var ErrBadToken = errors.New("console: not an admin token")

// Config configures the console. Zero fields take the documented defaults.
type Config struct {
	// Admin is the admin API's handler, routes under AdminPrefix (admin.API registered on an
	// Echo of its own): every write of the console is a request to it. Nil: operators cannot
	// log in (customers still can).
	Admin http.Handler
	// AdminPrefix is where Admin serves the admin API. Default DefaultAdminPrefix.
	AdminPrefix string
	// Token is the bootstrap admin token (ESCROW_ADMIN_TOKEN), which the default CheckAdmin
	// accepts (compared in constant time).
	Token string
	// CheckAdmin decides at login whether token is an operator's (nil error). It is the seam
	// for scoped admin tokens; the token is then sent with each write, so the admin API
	// checks its scope again. Default: token equals Token.
	CheckAdmin func(ctx context.Context, token string) error
	// SessionTTL is how long a session lasts after login. Default DefaultSessionTTL.
	SessionTTL time.Duration
	// MaxSessions bounds the sessions kept at once (the oldest is dropped). Default
	// DefaultMaxSessions.
	MaxSessions int
	// Logger receives unexpected errors. Default slog.Default().
	Logger *slog.Logger
	// Now is the clock of sessions and of the charts' last 30 days. Default time.Now.
	Now func() time.Time
}

// Console serves the pages. Make it with New, mount it with Register.
type Console struct {
	ops      *accounting.Ops
	admin    http.Handler
	prefix   string
	check    func(context.Context, string) error
	sessions *sessions
	log      *slog.Logger
	now      func() time.Time
	pages    map[string]*page
}

// New returns the console over ops.
func New(ops *accounting.Ops, cfg *Config) (*Console, error) {
	if ops == nil {
		return nil, errors.New("console: nil ops")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.AdminPrefix == "" {
		c.AdminPrefix = DefaultAdminPrefix
	}
	if c.SessionTTL <= 0 {
		c.SessionTTL = DefaultSessionTTL
	}
	if c.MaxSessions <= 0 {
		c.MaxSessions = DefaultMaxSessions
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.CheckAdmin == nil {
		want := []byte(c.Token)
		c.CheckAdmin = func(_ context.Context, token string) error {
			if len(want) == 0 || subtle.ConstantTimeCompare([]byte(token), want) != 1 {
				return ErrBadToken
			}
			return nil
		}
	}
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	return &Console{ops: ops, admin: c.Admin, prefix: c.AdminPrefix, check: c.CheckAdmin,
		sessions: newSessions(c.SessionTTL, c.MaxSessions, c.Now), log: c.Logger.With("component", "escrow.console"),
		now: c.Now, pages: pages}, nil
}

// Register adds the console's routes to g (escrow serve mounts it at /console).
func (c *Console) Register(g *echo.Group) {
	g.Use(secureHeaders)
	g.GET("", c.home)
	g.GET("/", c.home)
	g.GET("/static/*", staticHandler())
	g.GET("/login", c.loginPage)
	g.POST("/login", c.login)
	g.POST("/logout", c.logout, c.session)

	op := func(method, path string, h echo.HandlerFunc) { g.Add(method, path, h, c.session, c.operator) }
	op(http.MethodGet, "/orgs", c.orgsPage)
	op(http.MethodGet, "/orgs/:org", c.orgPage)
	op(http.MethodGet, "/models", c.modelsPage)
	op(http.MethodGet, "/audit", c.auditPage)
	op(http.MethodGet, "/webhooks", c.webhooksPage)
	op(http.MethodPost, "/orgs/:org/credits", c.credit)
	op(http.MethodPost, "/orgs/:org/keys", c.createKey)
	op(http.MethodPost, "/orgs/:org/keys/:id/revoke", c.revokeKey)
	op(http.MethodPost, "/orgs/:org/limits", c.createLimit)
	op(http.MethodPost, "/orgs/:org/limits/:id", c.setLimitCap)
	op(http.MethodPost, "/orgs/:org/limits/:id/delete", c.deleteLimit)
	op(http.MethodPost, "/orgs/:org/freeze", c.freeze(true))
	op(http.MethodPost, "/orgs/:org/unfreeze", c.freeze(false))

	g.GET("/me", c.mePage, c.session, c.customer)
}

// secureHeaders sets the headers of every console answer: a Content-Security-Policy that
// allows the console's own stylesheet and nothing else (no script at all, no inline style, no
// framing, forms posting only here), no MIME sniffing, no referrer, no caching.
func secureHeaders(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		h := c.Response().Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		return next(c)
	}
}

// randomToken is 32 random bytes in hex.
func randomToken() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err) // crypto/rand never fails on a supported platform
	}
	return hex.EncodeToString(b)
}

// session is one login: an operator's (with the token its writes are sent with) or a
// customer's (with the key it logged in with, checked again on every page).
type session struct {
	id, csrf string
	operator bool
	token    string // the operator's admin token
	secret   string // the customer's API key
	org      string // the customer's org
	keyID    string // the customer's key
	expires  time.Time
	flash    []flash // messages for the next page, shown once
}

// flash is a message a write leaves for the page it redirects to.
type flash struct {
	Error  bool
	Text   string
	Secret string // a new key's secret, shown once
}

// sessions are the logins of this process, in memory (a restart, or another instance behind a
// load balancer without sticky sessions, asks to log in again).
type sessions struct {
	mu  sync.Mutex
	m   map[string]*session
	ttl time.Duration
	max int
	now func() time.Time
}

func newSessions(ttl time.Duration, max int, now func() time.Time) *sessions {
	return &sessions{m: map[string]*session{}, ttl: ttl, max: max, now: now}
}

// add starts a session (a new id at every login: no fixation).
func (s *sessions) add(sess *session) *session {
	sess.id, sess.csrf = randomToken(), randomToken()
	now := s.now()
	sess.expires = now.Add(s.ttl)
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.m) >= s.max {
		var oldest *session
		for _, o := range s.m {
			if o.expires.Before(now) {
				delete(s.m, o.id)
			} else if oldest == nil || o.expires.Before(oldest.expires) {
				oldest = o
			}
		}
		if len(s.m) >= s.max && oldest != nil {
			delete(s.m, oldest.id)
		}
	}
	s.m[sess.id] = sess
	return sess
}

func (s *sessions) get(id string) *session {
	s.mu.Lock()
	defer s.mu.Unlock()
	sess := s.m[id]
	if sess != nil && !s.now().Before(sess.expires) {
		delete(s.m, id)
		return nil
	}
	return sess
}

func (s *sessions) drop(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, id)
}

func (s *sessions) addFlash(sess *session, f flash) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sess.flash = append(sess.flash, f)
}

func (s *sessions) takeFlash(sess *session) []flash {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := sess.flash
	sess.flash = nil
	return f
}
