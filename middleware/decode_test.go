package middleware

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/andybalholm/brotli"
)

func compress(t *testing.T, coding string, plain []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	var w io.WriteCloser
	switch coding {
	case "gzip":
		w = gzip.NewWriter(&b)
	case "zlib":
		w = zlib.NewWriter(&b)
	case "raw-deflate":
		w, _ = flate.NewWriter(&b, flate.DefaultCompression)
	case "br":
		w = brotli.NewWriter(&b)
	}
	_, _ = w.Write(plain)
	must(t, w.Close())
	return b.Bytes()
}

// TestBodyDecoder: every coding decodes in writes of any size (deflate as zlib or raw), lists
// decode in reverse order of application, and a body that is not what its coding says is an
// error, never a panic or a hang.
func TestBodyDecoder(t *testing.T) {
	t.Parallel()
	plain := []byte(strings.Repeat(`{"usage":{"prompt_tokens":1}} `, 5000))
	for _, tc := range []struct {
		codings []string
		body    []byte
	}{
		{[]string{"gzip"}, compress(t, "gzip", plain)},
		{[]string{"x-gzip"}, compress(t, "gzip", plain)},
		{[]string{"deflate"}, compress(t, "zlib", plain)},
		{[]string{"deflate"}, compress(t, "raw-deflate", plain)},
		{[]string{"br"}, compress(t, "br", plain)},
		{[]string{"br", "gzip"}, compress(t, "gzip", compress(t, "br", plain))},
	} {
		for _, step := range []int{1, 100, 1 << 20} {
			var out bytes.Buffer
			d := newBodyDecoder(tc.codings, func(b []byte) { out.Write(b) })
			for b := tc.body; len(b) > 0; b = b[min(step, len(b)):] {
				d.Write(b[:min(step, len(b))])
			}
			if err := d.Close(); err != nil || !bytes.Equal(out.Bytes(), plain) {
				t.Fatalf("%v step %d: %v, %d of %d bytes", tc.codings, step, err, out.Len(), len(plain))
			}
		}
	}
	for _, c := range []string{"gzip", "deflate", "br"} {
		d := newBodyDecoder([]string{c}, func([]byte) {})
		d.Write(plain) // not compressed at all
		d.Write(plain)
		if err := d.Close(); !errors.Is(err, errCoding) {
			t.Fatalf("%s: plain bytes decoded without error: %v", c, err)
		}
	}
	// Cut short: an unexpected EOF (the transport's failure, not an unreadable body).
	d := newBodyDecoder([]string{"gzip"}, func([]byte) {})
	gz := compress(t, "gzip", plain)
	d.Write(gz[:len(gz)/2])
	if err := d.Close(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("cut gzip: %v", err)
	}
}

// TestBodyDecoderStreams: what a flushed compressed write carries is decoded and emitted before
// Write returns, so a compressed event stream still reaches the client event by event.
func TestBodyDecoderStreams(t *testing.T) {
	t.Parallel()
	for _, c := range []string{"gzip", "br"} {
		var comp bytes.Buffer
		var w interface {
			io.WriteCloser
			Flush() error
		}
		if c == "gzip" {
			w = gzip.NewWriter(&comp)
		} else {
			w = brotli.NewWriter(&comp)
		}
		var out bytes.Buffer
		d := newBodyDecoder([]string{c}, func(b []byte) { out.Write(b) })
		for i := range 5 {
			ev := "data: {\"n\":" + itoa(int64(i)) + "}\n\n"
			_, _ = w.Write([]byte(ev))
			must(t, w.Flush())
			d.Write(comp.Bytes())
			comp.Reset()
			if !strings.HasSuffix(out.String(), ev) {
				t.Fatalf("%s: event %d not emitted when its bytes were written: %q", c, i, out.String())
			}
		}
		must(t, w.Close())
		d.Write(comp.Bytes())
		must(t, d.Close())
	}
}
