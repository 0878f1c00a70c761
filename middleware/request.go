package middleware

import (
	"encoding/json"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/pricing"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// pricedSpec is the spec of a path that gets a hold, nil for any other path.
func pricedSpec(path string) *endpoint.Spec {
	if s := endpoint.Lookup(path); s != nil && s.Billed {
		return s
	}
	return nil
}

// Request is what the middleware reads from a request body, without decoding the whole body: a
// walk over the raw bytes of the top-level fields and of the few objects below that matter,
// reading every key as leniently as any upstream would (fields.go).
type Request struct {
	Spec         *endpoint.Spec // the endpoint's spec (package endpoint)
	Model        string
	Stream       bool
	IncludeUsage bool // stream_options.include_usage is true
	// OutputCap is the largest of the cap fields the endpoint's upstream reads
	// (endpoint.Spec.CapFields); 0 = none sent. A cap field of another endpoint is refused.
	OutputCap int64
	N         int64 // the largest of the endpoint's choice fields (n, best_of); 1 when absent
	// ThinkingBudget is Anthropic's thinking.budget_tokens (0: none); fit keeps it valid.
	ThinkingBudget int64
	// ImagesLow and ImagesHigh count the image parts of the input by detail ("low"; "high",
	// "auto" or none): each is bounded by the endpoint's image rule (Spec.Images).
	ImagesLow, ImagesHigh int64
	// Tools: the body defines tools or functions the model reads: bounded by their bytes plus
	// the endpoint's ToolOverhead.
	Tools bool
	// PartTokens is what the images and tool definitions add to the input tokens the body's
	// bytes bound; set by the middleware once the model is known (partTokens).
	PartTokens int64
	// Prompts is how many prompts a legacy completion's prompt array holds (each is completed
	// on its own, n times): 1 for one prompt (a string or one array of token ids).
	Prompts    int64
	Background bool // Responses "background": true (bills later: refused)
	// Bounded: every top-level field is on the allow-list of fields whose tokens the request
	// bounds, and every message/input part is text, an image (the image rule) or a tool
	// definition (bytes + overhead). Only then may the hold drop to the request's bound;
	// otherwise (server-side context, unknown fields) it is at least that bound.
	Bounded bool
	// Features lists what the price table cannot price: "audio", "image_output",
	// "service_tier:<tier>", "tool:<type>". Refused unless Config.Allow names them.
	Features []string
	Size     int // body length in bytes
	// EndUser is the end user the body names: the OpenAI "user" field, Anthropic's
	// metadata.user_id ("" for none). Config.EndUserHeader, when set, names it instead.
	EndUser string
	// Proof is what a request of a proven or free endpoint bills, known from its body
	// (endpoint.Spec.Prove; empty for a free one): its hold and its charge (proven.go). nil for
	// any other endpoint.
	Proof *pricing.Usage
	// Stated is what the body of a proven endpoint states (its proof is made again with the
	// model's prices before the hold: serveProven).
	Stated *endpoint.Stated
}

// topPlain are the top-level fields that carry only text (or numbers and switches that do not
// change what a token costs). A body with any other field never lowers its hold.
var topPlain = []string{
	"model", "messages", "input", "prompt", "instructions",
	"stream", "stream_options",
	"max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of",
	"temperature", "top_p", "stop", "presence_penalty", "frequency_penalty",
	"logit_bias", "logprobs", "top_logprobs", "user", "seed",
	"response_format", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
	"reasoning_effort", "reasoning", "verbosity", "text", "metadata",
	"store", "prompt_cache_key", "safety_identifier", "truncation",
	"suffix", "echo", "encoding_format", "dimensions", "service_tier",
	"max_tool_calls",
}

// topOther are the other top-level fields escrow reads or knows to change the price: present
// (not null), they keep the learned max, and their spelling is checked like the rest.
var topOther = []string{
	"background", "audio", "modalities", "web_search_options", "previous_response_id", "conversation",
	"prediction", "include",
}

// The objects escrow reads below the top level, with the fields it knows in each. A key that
// folds to one of these must be spelled exactly and appear once (see fields.go); other keys are
// unknown, and an unknown non-null key in an item or content part keeps the learned max.
var (
	topFields        = newFieldSet(append(slices.Clip(topPlain), topOther...)...)
	topPlainMask     = topFields.mask(topPlain...)
	streamOptFields  = newFieldSet("include_usage", "include_obfuscation")
	metadataFields   = newFieldSet("user_id")
	toolFields       = newFieldSet("type", "function", "custom", "name", "description", "parameters", "strict", "format")
	toolChoiceFields = newFieldSet("type", "function", "custom", "name", "mode", "tools")
	// itemFields: a chat message or a Responses input item.
	itemFields = newFieldSet("type", "role", "content", "name", "id", "status", "tool_calls", "tool_call_id",
		"function_call", "refusal", "audio", "call_id", "arguments", "output", "input")
	// partFields: a content part (of a message, or of a function_call_output's output array).
	partFields = newFieldSet("type", "text", "refusal", "annotations", "logprobs", "image_url", "input_audio",
		"file", "file_id", "file_url", "file_data", "filename", "detail", "image", "audio")
	partImageMask = partFields.mask("type", "text", "refusal", "annotations", "logprobs", "image_url", "detail")
)

// isPlainTool reports whether a tool type is run by the client itself: its definitions and
// calls are text.
func isPlainTool(typ string) bool { return typ == "function" || typ == "custom" }

// bstr views b as a string without copying; b must not change while the string is used.
func bstr(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// parseRequest reads the fields of a priced request. It never decodes the whole body: it walks
// the raw bytes of the top-level object and of the objects below it that change the price
// (stream_options, tools[*], tool_choice, messages / input items and their content parts),
// allocating only for the model name, escaped keys and refusals.
func parseRequest(path string, body []byte) (Request, *Error) {
	spec := pricedSpec(path)
	if spec == nil {
		return Request{}, &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Code: CodeNotFound, Message: "Invalid URL (POST " + path + ")"}
	}
	if spec.Provider == endpoint.Anthropic {
		return parseMessages(spec, body)
	}
	if spec.Free || spec.Prove != nil {
		return parseStated(spec, body)
	}
	r, e := walkTop(spec, body, topFields, topPlainMask, (*reqParser).top)
	if e == nil && r.Model == "" {
		e = errMissing("model", "You must provide a model parameter.")
	}
	return r, e
}

// checkJSONObject refuses a body that is not one valid JSON object in UTF-8.
func checkJSONObject(body []byte) *Error {
	if !gjson.ValidBytes(body) {
		return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON,
			Message: "We could not parse the JSON body of your request. The body must be a JSON object."}
	}
	// Python upstreams refuse a body that is not UTF-8 and Go ones read its bad bytes as U+FFFD:
	// refused here, so no string escrow reads can be read otherwise.
	if !utf8.Valid(body) {
		return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON,
			Message: "The body of your request is not valid UTF-8."}
	}
	raw := bstr(body)
	if i := skipWS(raw, 0); i >= len(raw) || raw[i] != '{' {
		return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON,
			Message: "The body of your request must be a JSON object."}
	}
	return nil
}

