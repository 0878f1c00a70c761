package server

import (
	"io"
	"log/slog"
	"net/http"
	"sync"
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

// edge wraps every request with the per-request half of the server's timeouts, the half that
// http.Server cannot express.
//
// Reading: http.Server sets the connection's read deadline to the request's start plus
// ReadTimeout, which bounds the body as it should. But once the body is read, net/http reads
// on in the background to notice a hang-up, under that same deadline, and takes its expiry for
// one: the request's context is cancelled, and the middleware would treat every stream that
// outlives ReadTimeout as a client that left. So edge lifts the read deadline as soon as the
// body has been read (at once for a request without a body).
//
// Writing: a stream may run for many minutes, so one deadline for the whole response would
// either cut long streams or be too long to protect anything. Instead each write (and flush)
// gets WriteTimeout to complete: the deadline is renewed before each one, including the first,
// which may come long after the request while the model thinks. A client that stops reading is
// cut off within WriteTimeout (the middleware then reads the upstream on, bounded, for the real
// usage); one that reads slowly but steadily is not.
func (s *Server) edge(next http.Handler) http.Handler {
	wt := s.cfg.WriteTimeout
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		ew := &edgeWriter{ResponseWriter: w, rc: rc, timeout: wt}
		ew.renew() // the 100 Continue that reading an Expect request's body sends
		if r.Body == nil || r.Body == http.NoBody {
			_ = rc.SetReadDeadline(time.Time{})
		} else {
			// A shallow copy: net/http looks at its own Request's Body after the handler (to
			// discard or refuse what was not read) and must still find its own type there.
			r = r.WithContext(r.Context())
			r.Body = &bodyDone{ReadCloser: r.Body, done: func() { _ = rc.SetReadDeadline(time.Time{}) }}
		}
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

// bodyDone calls done once, when the body has been read to its end.
type bodyDone struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *bodyDone) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.once.Do(b.done)
	}
	return n, err
}

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
