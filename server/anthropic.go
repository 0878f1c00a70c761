package server

import (
	"fmt"
	"net/http"
	"net/url"

	"github.com/llmescrow/escrow/middleware"
)

// The Messages API's routes go to one Anthropic upstream (ESCROW_ANTHROPIC_URL, its key sent as
// x-api-key), or to the in-process upstream when there is one and no Anthropic URL is set (the
// demo's fake serves both APIs). Routing by model replaces this choice.

func isAnthropicPath(path string) bool {
	return path == middleware.EndpointMessages || path == middleware.EndpointCountTokens
}

// openAnthropic parses ESCROW_ANTHROPIC_URL (nil when unset).
func (s *Server) openAnthropic() (*url.URL, error) {
	if s.cfg.AnthropicURL == "" {
		return nil, nil
	}
	u, err := url.Parse(s.cfg.AnthropicURL)
	if err != nil || u.Host == "" {
		// Not quoted: a value that does not parse may not be masked by redact either.
		return nil, fmt.Errorf("%w: ESCROW_ANTHROPIC_URL is not an absolute URL (want scheme://host, e.g. https://api.anthropic.com)", ErrConfig)
	}
	return u, nil
}

// withAnthropic sends the Messages API's paths to the Anthropic upstream and the rest to next.
func (s *Server) withAnthropic(next http.Handler) http.Handler {
	var anth http.Handler
	switch {
	case s.anthropic != nil:
		key := s.cfg.AnthropicAPIKey
		anth = s.proxyTo(s.anthropic, func(h http.Header) { h.Set("X-Api-Key", key) })
	case s.fake != nil:
		key := s.cfg.UpstreamAPIKey
		anth = s.proxyTo(s.upstream, func(h http.Header) {
			if key != "" {
				h.Set("X-Api-Key", key)
			}
		})
	default:
		anth = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body := (&middleware.Error{Type: middleware.AnthropicNotFound, Anthropic: true,
				Message: "No Anthropic upstream is configured on this proxy (ESCROW_ANTHROPIC_URL)."}).Body()
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = w.Write(body)
		})
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if isAnthropicPath(r.URL.Path) {
			anth.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}
