package middleware

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/andybalholm/brotli"
)

// errCoding is the error of a compressed body that could not be decoded.
var errCoding = errors.New("middleware: the response's content coding could not be decoded")

// maxCodings bounds a Content-Encoding list.
const maxCodings = 3

// responseCodings parses a Content-Encoding header. known is false when a coding is one escrow
// cannot decode (the body is then unreadable); codings lists the others in the order they were
// applied, identity left out.
func responseCodings(ce string) (codings []string, known bool) {
	for c := range strings.SplitSeq(ce, ",") {
		c = strings.ToLower(strings.TrimSpace(c))
		switch c {
		case "", "identity":
		case "gzip", "x-gzip", "deflate", "br":
			codings = append(codings, c)
		default:
			return nil, false
		}
	}
	return codings, len(codings) <= maxCodings
}

// bodyDecoder decodes a compressed response body as the handler writes it. The decoders
// (compress/gzip, compress/flate, brotli) are readers that pull their input, while the handler
// pushes its writes, so a goroutine runs the decoder over the written bytes. Write hands it one
// chunk and waits until the decoder asks for more input — by then everything decodable from
// the bytes so far has gone to emit (the decoders return output before they read again) — or
// has stopped. emit thus only runs while Write or Close waits: never beside the handler's own
// calls, and the client still gets each decoded byte as soon as its compressed bytes arrive.
//
// Memory is the decoders' windows: 32 KiB for gzip and deflate, at most 16 MiB for brotli
// (the largest window its format allows), whatever the body's size.
type bodyDecoder struct {
	in      chan []byte
	drained chan struct{}
	done    chan struct{}
	err     error // set before done is closed
	decoded int64
}

func newBodyDecoder(codings []string, emit func([]byte)) *bodyDecoder {
	d := &bodyDecoder{in: make(chan []byte), drained: make(chan struct{}), done: make(chan struct{})}
	go d.run(codings, emit)
	return d
}

// Write passes p to the decoder and returns once it has been decoded as far as it goes. After
// the decoder stopped (end of the compressed data, or an error) further bytes are dropped.
func (d *bodyDecoder) Write(p []byte) {
	if len(p) == 0 {
		return
	}
	select {
	case d.in <- p:
	case <-d.done:
		return
	}
	select {
	case <-d.drained:
	case <-d.done:
	}
}

// Close ends the input and waits for the decoder; the error is nil when the compressed data
// ended properly.
func (d *bodyDecoder) Close() error {
	close(d.in)
	<-d.done
	return d.err
}

func (d *bodyDecoder) run(codings []string, emit func([]byte)) {
	defer close(d.done)
	src := &pushReader{d: d}
	var r io.Reader = src
	for i := len(codings) - 1; i >= 0; i-- {
		var err error
		if r, err = openDecoder(codings[i], r); err != nil {
			d.err = fmt.Errorf("%w (%s): %w", errCoding, codings[i], err)
			return
		}
	}
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			d.decoded += int64(n)
			emit(buf[:n])
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			d.err = fmt.Errorf("%w: %w", errCoding, err)
			return
		}
	}
}

func openDecoder(coding string, r io.Reader) (io.Reader, error) {
	switch coding {
	case "gzip", "x-gzip":
		return gzip.NewReader(r)
	case "br":
		return brotli.NewReader(r), nil
	case "deflate":
		// HTTP's deflate is zlib (RFC 1950), but servers also send raw deflate (RFC 1951), and
		// clients accept both: a zlib header is recognised by its checksum.
		br := bufio.NewReader(r)
		if h, err := br.Peek(2); err == nil && h[0]&0x0f == 8 && (uint16(h[0])<<8|uint16(h[1]))%31 == 0 {
			return zlib.NewReader(br)
		}
		return flate.NewReader(br), nil
	}
	return nil, fmt.Errorf("unknown coding %q", coding)
}

// pushReader is the decoder's source: the chunks Write hands over, one at a time.
type pushReader struct {
	d    *bodyDecoder
	cur  []byte
	took bool // a chunk was taken and Write waits for it to be drained
}

func (r *pushReader) Read(b []byte) (int, error) {
	for len(r.cur) == 0 {
		if r.took {
			r.took = false
			r.d.drained <- struct{}{}
		}
		p, ok := <-r.d.in
		if !ok {
			return 0, io.EOF
		}
		r.cur, r.took = p, true
	}
	n := copy(b, r.cur)
	r.cur = r.cur[n:]
	return n, nil
}
