package fakeupstream

import (
	"compress/gzip"
	"compress/zlib"
	"io"
	"net/http"

	"github.com/andybalholm/brotli"
)

// encodedWriter compresses a reply whatever the request's Accept-Encoding said, as an upstream
// that ignores it would (the [encoding:NAME] marker): gzip, deflate (zlib) and br are really
// encoded; any other NAME is only announced in Content-Encoding, over the plain bytes, like a
// coding a reader cannot decode.
type encodedWriter struct {
	http.ResponseWriter
	name  string
	enc   io.WriteCloser // nil: announced only
	wrote bool
}

// encode wraps w for the plan's encoding; done must be called when the reply is written.
func (p plan) encode(w http.ResponseWriter) (http.ResponseWriter, func()) {
	if p.encoding == "" {
		return w, func() {}
	}
	e := &encodedWriter{ResponseWriter: w, name: p.encoding}
	switch p.encoding {
	case "gzip":
		e.enc = gzip.NewWriter(w)
	case "deflate":
		e.enc = zlib.NewWriter(w)
	case "br":
		e.enc = brotli.NewWriter(w)
	}
	return e, func() {
		if e.enc != nil && e.wrote {
			_ = e.enc.Close()
		}
	}
}

func (e *encodedWriter) WriteHeader(code int) {
	if !e.wrote {
		e.wrote = true
		h := e.Header()
		h.Set("Content-Encoding", e.name)
		h.Del("Content-Length")
	}
	e.ResponseWriter.WriteHeader(code)
}

func (e *encodedWriter) Write(b []byte) (int, error) {
	if !e.wrote {
		e.WriteHeader(http.StatusOK)
	}
	if e.enc == nil {
		return e.ResponseWriter.Write(b)
	}
	return e.enc.Write(b)
}

// FlushError flushes the compressor and the connection (streams stay event by event).
func (e *encodedWriter) FlushError() error {
	if f, ok := e.enc.(interface{ Flush() error }); ok {
		if err := f.Flush(); err != nil {
			return err
		}
	}
	return http.NewResponseController(e.ResponseWriter).Flush()
}

func (e *encodedWriter) Unwrap() http.ResponseWriter { return e.ResponseWriter }
