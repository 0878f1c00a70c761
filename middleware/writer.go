package middleware

import (
	"bufio"
	"encoding/json"
	"errors"
	"mime"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/accounting"
)

type writerMode int

const (
	modeNone   writerMode = iota // nothing written yet
	modePass                     // non-2xx: bytes pass straight through
	modeJSON                     // 2xx body buffered (up to the limit) until the usage is recorded
	modeOpaque                   // 2xx body passed on unparsed; only its last byte waits for the record
	modeSSE                      // 2xx event stream: parsed as it passes, its end held back
)

// captureWriter sits between the handler and the client. It parses usage from what the handler
// writes, holds back the final bytes until the usage is recorded (commit), keeps Flush working,
// and, once the client has hung up, swallows the handler's writes (bounded in time and bytes)
// so that the handler keeps reading the upstream and the real usage still arrives.
//
// Write, WriteHeader and Flush are called from the handler's goroutine only; markGone may be
// called from any goroutine.
type captureWriter struct {
	w       http.ResponseWriter
	headers func(http.Header) // sets the middleware's response headers

	maxJSON     int
	hangupBytes int64
	hangupAfter time.Duration
	onBound     func() // cancels the upstream call

	status      int
	wroteHeader bool
	headerSent  bool
	mode        writerMode
	buf         []byte
	pending     []byte
	overflowed  bool
	sse         *sseFilter
	written     int64 // body bytes the handler wrote
	swallowed   int64

	gone     atomic.Bool
	boundHit atomic.Bool
	mu       sync.Mutex
	timer    *time.Timer
	stopped  bool
}

var _ http.Flusher = (*captureWriter)(nil)

func (cw *captureWriter) Header() http.Header { return cw.w.Header() }

// Unwrap gives http.ResponseController access to the client's writer (deadlines, full duplex).
func (cw *captureWriter) Unwrap() http.ResponseWriter { return cw.w }

// Hijack is refused: a hijacked connection would bypass usage capture.
func (cw *captureWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errors.New("middleware: hijacking a metered response is not supported")
}

func (cw *captureWriter) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		cw.w.WriteHeader(code) // informational: passes, the final header comes later
		return
	}
	if cw.wroteHeader {
		return
	}
	cw.wroteHeader = true
	cw.status = code
	h := cw.w.Header()
	cw.headers(h)
	switch {
	case code < 200 || code > 299:
		cw.mode = modePass
		cw.sendHeader()
	case !identityEncoding(h.Get("Content-Encoding")):
		cw.mode = modeOpaque // compressed despite Accept-Encoding: identity; cannot be read
		cw.sendHeader()
	case isEventStream(h.Get("Content-Type")):
		cw.mode = modeSSE
		h.Del("Content-Length") // events may be edited
		cw.sendHeader()
	default:
		cw.mode = modeJSON // header waits with the body
	}
}

func (cw *captureWriter) sendHeader() {
	if !cw.headerSent {
		cw.headerSent = true
		cw.w.WriteHeader(cw.status)
	}
}

func (cw *captureWriter) Write(p []byte) (int, error) {
	if !cw.wroteHeader {
		cw.WriteHeader(http.StatusOK)
	}
	cw.written += int64(len(p))
	switch cw.mode {
	case modePass:
		cw.out(p)
	case modeSSE:
		cw.sse.Write(p)
	case modeJSON:
		if len(cw.buf)+len(p) <= cw.maxJSON {
			cw.buf = append(cw.buf, p...)
			break
		}
		cw.mode, cw.overflowed = modeOpaque, true
		cw.sendHeader()
		b := cw.buf
		cw.buf = nil
		cw.opaque(b)
		cw.opaque(p)
	case modeOpaque:
		cw.opaque(p)
	}
	return len(p), nil
}

// opaque passes p on except its last byte, which waits (for commit, or the next write).
func (cw *captureWriter) opaque(p []byte) {
	if len(p) == 0 {
		return
	}
	if len(cw.pending) > 0 {
		cw.out(cw.pending)
		cw.pending = cw.pending[:0]
	}
	cw.out(p[:len(p)-1])
	cw.pending = append(cw.pending, p[len(p)-1])
}

