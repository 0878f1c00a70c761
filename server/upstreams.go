package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/llmescrow/escrow/endpoint"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/middleware"
)

// Style is the API an upstream speaks.
type Style string

// The API styles: OpenAI's (the key goes as Authorization: Bearer) and Anthropic's (x-api-key).
const (
	StyleOpenAI    Style = "openai"
	StyleAnthropic Style = "anthropic"
)

// Route sends the requests for one model, or for every model whose name starts with a prefix,
// to one upstream. A routes file (ESCROW_ROUTES_FILE) is {"routes": [Route, …]}; unknown fields
// are refused, so a misspelt field is an error rather than a catch-all.
//
// The request is always priced as the model the client named, which is the name the route maps
// from: Rename changes only what the upstream is asked for, so a client can never name a cheap
// priced model and be served a dear one — the operator chooses every such mapping.
type Route struct {
	// Model is the exact model name this route serves; or Prefix: every model whose name starts
	// with it ("" serves every model: a catch-all). Exactly one of the two. An exact name beats
	// the longest matching prefix.
	Model  string  `json:"model,omitempty"`
	Prefix *string `json:"prefix,omitempty"`
	// Upstream is the upstream's base URL (scheme://host[:port][/path]).
	Upstream string `json:"upstream"`
	// APIKey is the upstream's key, or APIKeyEnv names the environment variable that holds it
	// (keep keys out of the file). One of the two is required. Keys never reach a log line.
	APIKey    string `json:"api_key,omitempty"`
	APIKeyEnv string `json:"api_key_env,omitempty"`
	// Style is openai (default) or anthropic: which endpoints the route serves, and how the key
	// is sent.
	Style Style `json:"style,omitempty"`
	// Rename, on an exact-model route, is the model name the upstream gets in the body.
	Rename string `json:"rename,omitempty"`
	// OwnedBy is the owned_by of the route's models in GET /v1/models. Default "escrow".
	OwnedBy string `json:"owned_by,omitempty"`
}

// upstream is a Route ready to serve.
type upstream struct {
	style   Style
	base    *url.URL
	key     string
	rename  string
	ownedBy string
	name    string // for logs: the model or "prefix*"
}

// setKey puts the upstream's key on an outgoing request, in the header of its style.
func (u *upstream) setKey(h http.Header) {
	h.Del("Authorization")
	h.Del("X-Api-Key")
	if u.key == "" {
		return
	}
	if u.style == StyleAnthropic {
		h.Set("X-Api-Key", u.key)
		return
	}
	h.Set("Authorization", "Bearer "+u.key)
}

// upstreamModel is the model name the upstream gets for a request of model.
func (u *upstream) upstreamModel(model string) string {
	if u.rename != "" {
		return u.rename
	}
	return model
}

type prefixRoute struct {
	prefix string
	up     *upstream
}

// routeTable finds each request's upstream: by (style, exact model), else by the longest
// prefix of that style.
type routeTable struct {
	exact    map[Style]map[string]*upstream
	prefixes map[Style][]prefixRoute // longest first
	keys     []string                // every upstream key, for the log redaction
}

// lookup returns the upstream of model for the endpoints of style, nil when none.
func (t *routeTable) lookup(style Style, model string) *upstream {
	if u := t.exact[style][model]; u != nil {
		return u
	}
	for _, p := range t.prefixes[style] {
		if strings.HasPrefix(model, p.prefix) {
			return p.up
		}
	}
	return nil
}

func (t *routeTable) empty() bool { return len(t.keys) == 0 }

// catchAll is the upstream of style's "" prefix, nil when none.
func (t *routeTable) catchAll(style Style) *upstream {
	ps := t.prefixes[style]
	if len(ps) > 0 && ps[len(ps)-1].prefix == "" {
		return ps[len(ps)-1].up
	}
	return nil
}

