package middleware

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/pricing"
)

type writerMode int

const (
	modeNone   writerMode = iota // nothing written yet
	modePass                     // non-2xx: bytes pass straight through
	modeJSON                     // 2xx body: scanned for usage as it passes; kept whole up to maxJSON, then streamed with its end held back
	modeSSE                      // 2xx event stream: parsed as it passes, its end held back
	modeOpaque                   // 2xx body in a coding escrow cannot decode: passed on raw, its end held back; usage unreadable
)

// maxHeldTail bounds the held-back end of a streamed body (its last byte that is not
// whitespace, and the whitespace after it): a body that ends in more whitespace than this has
// it let through.
const maxHeldTail = 64 << 10

// captureWriter sits between the handler and the client. It reads the usage from what the
// handler writes as it passes (a streaming scanner for JSON bodies, the SSE filter for event
// streams, after decoding a compressed body), holds back the final bytes until the usage is
// recorded (commit), keeps Flush working, and, once the client has hung up, swallows the
// handler's writes (bounded in time and bytes) so that the handler keeps reading the upstream
// and the real usage still arrives. Its memory is bounded whatever the body's size: a JSON body
// is kept whole only up to maxJSON (so that a failed record can still answer a clean error),
// one SSE event up to the SSE filter's limit, and the rest streams.
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
	costSSE     bool   // the client asked for the cost in an event stream (HeaderIncludeCost)

	status      int
	wroteHeader bool
	headerSent  bool
	mode        writerMode
	buf         []byte // modeJSON: the body while it fits in maxJSON
	streaming   bool   // modeJSON: the body outgrew maxJSON and passes as it comes
	pending     []byte // streamed modes: the held-back end
	scan        usageScanner
	sse         *sseFilter
	dec         *bodyDecoder // a compressed body being decoded
	decErr      error
	coding      string // the Content-Encoding the upstream sent
	written     int64  // body bytes the handler wrote
	served      bool   // a 2xx body byte reached the client: its content was served
	swallowed   int64

	gone     atomic.Bool
	boundHit atomic.Bool
	mu       sync.Mutex
	timer    *time.Timer
	stopped  bool

	// headerAfterBound: the final header was written after the read-on bound ended (the
	// handler's answer to the cut, not the upstream's).
	headerAfterBound bool
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
	cw.headerAfterBound = cw.boundHit.Load()
	h := cw.w.Header()
	cw.headers(h)
	if code < 200 || code > 299 {
		cw.mode = modePass
		cw.sendHeader()
		return
	}
	cw.coding = h.Get("Content-Encoding")
	codings, known := responseCodings(cw.coding)
	if !known {
		cw.mode = modeOpaque // a coding escrow cannot read: the body passes as it is, charged the hold
		cw.announceTrailers()
		cw.sendHeader()
		return
	}
	if len(codings) > 0 {
		// The upstream compressed although it was asked for identity. The body is decoded for
		// reading, and the client gets the decoded bytes with Content-Encoding (and the length)
		// dropped, because only plain bytes can be edited and held back event by event: the SSE
		// filter removes the usage chunk the client did not ask for and "usage":null fields,
		// and holds back [DONE] or response.completed until the usage is recorded. Passing the
		// compressed bytes on while decoding a copy would leave the client's view unedited and
		// its end held only byte-wise inside a compressed block. Identity is acceptable to every
		// client, so dropping the coding never breaks one.
		h.Del("Content-Encoding")
		h.Del("Content-Length")
		cw.dec = newBodyDecoder(codings, cw.plain)
	}
	if isEventStream(h.Get("Content-Type")) {
		cw.mode = modeSSE
		h.Del("Content-Length") // events may be edited
		cw.sendHeader()
		return
	}
	cw.mode = modeJSON // header waits with the body
}

// announceTrailers declares the cost headers as trailers of a 2xx body whose header goes out
// before its cost is known, and drops its Content-Length: an HTTP/1.1 body with a length
// cannot carry trailers, so it goes chunked.
func (cw *captureWriter) announceTrailers() {
	h := cw.w.Header()
	h.Del("Content-Length")
	h.Add("Trailer", HeaderCost+", "+HeaderBalance)
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
	switch {
	case cw.mode == modePass:
		cw.out(p)
	case cw.mode == modeOpaque:
		cw.hold(p)
	case cw.dec != nil:
		cw.dec.Write(p)
	default:
		cw.plain(p)
	}
	return len(p), nil
}

// plain takes the body's (decoded) bytes.
func (cw *captureWriter) plain(p []byte) {
	switch cw.mode {
	case modeSSE:
		cw.sse.Write(p)
	case modeJSON:
		cw.scan.Write(p)
		if !cw.streaming {
			if len(cw.buf)+len(p) <= cw.maxJSON {
				cw.buf = append(cw.buf, p...)
				return
			}
			// Too large to keep: from here on the body passes as it comes, its end held.
			cw.streaming = true
			cw.announceTrailers()
			cw.sendHeader()
			b := cw.buf
			cw.buf = nil
			cw.hold(b)
		}
		cw.hold(p)
	}
}

