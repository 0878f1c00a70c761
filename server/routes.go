package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/middleware"
)

// buildEcho mounts the probes, /metrics, the admin API (when a token is set) and the proxy
// behind the journal gate and the middleware.
func (s *Server) buildEcho() error {
	e := echo.New()
	e.HideBanner, e.HidePort = true, true
	e.HTTPErrorHandler = s.httpError
	if s.cfg.TrustedProxies != "" {
		e.IPExtractor = trustedXFF(s.cfg.TrustedProxies)
	}
	e.GET("/healthz", func(c echo.Context) error { return c.JSON(http.StatusOK, map[string]string{"status": "ok"}) })
	e.GET("/readyz", s.ready)
	e.GET("/metrics", echo.WrapHandler(s.metrics.handler()))
	if s.cfg.AdminToken != "" && s.cfg.Role != RoleProxy {
		if err := s.esc.MountAdmin(e.Group("/admin/v1")); err != nil {
			return fmt.Errorf("admin api: %w", err)
		}
	}
	if s.cfg.Role != RoleProxy {
		s.mountPayments(e) // payments credit orgs: an admin-plane write
		if s.cfg.Console && !s.cfg.BenchBaseline {
			if err := s.mountConsole(e); err != nil { // console.go: its writes go through the admin API
				return err
			}
		}
	}
	if s.cfg.Role == RoleAdmin { // role.go
		s.echo = e
		return nil
	}
	mw := s.esc.Middleware()
	rp := s.proxyHandler()
	if s.cfg.BenchBaseline {
		s.log.Warn("ESCROW_BENCH_BASELINE is set: requests pass without holds and are not billed")
		e.Any("/v1/*", rp)
	} else {
		e.Any("/v1/*", rp, s.journalGate, mw)
		// Authenticated by the middleware (PassThrough), unbilled, answered here.
		e.GET("/v1/models", s.listModels, mw)
		e.GET("/v1/models/*", s.getModel, mw)
		s.mountView(e, mw)
		s.jobProxy = s.reverseProxy()
		s.mountJobs(e, mw)
	}
	s.echo = e
	return nil
}

// trustedXFF is the client's address as the trusted proxies (ESCROW_TRUSTED_PROXIES, already
// validated) report it in X-Forwarded-For: the nearest address of the chain that is not one of
// them. Echo's default trust of loopback, link-local and private peers is turned off: only the
// configured ranges are trusted.
func trustedXFF(cidrs string) echo.IPExtractor {
	nets, _ := parseCIDRs(cidrs)
	opts := []echo.TrustOption{echo.TrustLoopback(false), echo.TrustLinkLocal(false), echo.TrustPrivateNet(false)}
	for _, n := range nets {
		opts = append(opts, echo.TrustIPRange(n))
	}
	return echo.ExtractIPFromXFFHeader(opts...)
}

// httpError answers Echo's own errors (unknown route, wrong method, …) in OpenAI's shape, with
// a snake_case code made from the status ("not_found", "method_not_allowed").
func (s *Server) httpError(err error, c echo.Context) {
	if c.Response().Committed {
		return
	}
	code := http.StatusInternalServerError
	msg := "internal error"
	var he *echo.HTTPError
	if errors.As(err, &he) {
		code = he.Code
		msg = fmt.Sprint(he.Message)
	} else {
		s.log.Error("request failed", "path", c.Path(), "err", err)
	}
	typ := middleware.TypeInvalidRequest
	if code >= 500 {
		typ = middleware.TypeServer
	}
	_ = s.writeRefusal(c, &middleware.Error{Status: code, Type: typ, Code: statusCode(code), Message: msg})
}

// statusCode is the error code of an HTTP status: its text in snake_case ("Not Found" →
// "not_found"), or "http_<code>" for a status without a text.
func statusCode(status int) string {
	t := http.StatusText(status)
	if t == "" {
		return fmt.Sprintf("http_%d", status)
	}
	var b strings.Builder
	for _, r := range strings.ToLower(t) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		case r == ' ' || r == '-':
			b.WriteByte('_')
		}
	}
	return b.String()
}