// newRouteTable checks rs and builds the table. getenv reads the api_key_env variables.
func newRouteTable(rs []Route, getenv func(string) string) (*routeTable, error) {
	t := &routeTable{exact: map[Style]map[string]*upstream{}, prefixes: map[Style][]prefixRoute{}}
	seenPrefix := map[Style]map[string]bool{}
	for i, r := range rs {
		what := fmt.Sprintf("route %d", i+1)
		switch {
		case r.Model != "" && r.Prefix != nil:
			return nil, fmt.Errorf("%s: give model or prefix, not both", what)
		case r.Model != "":
			what += fmt.Sprintf(" (model %q)", r.Model)
		case r.Prefix != nil:
			what += fmt.Sprintf(" (prefix %q)", *r.Prefix)
		default:
			return nil, fmt.Errorf("%s: give model (an exact name) or prefix (\"\" for every model)", what)
		}
		style := r.Style
		if style == "" {
			style = StyleOpenAI
		}
		if style != StyleOpenAI && style != StyleAnthropic {
			return nil, fmt.Errorf("%s: style must be openai or anthropic, not %q", what, r.Style)
		}
		base, err := url.Parse(r.Upstream)
		if err != nil || base.Host == "" || (base.Scheme != "http" && base.Scheme != "https") {
			// Not quoted: a URL that does not parse may not be masked by redact either.
			return nil, fmt.Errorf("%s: upstream is not an absolute http(s) URL (e.g. https://api.openai.com)", what)
		}
		key := r.APIKey
		switch {
		case r.APIKey != "" && r.APIKeyEnv != "":
			return nil, fmt.Errorf("%s: give api_key or api_key_env, not both", what)
		case r.APIKeyEnv != "":
			if key = getenv(r.APIKeyEnv); key == "" {
				return nil, fmt.Errorf("%s: api_key_env names %s, which is empty", what, r.APIKeyEnv)
			}
		case key == "":
			return nil, fmt.Errorf("%s: api_key or api_key_env is required", what)
		}
		if r.Rename != "" && r.Model == "" {
			// A prefix route serves names the operator never listed: renaming them all to one
			// model would let a client's choice of name decide the price of that model.
			return nil, fmt.Errorf("%s: rename is only allowed on an exact-model route", what)
		}
		u := &upstream{style: style, base: base, key: key, rename: r.Rename, ownedBy: r.OwnedBy, name: r.Model}
		if u.ownedBy == "" {
			u.ownedBy = "escrow"
		}
		t.keys = append(t.keys, key)
		if r.Model != "" {
			if t.exact[style] == nil {
				t.exact[style] = map[string]*upstream{}
			}
			if t.exact[style][r.Model] != nil {
				return nil, fmt.Errorf("%s: model listed twice for style %s", what, style)
			}
			t.exact[style][r.Model] = u
			continue
		}
		u.name = *r.Prefix + "*"
		if seenPrefix[style] == nil {
			seenPrefix[style] = map[string]bool{}
		}
		if seenPrefix[style][*r.Prefix] {
			return nil, fmt.Errorf("%s: prefix listed twice for style %s", what, style)
		}
		seenPrefix[style][*r.Prefix] = true
		t.prefixes[style] = append(t.prefixes[style], prefixRoute{*r.Prefix, u})
	}
	for _, ps := range t.prefixes {
		slices.SortStableFunc(ps, func(a, b prefixRoute) int { return len(b.prefix) - len(a.prefix) })
	}
	return t, nil
}

// readRoutesFile reads {"routes": [...]} from path.
func readRoutesFile(path string) ([]Route, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("ESCROW_ROUTES_FILE: %w", err)
	}
	var f struct {
		Routes []Route `json:"routes"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("ESCROW_ROUTES_FILE %s: %w", path, err)
	}
	if len(f.Routes) == 0 {
		return nil, fmt.Errorf("ESCROW_ROUTES_FILE %s: no routes", path)
	}
	return f.Routes, nil
}

// styleOf is the API style of a request path: its endpoint's provider, and Anthropic's for the
// paths below the Messages API (batches, passed through).
func styleOf(path string) Style {
	if isAnthropicPath(path) || strings.HasPrefix(path, endpoint.Messages.Path+"/") {
		return StyleAnthropic
	}
	return StyleOpenAI
}

// routeKey is where the middleware's Route hook leaves the request's upstream on the Echo
// context, and the proxy handler puts it on the request's context for the reverse proxy.
const routeKey = "escrow.upstream"

type upstreamCtxKey struct{}

// route is the middleware's Config.Route: the upstream of the request's model, or a 404
// model_not_found with nothing held.
func (s *Server) route(c echo.Context, model string) (string, error) {
	u := s.routes.lookup(styleOf(c.Request().URL.Path), model)
	if u == nil {
		return "", &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest, Param: "model", Code: middleware.CodeModelNotFound,
			Message: "The model '" + model + "' does not exist or you do not have access to it."}
	}
	c.Set(routeKey, u)
	return u.upstreamModel(model), nil
}

// String lists the routes for the log, without their keys: "style model → upstream, …".
func (t *routeTable) String() string {
	var parts []string
	for _, style := range []Style{StyleOpenAI, StyleAnthropic} {
		names := make([]string, 0, len(t.exact[style]))
		for n := range t.exact[style] {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			u := t.exact[style][n]
			parts = append(parts, fmt.Sprintf("%s %s → %s", style, n, u.base.Redacted()))
		}
		for _, p := range t.prefixes[style] {
			parts = append(parts, fmt.Sprintf("%s %s → %s", style, p.up.name, p.up.base.Redacted()))
		}
	}
	return strings.Join(parts, ", ")
}
