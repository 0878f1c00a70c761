package middleware

import (
	"net/http"
	"strconv"
	"strings"
	"unsafe"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// The priced endpoints: the only paths that get a hold.
const (
	EndpointChat        = "/v1/chat/completions"
	EndpointCompletions = "/v1/completions"
	EndpointEmbeddings  = "/v1/embeddings"
	EndpointResponses   = "/v1/responses"
)

func pricedEndpoint(path string) bool {
	switch path {
	case EndpointChat, EndpointCompletions, EndpointEmbeddings, EndpointResponses:
		return true
	}
	return false
}

// Request is what the middleware reads from a request body, without decoding the whole body:
// gjson walks the top-level fields and looks into the few that matter.
type Request struct {
	Endpoint     string // one of the Endpoint… paths
	Model        string
	Stream       bool
	IncludeUsage bool  // stream_options.include_usage is true
	OutputCap    int64 // the largest of max_tokens, max_completion_tokens, max_output_tokens; 0 = none
	N            int64 // the largest of n and best_of; 1 when absent
	Background   bool  // Responses "background": true (bills later: refused)
	// PlainText: every top-level field is on the allow-list of plain-text fields and every
	// message/input part is text. Only then may the hold drop to the request's hard bound.
	PlainText bool
	// Features lists what the price table cannot price: "audio", "image_output",
	// "service_tier:<tier>", "tool:<type>". Refused unless Config.Allow names them.
	Features []string
	Size     int // body length in bytes
}

// plainFields are the top-level fields that carry only text (or numbers and switches that do not
// change what a token costs). A body with any other field never lowers its hold.
var plainFields = map[string]bool{
	"model": true, "messages": true, "input": true, "prompt": true, "instructions": true,
	"stream": true, "stream_options": true,
	"max_tokens": true, "max_completion_tokens": true, "max_output_tokens": true, "n": true, "best_of": true,
	"temperature": true, "top_p": true, "stop": true, "presence_penalty": true, "frequency_penalty": true,
	"logit_bias": true, "logprobs": true, "top_logprobs": true, "user": true, "seed": true,
	"response_format": true, "tools": true, "tool_choice": true, "parallel_tool_calls": true,
	"reasoning_effort": true, "reasoning": true, "verbosity": true, "text": true, "metadata": true,
	"store": true, "prompt_cache_key": true, "safety_identifier": true, "truncation": true,
	"suffix": true, "echo": true, "encoding_format": true, "dimensions": true, "service_tier": true,
	"max_tool_calls": true,
}

// plainTools are the tool types the client runs itself: their definitions and calls are text.
var plainTools = map[string]bool{"function": true, "custom": true}

// bstr views b as a string without copying; b must not change while the string is used.
func bstr(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// parseRequest reads the fields of a priced request. It never decodes the whole body.
func parseRequest(endpoint string, body []byte) (Request, *Error) {
	r := Request{Endpoint: endpoint, N: 1, PlainText: true, Size: len(body)}
	if !gjson.ValidBytes(body) {
		return r, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON,
			Message: "We could not parse the JSON body of your request. The body must be a JSON object."}
	}
	root := gjson.Parse(bstr(body))
	if !root.IsObject() {
		return r, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON,
			Message: "The body of your request must be a JSON object."}
	}
	var fail *Error
	seen := newKeySet()
	haveModel := false
	root.ForEach(func(k, v gjson.Result) bool {
		key := k.String()
		if !seen.add(key) {
			fail = errInvalid(key, "Duplicate field '"+key+"' in the request body.")
			return false
		}
		if !plainFields[key] && v.Type != gjson.Null {
			r.PlainText = false
		}
		switch key {
		case "model":
			if v.Type != gjson.String || v.Str == "" {
				fail = errInvalid("model", "'model' must be a non-empty string.")
				return false
			}
			r.Model = strings.Clone(v.Str)
			haveModel = true
		case "stream":
			b, ok := optBool(v)
			if !ok {
				fail = errInvalid("stream", "'stream' must be a boolean.")
				return false
			}
			r.Stream = b
		case "stream_options":
			if v.Type == gjson.Null {
				return true
			}
			if !v.IsObject() {
				fail = errInvalid("stream_options", "'stream_options' must be an object.")
				return false
			}
			inner := newKeySet()
			v.ForEach(func(k2, v2 gjson.Result) bool {
				name := k2.String()
				if !inner.add(name) {
					fail = errInvalid("stream_options."+name, "Duplicate field 'stream_options."+name+"'.")
					return false
				}
				if name == "include_usage" {
					b, ok := optBool(v2)
					if !ok {
						fail = errInvalid("stream_options.include_usage", "'stream_options.include_usage' must be a boolean.")
						return false
					}
					r.IncludeUsage = b
				}
				return true
			})
		case "max_tokens", "max_completion_tokens", "max_output_tokens":
			if v.Type == gjson.Null {
				return true
			}
			n, ok := positiveInt(v)
			if !ok {
				fail = errInvalid(key, "'"+key+"' must be a positive integer.")
				return false
			}
			r.OutputCap = max(r.OutputCap, n)
		case "n", "best_of":
			if v.Type == gjson.Null {
				return true
			}
			n, ok := positiveInt(v)
			if !ok {
				fail = errInvalid(key, "'"+key+"' must be a positive integer.")
				return false
			}
			r.N = max(r.N, n)
		case "background":
			b, ok := optBool(v)
			if !ok {
				fail = errInvalid("background", "'background' must be a boolean.")
				return false
			}
			r.Background = b
		case "audio":
			if v.Type != gjson.Null {
				r.addFeature("audio")
			}
		case "modalities":
			v.ForEach(func(_, m gjson.Result) bool {
				switch m.String() {
				case "text":
				case "audio":
					r.addFeature("audio")
				default:
					r.addFeature("image_output")
				}
				return true
			})
		case "service_tier":
			switch v.Type {
			case gjson.Null:
			case gjson.String:
				if t := v.Str; t != "auto" && t != "default" {
					r.addFeature("service_tier:" + t)
				}
			default:
				fail = errInvalid("service_tier", "'service_tier' must be a string.")
				return false
			}
		case "tools":
			if v.Type == gjson.Null {
				return true
			}
			if !v.IsArray() {
				fail = errInvalid("tools", "'tools' must be an array.")
				return false
			}
			forEachRaw(v.Raw, func(_, t string) bool {
				typ := ""
				forEachRaw(t, func(k, tv string) bool {
					if k == "type" {
						typ = rawString(tv)
						return false
					}
					return true
				})
				if !plainTools[typ] {
					r.PlainText = false
					r.addFeature("tool:" + typ)
				}
				return true
			})
		case "web_search_options":
			if v.Type != gjson.Null {
				r.addFeature("tool:web_search")
			}
		case "messages", "input", "prompt", "instructions":
			if !plainContent(v) {
				r.PlainText = false
			}
		}
		return true
	})
	if fail != nil {
		return r, fail
	}
	if !haveModel {
		return r, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: "model", Code: CodeMissingField,
			Message: "You must provide a model parameter."}
	}
	return r, nil
}