// top reads a top-level field of topFields other than model and stream (walkTop).
func (p *reqParser) top(name string, kind byte, v string) {
	r := &p.r
	switch name {
	case "stream_options":
		p.streamOptions(v)
	case "user":
		p.endUser(name, v)
	case "max_tokens", "max_completion_tokens", "max_output_tokens":
		p.capField(name, kind, v)
	case "n", "best_of":
		// Each of n (or best_of) choices is generated, and billed, in full: the hold is
		// multiplied by the larger (HoldAmount). A field the endpoint does not multiply by is
		// ignored by its upstream.
		if kind != 'n' && slices.Contains(r.Spec.Choices, name) {
			r.N = max(r.N, p.positive(name, v))
		}
	case "functions":
		if kind != 'n' && v != "[]" {
			r.Tools = true
		}
	case "background":
		r.Background = p.boolean(name, v)
	case "audio":
		if kind != 'n' {
			r.addFeature("audio")
		}
	case "modalities":
		p.modalities(v)
	case "service_tier":
		if p.nullOr(name, v, shapeString) {
			if t := rawString(v); t != "auto" && t != "default" {
				r.addFeature("service_tier:" + t)
			}
		}
	case "tools":
		p.tools(v, toolFields, true, isPlainTool)
	case "tool_choice":
		p.toolChoice(v)
	case "web_search_options":
		if kind != 'n' {
			r.addFeature("tool:web_search")
		}
	case "messages", "input", "prompt", "instructions", "suffix":
		if !p.content(name, v) {
			r.Bounded = false
		}
		if name == r.Spec.PromptArray {
			r.Prompts = promptCount(v)
		}
	}
}

// promptCount is the number of prompts of a legacy completion's prompt: the elements of an
// array of strings or of token-id arrays, 1 for a string or one array of token ids. Anything
// else in the array is counted too (the upstream refuses it or completes it: never fewer).
func promptCount(v string) int64 {
	if rawKind(v) != '[' {
		return 1
	}
	var n int64
	tokens := true
	forEachRaw(v, func(_, e string) bool {
		n++
		if rawKind(e) != '0' {
			tokens = false
		}
		return true
	})
	if tokens || n == 0 {
		return 1
	}
	return n
}