// proxyHandler forwards each request to the upstream the middleware's Route chose for its
// model (without the middleware, in the benchmark baseline: the catch-all route of its style);
// anything else gets a 404.
func (s *Server) proxyHandler() echo.HandlerFunc {
	rp := s.reverseProxy()
	return func(c echo.Context) error {
		req := c.Request()
		u, _ := c.Get(routeKey).(*upstream)
		if u == nil && s.cfg.BenchBaseline {
			u = s.routes.catchAll(styleOf(req.URL.Path))
		}
		// With the middleware, a request without a route is one it passed unpriced (a
		// PassThrough path such as DELETE /v1/models/{id}): never sent upstream with the
		// operator's key.
		if u == nil {
			e := &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest, Code: middleware.CodeNotFound,
				Message: "Invalid URL (" + req.Method + " " + req.URL.Path + ")"}
			if isAnthropicPath(req.URL.Path) {
				e.Type, e.Anthropic = middleware.AnthropicNotFound, true
			}
			return middleware.WriteError(c, e)
		}
		rp.ServeHTTP(finalOnly{c.Response()}, req.WithContext(context.WithValue(req.Context(), upstreamCtxKey{}, u)))
		return nil
	}
}

// reverseProxy forwards to the request's upstream (on its context) with that upstream's key;
// the client's key never leaves. Only allow-listed headers cross it, in either direction
// (headers.go), and the upstream's interim responses never reach the client (finalOnly).
func (s *Server) reverseProxy() http.Handler {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 1024
	tr.MaxIdleConnsPerHost = 1024
	tr.ResponseHeaderTimeout = 10 * time.Minute
	// Validated with the configuration: these cannot fail here.
	reqList, _ := parseHeaderList(s.cfg.UpstreamRequestHeaders, neverRequestHeaders)
	respList, _ := parseHeaderList(s.cfg.UpstreamResponseHeaders, neverResponseHeaders)
	reqHeaders := newHeaderPolicy(alwaysRequestHeaders, reqList, neverRequestHeaders)
	respHeaders := newHeaderPolicy(alwaysResponseHeaders, respList, neverResponseHeaders)
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			up := pr.In.Context().Value(upstreamCtxKey{}).(*upstream)
			pr.SetURL(up.base)
			pr.Out.URL.RawQuery = upstreamQuery(up.base.RawQuery, pr.In.URL)
			if q, ok := pr.In.Context().Value(jobQueryKey{}).(string); ok && q != "" { // a job route's own allow-list (jobs.go)
				pr.Out.URL.RawQuery = strings.TrimPrefix(up.base.RawQuery+"&"+q, "&")
			}
			pr.Out.Host = up.base.Host
			reqHeaders.filter(pr.Out.Header)
			up.setKey(pr.Out.Header)
		},
		ModifyResponse: func(res *http.Response) error {
			respHeaders.filter(res.Header)
			respHeaders.filter(res.Trailer)
			// X-Request-Id is escrow's (the hold id, set by the middleware); the upstream's comes
			// back as X-Upstream-Request-Id, so both ids reach the client.
			if id := res.Header.Get("X-Request-Id"); id != "" {
				res.Header.Del("X-Request-Id")
				res.Header.Set("X-Upstream-Request-Id", id)
			}
			return nil
		},
		Transport:     tr,
		FlushInterval: -1,
		BufferPool:    proxyBuffers,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			s.log.Warn("upstream error", "err", err, "path", r.URL.Path)
			e := &middleware.Error{Type: middleware.TypeServer, Code: "upstream_error", Message: "upstream unavailable"}
			if isAnthropicPath(r.URL.Path) {
				e.Type, e.Anthropic = middleware.AnthropicAPI, true
			}
			body := e.Body()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			_, _ = w.Write(body)
		},
	}
	return rp
}