func (r *Request) addFeature(f string) {
	for _, x := range r.Features {
		if x == f {
			return
		}
	}
	r.Features = append(r.Features, f)
}

// optBool reads a boolean that may be null (false).
func optBool(v gjson.Result) (bool, bool) {
	switch v.Type {
	case gjson.True:
		return true, true
	case gjson.False, gjson.Null:
		return false, true
	}
	return false, false
}

// positiveInt reads a JSON integer ≥ 1 written without fraction or exponent.
func positiveInt(v gjson.Result) (int64, bool) {
	if v.Type != gjson.Number {
		return 0, false
	}
	n, err := strconv.ParseInt(v.Raw, 10, 64)
	if err != nil || n < 1 {
		return 0, false
	}
	return n, true
}

// plainContent reports whether a messages / input / prompt / instructions value is plain text:
// strings, token arrays, and message objects whose content parts are all text. Images, audio,
// files and references to server-side items are not. It walks the raw bytes (already validated)
// without unescaping or allocating.
func plainContent(v gjson.Result) bool {
	switch v.Type {
	case gjson.String, gjson.Null, gjson.Number:
		return true
	case gjson.JSON:
	default:
		return false
	}
	if v.IsObject() {
		return plainItem(v.Raw)
	}
	ok := true
	forEachRaw(v.Raw, func(_, e string) bool {
		switch rawKind(e) {
		case '"', '0':
		case '[': // token ids
			forEachRaw(e, func(_, t string) bool {
				ok = rawKind(t) == '0'
				return ok
			})
		case '{':
			ok = plainItem(e)
		default:
			ok = false
		}
		return ok
	})
	return ok
}

