package console

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
)

//go:embed templates/*.html static/*
var files embed.FS

// page is one page's template: the layout with the page's "content".
type page struct{ t *template.Template }

var pageNames = []string{"login", "orgs", "org", "models", "audit", "webhooks", "me", "error"}

func parsePages() (map[string]*page, error) {
	funcs := template.FuncMap{"money": Money, "ts": timestamp, "i64": func(v int64) string { return strconv.FormatInt(v, 10) },
		"amount": limitAmount, "deref": func(p *int64) int64 {
			if p == nil {
				return 0
			}
			return *p
		}}
	out := map[string]*page{}
	for _, n := range pageNames {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(files, "templates/layout.html", "templates/charts.html", "templates/"+n+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", n, err)
		}
		out[n] = &page{t: t}
	}
	return out, nil
}

// layout is what every page's frame shows.
type layout struct {
	Title    string
	Operator bool
	Customer bool
	Org      string // the customer's org
	CSRF     string
	Flash    []flash
	Data     any
}

// render writes page name with data in the layout.
func (c *Console) render(ec echo.Context, status int, name string, sess *session, title string, data any) error {
	l := layout{Title: title, Data: data}
	if sess != nil {
		l.Operator, l.Customer, l.CSRF, l.Org = sess.operator, !sess.operator, sess.csrf, sess.org
		l.Flash = c.sessions.takeFlash(sess)
	}
	var b bytes.Buffer
	if err := c.pages[name].t.Execute(&b, l); err != nil {
		c.log.Error("console render", "page", name, "err", err)
		return ec.String(http.StatusInternalServerError, "internal error")
	}
	return ec.HTMLBlob(status, b.Bytes())
}

// failPage answers a read that failed: 404 for what does not exist, 503 while a store is
// unavailable, else 500 (logged).
func (c *Console) failPage(ec echo.Context, err error) error {
	status, msg := http.StatusInternalServerError, "internal error"
	switch {
	case errors.Is(err, ledger.ErrUnknownOrg):
		status, msg = http.StatusNotFound, "no such org"
	case errors.Is(err, balance.ErrInvalidOrg), errors.Is(err, ledger.ErrInvalidCursor):
		status, msg = http.StatusBadRequest, err.Error()
	case errors.Is(err, ledger.ErrLedgerUnavailable):
		status, msg = http.StatusServiceUnavailable, "the ledger is unavailable; retry in a moment"
	case errors.Is(err, accounting.ErrHotBalance):
		status, msg = http.StatusServiceUnavailable, "the hot balance (Redis) is unavailable; retry in a moment"
	default:
		c.log.Error("console page failed", "path", ec.Path(), "err", err)
	}
	return c.render(ec, status, "error", sessionOf(ec), "Error", msg)
}

// Money is micro-units as an exact decimal of currency units, trailing zeros dropped:
// 1950810 → "1.95081", -5 → "-0.000005". The console shows every amount this way.
func Money(micro int64) string {
	neg := micro < 0
	u := uint64(micro)
	if neg {
		u = -u
	}
	digits := strconv.FormatUint(u, 10)
	if len(digits) <= 6 {
		digits = strings.Repeat("0", 7-len(digits)) + digits
	}
	whole, frac := digits[:len(digits)-6], strings.TrimRight(digits[len(digits)-6:], "0")
	out := whole
	if frac != "" {
		out += "." + frac
	}
	if neg {
		out = "-" + out
	}
	return out
}

// limitAmount is a limit's cap or use in its unit: money as Money, requests and tokens as
// integers.
func limitAmount(unit string, v int64) string {
	if isMoney(unit) {
		return Money(v)
	}
	return strconv.FormatInt(v, 10)
}

func timestamp(t any) string {
	switch v := t.(type) {
	case time.Time:
		if v.IsZero() {
			return ""
		}
		return v.UTC().Format("2006-01-02 15:04:05Z")
	case *time.Time:
		if v == nil {
			return ""
		}
		return timestamp(*v)
	}
	return ""
}

// staticHandler serves the embedded stylesheet.
func staticHandler() echo.HandlerFunc {
	sub, _ := fs.Sub(files, "static")
	h := http.StripPrefix("/console/static/", http.FileServer(http.FS(sub)))
	return func(c echo.Context) error {
		c.Response().Header().Set("Cache-Control", "public, max-age=3600")
		h.ServeHTTP(c.Response(), c.Request())
		return nil
	}
}