// out writes to the client, or swallows once it is gone.
func (cw *captureWriter) out(p []byte) {
	if len(p) == 0 {
		return
	}
	if !cw.gone.Load() {
		if _, err := cw.w.Write(p); err == nil {
			return
		}
		cw.markGone()
	}
	cw.swallowed += int64(len(p))
	if cw.swallowed > cw.hangupBytes && cw.boundHit.CompareAndSwap(false, true) {
		cw.onBound()
	}
}

// markGone records that the client went away and starts the hang-up clock.
func (cw *captureWriter) markGone() {
	if !cw.gone.CompareAndSwap(false, true) {
		return
	}
	cw.mu.Lock()
	defer cw.mu.Unlock()
	if cw.stopped {
		return
	}
	cw.timer = time.AfterFunc(cw.hangupAfter, func() {
		if cw.boundHit.CompareAndSwap(false, true) {
			cw.onBound()
		}
	})
}

// stop ends the hang-up clock (the handler has returned).
func (cw *captureWriter) stop() {
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.stopped = true
	if cw.timer != nil {
		cw.timer.Stop()
	}
}

func (cw *captureWriter) Flush() { _ = cw.FlushError() }

// FlushError flushes what has passed to the client (nothing while a JSON body is buffered).
func (cw *captureWriter) FlushError() error {
	if !cw.headerSent || cw.gone.Load() {
		return nil
	}
	if err := http.NewResponseController(cw.w).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		cw.markGone()
	}
	return nil
}

// usage is the usage the response carried, if any.
func (cw *captureWriter) usage() (accounting.Usage, bool) {
	switch cw.mode {
	case modeJSON:
		return usageFromBody(cw.buf)
	case modeSSE:
		cw.sse.finish()
		return cw.sse.usage, cw.sse.haveUsage
	}
	return accounting.Usage{}, false
}

// outputEstimate estimates the generated tokens from the text that passed: at least one per
// chunk that carried text, at least one per 4 bytes of text.
func (cw *captureWriter) outputEstimate() int64 {
	var chunks, bytes int64
	switch cw.mode {
	case modeSSE:
		chunks, bytes = cw.sse.outChunks, cw.sse.outBytes
	case modeJSON:
		bytes = outputBytesOfBody(cw.buf)
	}
	return max(chunks, (bytes+3)/4)
}

// commit sends the held-back end of the response: the usage is recorded.
func (cw *captureWriter) commit() {
	switch cw.mode {
	case modeJSON:
		h := cw.w.Header()
		if h.Get("Content-Length") == "" {
			h.Set("Content-Length", strconv.Itoa(len(cw.buf)))
		}
		cw.sendHeader()
		cw.out(cw.buf)
	case modeOpaque:
		cw.out(cw.pending)
	case modeSSE:
		cw.out(cw.sse.release())
	}
	cw.Flush()
}

// fail ends the response with e instead of its held-back end: the usage could not be recorded,
// so the client must not see a success. It reports whether the connection must be aborted (an
// unparsed body whose header is gone: only a broken connection tells the client).
func (cw *captureWriter) fail(e *Error) (abort bool) {
	switch cw.mode {
	case modeJSON:
		if !cw.gone.Load() {
			writeErrorTo(cw.w, e)
		}
		return false
	case modeSSE:
		cw.sse.release()
		var ev []byte
		if cw.sse.responses {
			ev = []byte(`event: error` + "\n" + `data: {"type":"error","code":` + jsonString(e.Code) + `,"message":` + jsonString(e.Message) + `,"param":null}` + "\n\n")
		} else {
			ev = append(append([]byte("data: "), e.Body()...), "\n\n"...)
		}
		cw.out(ev)
		cw.Flush()
		return false
	case modeOpaque:
		return true
	}
	return false
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func isEventStream(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

func identityEncoding(ce string) bool {
	ce = strings.TrimSpace(ce)
	return ce == "" || strings.EqualFold(ce, "identity")
}