// plainItem checks one chat message or Responses input item (raw JSON object).
func plainItem(raw string) bool {
	ok := true
	forEachRaw(raw, func(k, v string) bool {
		switch k {
		case "type":
			switch rawString(v) {
			case "message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output":
			default:
				ok = false // item_reference, reasoning (server state), images, files, …
			}
		case "audio", "file_id", "image_url", "input_audio", "file":
			ok = rawKind(v) == 'n'
		case "content":
			switch rawKind(v) {
			case '"', 'n':
			case '[':
				forEachRaw(v, func(_, part string) bool {
					ok = rawKind(part) == '{' && plainPart(part)
					return ok
				})
			default:
				ok = false
			}
		}
		return ok
	})
	return ok
}

// plainPart checks a content part: its type must be text.
func plainPart(raw string) bool {
	typ := ""
	forEachRaw(raw, func(k, v string) bool {
		if k == "type" {
			typ = rawString(v)
			return false
		}
		return true
	})
	switch typ {
	case "text", "input_text", "output_text", "refusal":
		return true
	}
	return false
}

// rawKind classifies a raw JSON value by its first byte: '"', '{', '[', 'n' (null), 't'/'f',
// '0' (number).
func rawKind(v string) byte {
	if v == "" {
		return 0
	}
	switch c := v[0]; c {
	case '"', '{', '[', 'n', 't', 'f':
		return c
	}
	return '0'
}

// rawString returns the value of a raw JSON string ("" for other values), unescaping only when
// it has escapes.
func rawString(v string) string {
	if rawKind(v) != '"' {
		return ""
	}
	if strings.IndexByte(v, '\\') < 0 {
		return v[1 : len(v)-1]
	}
	return gjson.Parse(v).Str
}

// forEachRaw calls fn with the key (unescaped; "" in arrays) and raw value of each member of a
// raw JSON object or array that is already known to be valid. It stops when fn returns false.
func forEachRaw(raw string, fn func(key, val string) bool) {
	i := skipWS(raw, 0)
	if i >= len(raw) || (raw[i] != '{' && raw[i] != '[') {
		return
	}
	obj := raw[i] == '{'
	i++
	for {
		i = skipWS(raw, i)
		if i >= len(raw) || raw[i] == '}' || raw[i] == ']' {
			return
		}
		if raw[i] == ',' {
			i++
			continue
		}
		key := ""
		if obj {
			end := skipString(raw, i)
			key = rawString(raw[i:end])
			i = skipWS(raw, end)
			if i < len(raw) && raw[i] == ':' {
				i++
			}
			i = skipWS(raw, i)
		}
		end := skipValue(raw, i)
		if !fn(key, raw[i:end]) {
			return
		}
		i = end
	}
}

func skipWS(s string, i int) int {
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index just past the string starting at s[i] == '"'.
func skipString(s string, i int) int {
	for i++; i < len(s); {
		j := strings.IndexAny(s[i:], "\"\\")
		if j < 0 {
			break
		}
		i += j
		if s[i] == '"' {
			return i + 1
		}
		i += 2
	}
	return len(s)
}

// skipValue returns the index just past the value starting at s[i].
func skipValue(s string, i int) int {
	if i >= len(s) {
		return i
	}
	switch s[i] {
	case '"':
		return skipString(s, i)
	case '{', '[':
		depth := 0
		for i < len(s) {
			switch s[i] {
			case '"':
				i = skipString(s, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return i
	}
	for i < len(s) && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\t' && s[i] != '\n' && s[i] != '\r' {
		i++
	}
	return i
}

// keySet detects duplicate keys: a linear scan for the usual handful, a map past that.
type keySet struct {
	few  [16]string
	n    int
	many map[string]struct{}
}

func newKeySet() *keySet { return &keySet{} }

func (s *keySet) add(k string) bool {
	if s.many != nil {
		if _, dup := s.many[k]; dup {
			return false
		}
		s.many[k] = struct{}{}
		return true
	}
	for _, x := range s.few[:s.n] {
		if x == k {
			return false
		}
	}
	if s.n < len(s.few) {
		s.few[s.n] = k
		s.n++
		return true
	}
	s.many = make(map[string]struct{}, 2*len(s.few))
	for _, x := range s.few {
		s.many[x] = struct{}{}
	}
	s.many[k] = struct{}{}
	return true
}

// injectIncludeUsage returns a copy of body with stream_options.include_usage = true, touching
// nothing else.
func injectIncludeUsage(body []byte) ([]byte, error) {
	if so := gjson.GetBytes(body, "stream_options"); !so.Exists() || so.Type == gjson.Null {
		return sjson.SetRawBytes(body, "stream_options", []byte(`{"include_usage":true}`))
	}
	return sjson.SetBytes(body, "stream_options.include_usage", true)
}
