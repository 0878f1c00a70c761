package server

import (
	"log/slog"
	"net/http"
	"time"
)

// newHTTPServer is the client-facing server with its timeouts:
//
//   - ReadHeaderTimeout bounds the request line and headers;
//   - ReadTimeout bounds the whole request, body included (a client that announces a body and
//     sends it slowly, or never, is cut off: it holds no hold, so the in-flight cap would not
//     count it);
//   - WriteTimeout bounds each write to the client, renewed at every write (see edge), so a
//     stream lasts as long as the upstream talks and the client reads;
//   - IdleTimeout bounds a keep-alive connection between requests.
func (s *Server) newHTTPServer() *http.Server {
	return &http.Server{
		Handler:           s.edge(s.echo),
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		ReadTimeout:       s.cfg.ReadTimeout,
		// Also set here so that net/http's own writes (a 100 Continue, an error for a
		// malformed request) are bounded; edge renews it for the handler's writes.
		WriteTimeout: s.cfg.WriteTimeout,
		IdleTimeout:  s.cfg.IdleTimeout,
		ErrorLog:     slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
}

// edge renews the connection's write deadline before each write and flush of the response.
//
// A stream may run for many minutes, so one deadline for the whole response (http.Server's
// WriteTimeout alone, which starts when the request's headers are read) would either cut long
// streams or be too long to protect anything. Instead each write gets WriteTimeout to complete,
// including the first, which may come long after the request while the model thinks. A client
// that stops reading is cut off within WriteTimeout (the middleware then reads the upstream on,
// bounded, for the real usage); one that reads slowly but steadily is not.
//
// Reading needs no such help: ReadTimeout bounds the request, body included, and net/http
// lifts the read deadline once the body is read (its background read that notices a hang-up
// runs without one), so a long response is not taken for a client that left.
func (s *Server) edge(next http.Handler) http.Handler {
	wt := s.cfg.WriteTimeout
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ew := &edgeWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: wt}
		// Until the first write, the deadline http.Server set when the headers were read
		// (WriteTimeout) bounds net/http's own writes, such as a 100 Continue.
		defer ew.renew() // the server's last flush of what the handler left buffered
		next.ServeHTTP(ew, r)
	})
}

// edgeWriter renews the connection's write deadline before every write and flush.
type edgeWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
}

func (w *edgeWriter) renew() { _ = w.rc.SetWriteDeadline(time.Now().Add(w.timeout)) }

func (w *edgeWriter) WriteHeader(code int) {
	w.renew()
	w.ResponseWriter.WriteHeader(code)
}

func (w *edgeWriter) Write(p []byte) (int, error) {
	w.renew()
	return w.ResponseWriter.Write(p)
}

func (w *edgeWriter) Flush() { _ = w.FlushError() }

// FlushError is what http.ResponseController (used by the middleware and Echo) calls.
func (w *edgeWriter) FlushError() error {
	w.renew()
	return w.rc.Flush()
}

// Unwrap gives http.ResponseController the connection's writer (deadlines, hijacking).
func (w *edgeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// finalOnly is the writer the reverse proxy gets: it drops the upstream's interim (1xx)
// responses. httputil.ReverseProxy relays them with WriteHeader(1xx), and Echo's Response takes
// any WriteHeader as the final one: a 100 or 103 from the upstream would commit a 200 to the
// client before the upstream's real status (a 500, a 413) is known, and the middleware would
// then bill an error as a success. Interim responses are the proxy's own business with its
// client (net/http answers Expect: 100-continue itself when the body is read).
type finalOnly struct{ http.ResponseWriter }

func (w finalOnly) WriteHeader(code int) {
	if code >= 100 && code <= 199 {
		return
	}
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController flush through to the client.
func (w finalOnly) Unwrap() http.ResponseWriter { return w.ResponseWriter }