// queryAllowed are the client's query parameters the upstream gets, by path, with the values
// each may have: the Anthropic SDKs' beta=true on the Messages API. Every other parameter is
// dropped: the upstream is paid for with the operator's key, and a parameter escrow does not
// read could change what a call does or costs. Parameters an upstream needs (Azure's
// api-version) belong in its configured URL, whose query is always kept.
var queryAllowed = map[string]map[string][]string{
	endpoint.Messages.Path:    {"beta": {"true", "false"}},
	endpoint.CountTokens.Path: {"beta": {"true", "false"}},
}

// upstreamQuery is the query of an upstream request: the upstream URL's own (base), then the
// client's parameters that queryAllowed lets through for its path.
func upstreamQuery(base string, in *url.URL) string {
	allowed := queryAllowed[in.Path]
	if len(allowed) == 0 || in.RawQuery == "" {
		return base
	}
	kept := url.Values{}
	for name, vs := range in.Query() {
		for _, v := range vs {
			if slices.Contains(allowed[name], v) {
				kept.Add(name, v)
			}
		}
	}
	q := kept.Encode()
	switch {
	case q == "":
		return base
	case base == "":
		return q
	}
	return base + "&" + q
}

// journalGate refuses new requests (503 before any hold is taken) while the local journal is
// nearly full, so the requests already in flight still have room to be journaled.
func (s *Server) journalGate(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if !s.recorder.Degraded() {
			return next(c)
		}
		s.metrics.journalRefused.Inc()
		return middleware.WriteError(c, &middleware.Error{
			Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable, Code: middleware.CodeServiceUnavailable,
			RetryAfter: 5 * time.Second,
			Message:    "The billing service is degraded (the ledger is unreachable and the local journal is nearly full); please retry later.",
		})
	}
}

// ready answers the readiness probe. It has no authentication, so it says only "ok" or "down"
// per part (and the journal's fill): the errors, which carry addresses and database users, go
// to the log.
func (s *Server) ready(c echo.Context) error {
	// The two checks run side by side, each within its own bound: a Redis that refuses
	// connections spends its whole bound on dial retries, and must not leave the ledger's check
	// an expired context (which reported a healthy ledger down).
	check := func(f func(context.Context) error) <-chan error {
		ch := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(c.Request().Context(), 2*time.Second)
			defer cancel()
			ch <- f(ctx)
		}()
		return ch
	}
	redisErr := check(func(ctx context.Context) error { return s.rdb.Ping(ctx).Err() })
	ledgerErr := check(func(ctx context.Context) error { _, err := s.ledger.Epoch(ctx); return err })
	checks := map[string]string{"redis": "ok", "ledger": "ok"}
	status := http.StatusOK
	if err := <-redisErr; err != nil {
		s.log.Warn("readiness: redis unreachable", "err", err)
		checks["redis"], status = "down", http.StatusServiceUnavailable
	}
	if err := <-ledgerErr; err != nil {
		s.log.Warn("readiness: ledger unreachable", "err", err)
		checks["ledger"], status = "down", http.StatusServiceUnavailable
		if s.journal != nil {
			// Warm orgs are still served: their usage goes to the journal.
			checks["ledger"], status = "down, journaling", http.StatusOK
		}
	}
	if s.journal != nil {
		checks["journal"] = "empty"
		if st := s.recorder.Stats(); st.JournalEvents > 0 {
			checks["journal"] = fmt.Sprintf("in use: %d events, %d of %d bytes", st.JournalEvents, st.JournalBytes, st.JournalMaxBytes)
		}
		if s.recorder.Degraded() {
			checks["journal"] += " (nearly full: new requests refused)"
			status = http.StatusServiceUnavailable
		}
	}
	return c.JSON(status, checks)
}