// hold passes p on but keeps back the end of what passed so far: its last byte that is not
// whitespace and whatever follows it. Until commit the client cannot complete the document (a
// JSON decoder that stops at the closing brace lacks the brace).
func (cw *captureWriter) hold(p []byte) {
	k := len(p) - 1
	for k >= 0 && isSpace(p[k]) {
		k--
	}
	if k >= 0 {
		cw.out(cw.pending)
		cw.out(p[:k])
		cw.pending = append(cw.pending[:0], p[k:]...)
	} else {
		cw.pending = append(cw.pending, p...)
	}
	if len(cw.pending) > maxHeldTail {
		cw.out(cw.pending)
		cw.pending = cw.pending[:0]
	}
}

// out writes to the client, or swallows once it is gone.
func (cw *captureWriter) out(p []byte) {
	if len(p) == 0 {
		return
	}
	if !cw.gone.Load() {
		if _, err := cw.w.Write(p); err == nil {
			cw.served = cw.served || cw.mode != modePass
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

// end finishes reading the body: the decoder drains, an unfinished last event or number is
// taken as it stands. Called once, after the handler returned.
func (cw *captureWriter) end() {
	if cw.dec != nil {
		cw.decErr = cw.dec.Close()
	}
	switch cw.mode {
	case modeJSON:
		cw.scan.finish()
	case modeSSE:
		cw.sse.finish()
	}
}

// usage is the usage the response carried, if any.
func (cw *captureWriter) usage() (pricing.Usage, bool) {
	switch cw.mode {
	case modeJSON:
		return cw.scan.usage()
	case modeSSE:
		return cw.sse.usage, cw.sse.haveUsage
	}
	return pricing.Usage{}, false
}

// readable reports whether the body could be read at all: false for a coding escrow cannot
// decode, a compressed body that did not decode, or a JSON body with a syntax error. (A body
// cut short by the transport is readable: what arrived was read.)
func (cw *captureWriter) readable() error {
	switch {
	case cw.mode == modeOpaque:
		return fmt.Errorf("%w: content coding %q", errUnreadable, cw.coding)
	case cw.decErr != nil && !errors.Is(cw.decErr, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w: %w", errUnreadable, cw.decErr)
	case cw.mode == modeJSON && cw.scan.failed:
		return fmt.Errorf("%w: the body is not JSON", errUnreadable)
	}
	return nil
}

// outputEstimate estimates the generated tokens from the text that passed, generously: at
// least one per chunk that carried text, one per 4 bytes of text (every string of a JSON body,
// every data byte of an SSE event too long to parse whole).
func (cw *captureWriter) outputEstimate() int64 {
	var chunks, bytes int64
	switch cw.mode {
	case modeSSE:
		chunks, bytes = cw.sse.outChunks, cw.sse.outBytes
	case modeJSON:
		bytes = cw.scan.text
	}
	return max(chunks, (bytes+3)/4)
}

// commit sends the held-back end of the response, with what it cost: the usage is recorded.
func (cw *captureWriter) commit(rc costReceipt) {
	h := cw.w.Header()
	switch cw.mode {
	case modeJSON:
		if cw.streaming {
			cw.out(cw.pending)
			rc.set(h) // declared trailers
			break
		}
		if h.Get("Content-Length") == "" {
			h.Set("Content-Length", strconv.Itoa(len(cw.buf)))
		}
		rc.set(h)
		cw.sendHeader()
		cw.out(cw.buf)
	case modeOpaque:
		cw.out(cw.pending)
		rc.set(h) // declared trailers
	case modeSSE:
		before, after := cw.sse.costPlace()
		end := cw.sse.release()
		if cw.costSSE && before {
			cw.out(rc.comment())
		}
		cw.out(end)
		if cw.costSSE && !before && after {
			cw.out(rc.comment())
		}
	}
	cw.Flush()
}

// fail ends the response with e instead of its held-back end: the usage could not be recorded,
// so the client must not see a success. It reports whether the connection must be aborted (a
// body whose header and first bytes are gone, or an event stream in the middle of an event:
// only a broken connection tells the client).
func (cw *captureWriter) fail(e *Error) (abort bool) {
	switch cw.mode {
	case modeJSON:
		if cw.streaming {
			return true
		}
		if !cw.gone.Load() {
			writeErrorTo(cw.w, e)
		}
		return false
	case modeSSE:
		cw.sse.release()
		if cw.sse.open {
			return true
		}
		var ev []byte
		if cw.sse.anthropic {
			ev = append(append([]byte("event: error\ndata: "), e.forAnthropic().Body()...), "\n\n"...)
		} else if cw.sse.responses {
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