func (p *reqParser) streamOptions(v string) {
	if !p.nullOr("stream_options", v, shapeObject) {
		return
	}
	p.members(v, streamOptFields, allPlain, loc{field: "stream_options", i: -1}, func(i int, v string) {
		if streamOptFields.names[i] == "include_usage" {
			p.r.IncludeUsage = p.boolean("stream_options.include_usage", v)
		}
	})
}

// endUser reads the end user a body names (path: "user", or Anthropic's "metadata.user_id"): a
// string or null. The upstream reads the same member: fields.go refuses a second or a variant
// spelling of it.
func (p *reqParser) endUser(path, v string) {
	if p.nullOr(path, v, shapeString) {
		p.r.EndUser = strings.Clone(rawString(v))
	}
}

// msgMetadata reads Anthropic's metadata object: its user_id is the end user.
func (p *reqParser) msgMetadata(v string) {
	if !p.nullOr("metadata", v, shapeObject) {
		return
	}
	p.members(v, metadataFields, allPlain, loc{field: "metadata", i: -1}, func(i int, v string) {
		p.endUser("metadata.user_id", v)
	})
}

// modalities reads the output modalities asked for: any but text is a feature.
func (p *reqParser) modalities(v string) {
	if !p.nullOr("modalities", v, shapeArray) {
		return
	}
	forEachRaw(v, func(_, m string) bool {
		switch rawString(m) {
		case "text":
		case "audio":
			p.r.addFeature("audio")
		default:
			p.r.addFeature("image_output")
		}
		return true
	})
}

// toolChoice reads a tool_choice object: a hosted tool forced by it is a hosted tool used.
func (p *reqParser) toolChoice(v string) {
	if rawKind(v) != '{' {
		return // "none", "auto", "required"
	}
	typ := p.typeOf(v, toolChoiceFields, loc{field: "tool_choice", i: -1}, true)
	if p.fail == nil && !isPlainTool(typ) && typ != "allowed_tools" {
		p.r.Bounded = false
		p.r.addFeature("tool:" + typ)
	}
}

// content reports whether a messages / input / prompt / instructions / suffix value is plain
// text: strings, token arrays, and message or input items whose content parts are all text.
// Images, audio, files, stored prompts and references to server-side items are not. It walks
// every item and part even once the answer is no, because a part's spelling and features (audio
// input) must be checked all the same.
func (p *reqParser) content(field, v string) bool {
	switch rawKind(v) {
	case 'n', '"', '0':
		return true
	case '{':
		if field == "prompt" {
			return false // a stored prompt ({"id":"pmpt_…"}): server-side text of unknown length
		}
		return p.item(v, loc{field: field, i: -1})
	case '[':
	default:
		return false
	}
	plain, i := true, 0
	forEachRaw(v, func(_, e string) bool {
		switch rawKind(e) {
		case '"', '0':
		case '[': // token ids
			forEachRaw(e, func(_, t string) bool {
				if rawKind(t) != '0' {
					plain = false
				}
				return plain
			})
		case '{':
			if !p.item(e, loc{field: field, i: i}) {
				plain = false
			}
		default:
			plain = false
		}
		i++
		return p.fail == nil
	})
	return plain
}

// textItems are the item types whose content is text (no "type" is a chat message or a
// Responses "easy" message).
var textItems = map[string]bool{
	"message": true, "function_call": true, "function_call_output": true, "custom_tool_call": true, "custom_tool_call_output": true,
}

// item checks one chat message or Responses input item: a type of textItems (or none), and
// content / output that is a string or text parts. Any other non-null field — an item
// reference, reasoning (server state), a chat message's audio reference — keeps the learned max.
func (p *reqParser) item(raw string, l loc) bool {
	textual := true // the item's type and content
	plain := p.members(raw, itemFields, allPlain, l, func(i int, v string) {
		kind := rawKind(v)
		switch name := itemFields.names[i]; name {
		case "type":
			if kind != '"' || !textItems[rawString(v)] {
				textual = false
			}
		case "audio":
			if kind != 'n' {
				textual = false
			}
		case "content", "output":
			switch kind {
			case 'n', '"':
			case '[':
				j := 0
				forEachRaw(v, func(_, part string) bool {
					if !p.part(part, loc{field: l.field, i: l.i, sub: name, j: j}) {
						textual = false
					}
					j++
					return p.fail == nil
				})
			default:
				textual = false
			}
		}
	})
	return plain && textual
}

