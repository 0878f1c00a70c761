package middleware

import (
	"bytes"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"regexp"
	"slices"
	"strings"

	"github.com/llmescrow/escrow/endpoint"
)

// Multipart bodies (endpoint.Spec.Multipart: image edits). Only the fields a proven spec prices
// from are read (model, stream, the end user and its StatedFields); files and other fields pass
// untouched. As with JSON bodies, what escrow reads must be what the upstream reads: a field it
// reads that comes twice, as a file, or in another spelling is refused.

// maxFormValue bounds a field escrow reads.
const maxFormValue = 1 << 12

// smallInt is how a count is written in a form that escrow reads the same as any server.
var smallInt = regexp.MustCompile(`^[1-9][0-9]{0,3}$`)

// parseBody parses a priced request's body: JSON, or the form of a multipart spec.
func parseBody(req *http.Request, path string, body []byte) (Request, *Error) {
	spec := pricedSpec(path)
	if spec == nil || !spec.Multipart {
		return parseRequest(path, body)
	}
	return parseMultipart(spec, req.Header.Get("Content-Type"), body)
}

// multipartReader reads body by the boundary of its Content-Type ct.
func multipartReader(ct string, body []byte) (*multipart.Reader, string, *Error) {
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return nil, "", errInvalid("", "This endpoint takes a multipart/form-data body.")
	}
	return multipart.NewReader(bytes.NewReader(body), params["boundary"]), params["boundary"], nil
}

// parseMultipart reads the fields of a multipart body that its spec prices from.
func parseMultipart(spec *endpoint.Spec, ct string, body []byte) (Request, *Error) {
	r := Request{Spec: spec, N: 1, Bounded: true, Size: len(body)}
	mr, _, e := multipartReader(ct, body)
	if e != nil {
		return r, e
	}
	known := slices.Concat([]string{"model", "stream", spec.EndUserField}, spec.StatedFields)
	var st endpoint.Stated
	seen := map[string]bool{}
	for {
		p, err := mr.NextRawPart() // raw: as the upstream reads it (no quoted-printable decoding)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return r, errInvalid("", "The multipart/form-data body could not be read.")
		}
		name := p.FormName()
		if p.FileName() != "" {
			st.Files++
		}
		if !slices.Contains(known, name) {
			if k := strings.ToLower(strings.TrimSpace(name)); slices.Contains(known, k) {
				return r, errInvalid(k, "Unrecognized form field '"+name+"': did you mean '"+k+"'?")
			}
			if p.FileName() == "" {
				n, err := io.Copy(io.Discard, p) // a text field (the prompt): its bytes may be text tokens
				if err != nil {
					return r, errInvalid("", "The multipart/form-data body could not be read.")
				}
				st.TextBytes += n
			}
			continue
		}
		if name == "file" && !seen[name] {
			seen[name] = true
			b, err := io.ReadAll(p)
			if err != nil {
				return r, errInvalid(name, "'file' could not be read.")
			}
			st.Audio = b
			continue
		}
		if seen[name] || p.FileName() != "" {
			return r, errInvalid(name, "'"+name+"' must be given once, as a form field.")
		}
		seen[name] = true
		b, err := io.ReadAll(io.LimitReader(p, maxFormValue+1))
		if err != nil || len(b) > maxFormValue {
			return r, errInvalid(name, "'"+name+"' could not be read.")
		}
		v := string(b)
		st.TextBytes += int64(len(b))
		switch name {
		case "model":
			r.Model = v
		case "stream":
			r.Stream = v != "" && v != "false" && v != "0"
		case spec.EndUserField:
			r.EndUser = v
		case "n":
			if !smallInt.MatchString(v) {
				return r, errInvalid("n", "'n' must be a positive integer.")
			}
			var n int64
			for _, c := range v {
				n = n*10 + int64(c-'0')
			}
			st.N = n
		case "partial_images":
			if v != "0" && !smallInt.MatchString(v) {
				return r, errInvalid(name, "'partial_images' must be an integer from 0 to 3.")
			}
			for _, c := range v {
				st.PartialImages = st.PartialImages*10 + int64(c-'0')
			}
		case "size":
			st.Size = v
		case "quality":
			st.Quality = v
		}
	}
	return proveStated(spec, r, st)
}

// renameModel writes the routed model name up into the body: the JSON member, or the model
// field of a multipart form (rewritten with the same boundary; added when absent).
func renameModel(req *http.Request, r Request, body []byte, up string) ([]byte, *Error) {
	if !r.Spec.Multipart {
		return setTopString(body, "model", up), nil
	}
	mr, boundary, e := multipartReader(req.Header.Get("Content-Type"), body)
	if e != nil {
		return nil, e
	}
	var out bytes.Buffer
	mw := multipart.NewWriter(&out)
	if err := mw.SetBoundary(boundary); err != nil {
		return nil, errInvalid("", "The multipart/form-data boundary cannot be kept.")
	}
	wrote := false
	for {
		p, err := mr.NextRawPart() // raw: as the upstream reads it (no quoted-printable decoding)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, errInvalid("", "The multipart/form-data body could not be read.")
		}
		w, err := mw.CreatePart(p.Header)
		if err != nil {
			return nil, errInternal("The request could not be prepared.")
		}
		if p.FormName() == "model" {
			_, err = io.WriteString(w, up)
			wrote = true
		} else {
			_, err = io.Copy(w, p)
		}
		if err != nil {
			return nil, errInvalid("", "The multipart/form-data body could not be read.")
		}
	}
	if !wrote {
		if err := mw.WriteField("model", up); err != nil {
			return nil, errInternal("The request could not be prepared.")
		}
	}
	if err := mw.Close(); err != nil {
		return nil, errInternal("The request could not be prepared.")
	}
	return out.Bytes(), nil
}
