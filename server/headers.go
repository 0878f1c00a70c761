package server

import (
	"fmt"
	"net/http"
	"net/textproto"
	"strings"
)

// The proxy speaks HTTP for the client, not through it: only the headers named here cross it.
//
// Request headers reach the upstream from an allow-list because the upstream is paid for with
// the operator's key: OpenAI-Organization and OpenAI-Project would let a client choose which of
// the operator's projects pays, Api-Key / X-Api-Key / Cookie are other ways to authenticate,
// Expect would have the upstream, not the proxy, answer 100-continue (its interim response
// would commit the client's reply before the real status is known), and X-Escrow-* are this
// proxy's own. Response headers come back from an allow-list for the mirror reasons: the
// upstream's Server, Set-Cookie and organization headers describe the operator's account, not
// the client's, and an upstream must not be able to set escrow's own headers.

// Headers that always cross, whatever the configuration: what the body means and how it is
// framed. The middleware relies on them (it parsed the request as JSON and set
// Accept-Encoding; it reads a response by its Content-Type and Content-Encoding), so they are
// not the operator's to drop.
var (
	alwaysRequestHeaders  = []string{"Content-Type", "Accept-Encoding"}
	alwaysResponseHeaders = []string{"Content-Type", "Content-Length", "Content-Encoding"}
)

// hopByHop are the connection's own headers (RFC 9110 7.6.1 and their old forms): never
// forwarded in either direction. httputil.ReverseProxy removes most of them too.
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
	"Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// Headers that never cross, even when an allow-list pattern would match them; naming one in
// the configuration is an error. A trailing * is a prefix.
var (
	neverRequestHeaders = append([]string{"Authorization", "Cookie", "Api-Key", "X-Api-Key",
		"Openai-Organization", "Openai-Project", "X-Escrow-*", "Expect", "Host", "Content-Length",
		"Forwarded", "X-Forwarded-*", "X-Real-Ip"}, hopByHop...)
	neverResponseHeaders = append([]string{"Set-Cookie", "Set-Cookie2", "Server", "Openai-Organization",
		"Openai-Project", "X-Escrow-*", "X-Upstream-Request-Id", "Alt-Svc"}, hopByHop...)
)

// Defaults of ESCROW_UPSTREAM_REQUEST_HEADERS and ESCROW_UPSTREAM_RESPONSE_HEADERS (Anthropic's
// API version and beta flags go up — the middleware refuses the betas it cannot price — and its
// request id and rate limits come back). Not
// forwarded by default: Idempotency-Key (the upstream would replay a stored reply that escrow
// bills again, so one upstream call would be paid twice), the SDKs' X-Stainless-* telemetry
// (the client's OS and runtime are none of the upstream account's business), Accept-Language.
const (
	defaultRequestHeaders  = "Accept,User-Agent,OpenAI-Beta,Anthropic-Version,Anthropic-Beta"
	defaultResponseHeaders = "X-Request-Id,OpenAI-Processing-Ms,OpenAI-Version,X-Ratelimit-*,Retry-After,Retry-After-Ms,X-Should-Retry,Cache-Control,Request-Id,Anthropic-Ratelimit-*"
)

// headerSet matches header names: exact names (canonical form) and prefixes (a pattern
// ending in *), case-insensitively.
type headerSet struct {
	exact    map[string]bool
	prefixes []string
}

func newHeaderSet(patterns []string) headerSet {
	s := headerSet{exact: make(map[string]bool, len(patterns))}
	for _, p := range patterns {
		if pre, ok := strings.CutSuffix(p, "*"); ok {
			s.prefixes = append(s.prefixes, pre)
			continue
		}
		s.exact[textproto.CanonicalMIMEHeaderKey(p)] = true
	}
	return s
}

func (s headerSet) has(name string) bool {
	if s.exact[name] || s.exact[textproto.CanonicalMIMEHeaderKey(name)] {
		return true
	}
	for _, p := range s.prefixes {
		if len(name) >= len(p) && strings.EqualFold(name[:len(p)], p) {
			return true
		}
	}
	return false
}

// headerPolicy is one direction's rule: a header crosses when it is allowed and not denied.
type headerPolicy struct {
	allow, deny headerSet
}

func newHeaderPolicy(always, configured, never []string) headerPolicy {
	return headerPolicy{allow: newHeaderSet(append(append([]string(nil), always...), configured...)), deny: newHeaderSet(never)}
}

func (p headerPolicy) allows(name string) bool { return p.allow.has(name) && !p.deny.has(name) }

// filter deletes from h every header the policy does not let through.
func (p headerPolicy) filter(h http.Header) {
	for k := range h {
		if !p.allows(k) {
			delete(h, k)
		}
	}
}

// parseHeaderList parses a comma-separated list of header names (a trailing * makes a prefix;
// "none" is the empty list) and refuses names that must never cross.
func parseHeaderList(v string, never []string) ([]string, error) {
	v = strings.TrimSpace(v)
	if strings.EqualFold(v, "none") {
		return nil, nil
	}
	deny := newHeaderSet(never)
	var out []string
	for _, p := range strings.Split(v, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		// "*" alone allows every header but the never-list.
		name := strings.TrimSuffix(p, "*")
		if !validHeaderName(name) {
			return nil, fmt.Errorf("%q is not a header name (letters, digits and -, optionally ending in *)", p)
		}
		// A pattern inside a denied prefix ("X-Escrow-Foo*") is refused; a broader one ("X-*")
		// is allowed, and the never-list still wins when a header is matched.
		if deny.has(name) {
			return nil, fmt.Errorf("%s never crosses the proxy and may not be listed (never: %s)", p, strings.Join(never, ", "))
		}
		out = append(out, p)
	}
	return out, nil
}

func validHeaderName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}