// part checks one content part: plain when its type is a text part of the endpoint and it
// carries nothing but text. Audio input is a feature the price table cannot price.
func (p *reqParser) part(raw string, l loc) bool {
	if rawKind(raw) != '{' {
		return false
	}
	typ, detail, fileID := "", "", false
	var image string
	plain := p.members(raw, partFields, partImageMask, l, func(i int, v string) {
		switch partFields.names[i] {
		case "type":
			typ = rawString(v)
		case "detail":
			detail = rawString(v)
		case "image_url":
			image = v
		case "file_id":
			fileID = rawKind(v) != 'n'
		}
	})
	switch {
	case p.fail != nil:
		return false
	case typ == "input_audio":
		p.r.addFeature("audio")
		return false
	case !plain:
		return false
	case p.r.Spec.TextPart(typ):
		return true
	case !p.r.Spec.ImagePart(typ) || fileID || image == "" || rawKind(image) == 'n':
		return false // a file, or an uploaded image: server-side
	}
	// An image: bounded by the image rule of its detail (the part's, or chat's image_url.detail).
	if rawKind(image) == '{' {
		detail = imageDetail(image)
	}
	if detail == "low" {
		p.r.ImagesLow++
	} else {
		p.r.ImagesHigh++
	}
	return true
}

// imageDetail is the detail of a chat image_url object: "low" only when every member an
// upstream could read as its detail says exactly "low" (anything else is bounded as high).
func imageDetail(obj string) string {
	detail := ""
	forEachRaw(obj, func(k, v string) bool {
		if strings.EqualFold(k, "detail") {
			if rawString(v) != "low" {
				detail = "high"
				return false
			}
			detail = "low"
		}
		return true
	})
	return detail
}

func (r *Request) addFeature(f string) {
	if slices.Contains(r.Features, f) {
		return
	}
	r.Features = append(r.Features, f)
}

// rawBool reads a raw boolean that may be null (false).
func rawBool(v string) (b, ok bool) {
	switch v {
	case "true":
		return true, true
	case "false", "null":
		return false, true
	}
	return false, false
}

// rawPositiveInt reads a raw JSON integer ≥ 1 written without fraction or exponent.
func rawPositiveInt(v string) (int64, bool) {
	if rawKind(v) != '0' {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 {
		return 0, false
	}
	return n, true
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

// skipString returns the index just past the string starting at s[i] == '"'. It jumps from
// quote to quote (IndexByte is vectorized) and counts the backslashes before each: an even
// number means the quote closes the string.
func skipString(s string, i int) int {
	start := i + 1
	for i = start; i < len(s); i++ {
		j := strings.IndexByte(s[i:], '"')
		if j < 0 {
			break
		}
		i += j
		k := i
		for k > start && s[k-1] == '\\' {
			k--
		}
		if (i-k)%2 == 0 {
			return i + 1
		}
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

// setTopString returns a copy of body, a JSON object whose top-level member key is unique and
// spelled exactly (parseRequest checked both), with that member's value replaced by the JSON
// string v; nothing else changes. Without such a member, body is returned as it is.
func setTopString(body []byte, key, v string) []byte {
	enc, _ := json.Marshal(v) // a string always encodes
	out, _ := setTopRaw(body, key, enc)
	return out
}

// setTopRaw is setTopString with v already JSON; found reports whether body had the member.
func setTopRaw(body []byte, key string, v []byte) (out []byte, found bool) {
	raw := bstr(body)
	i := skipWS(raw, 0)
	if i >= len(raw) || raw[i] != '{' {
		return body, false
	}
	for i++; ; {
		i = skipWS(raw, i)
		if i >= len(raw) || raw[i] == '}' {
			return body, false
		}
		if raw[i] == ',' {
			i++
			continue
		}
		end := skipString(raw, i)
		k := rawString(raw[i:end])
		i = skipWS(raw, end)
		if i < len(raw) && raw[i] == ':' {
			i++
		}
		i = skipWS(raw, i)
		vend := skipValue(raw, i)
		if k == key {
			out := make([]byte, 0, len(body)-(vend-i)+len(v))
			out = append(append(append(out, body[:i]...), v...), body[vend:]...)
			return out, true
		}
		i = vend
	}
}

// addTopRaw returns a copy of body, a JSON object without a member key, with "key": v added
// as its first member.
func addTopRaw(body []byte, key string, v []byte) []byte {
	raw := bstr(body)
	i := skipWS(raw, 0)
	if i >= len(raw) || raw[i] != '{' {
		return body
	}
	k, _ := json.Marshal(key)
	sep := ","
	if j := skipWS(raw, i+1); j < len(raw) && raw[j] == '}' {
		sep = ""
	}
	out := make([]byte, 0, len(body)+len(k)+len(v)+2)
	out = append(out, body[:i+1]...)
	out = append(append(append(append(out, k...), ':'), v...), sep...)
	return append(out, body[i+1:]...)
}

// injectIncludeUsage returns a copy of body with stream_options.include_usage = true, touching
// nothing else.
func injectIncludeUsage(body []byte) ([]byte, error) {
	if so := gjson.GetBytes(body, "stream_options"); !so.Exists() || so.Type == gjson.Null {
		return sjson.SetRawBytes(body, "stream_options", []byte(`{"include_usage":true}`))
	}
	return sjson.SetBytes(body, "stream_options.include_usage", true)
}
