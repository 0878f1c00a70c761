package middleware

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// Anthropic's Messages API (issue 15): POST /v1/messages is priced like the OpenAI endpoints —
// the same hold rule, the same lenient reading of keys (fields.go), the same refusal of what
// the price table cannot price — with Anthropic's own fields, usage and error shape.
// POST /v1/messages/count_tokens costs nothing upstream: it is authenticated and passed on
// without a hold.
//
// isAnthropic reports whether a path is answered in Anthropic's shape.
func isAnthropic(path string) bool {
	s := endpoint.Lookup(path)
	return s != nil && s.Provider == endpoint.Anthropic
}

// Anthropic error types (https://docs.anthropic.com/en/api/errors).
const (
	AnthropicInvalidRequest = "invalid_request_error"
	AnthropicAuthentication = "authentication_error"
	AnthropicBilling        = "billing_error"
	AnthropicPermission     = "permission_error"
	AnthropicNotFound       = "not_found_error"
	AnthropicTooLarge       = "request_too_large"
	AnthropicRateLimit      = "rate_limit_error"
	AnthropicAPI            = "api_error"
	AnthropicTimeout        = "timeout_error"
	AnthropicOverloaded     = "overloaded_error"
)

// forAnthropic returns e as the Messages API answers it: {"type":"error","error":{"type",
// "message"}} with the Anthropic type of its status. An insufficient balance becomes 402
// billing_error with x-should-retry: false: @anthropic-ai/sdk (client.js shouldRetry) obeys
// x-should-retry first and otherwise retries only 408, 409, 429 and 5xx, so neither the header
// nor the status lets it retry a request the balance cannot pay for, and it surfaces as the
// SDK's PaymentRequiredError (an APIError with status 402 in SDKs older than that class).
func (e *Error) forAnthropic() *Error {
	a := *e
	a.Anthropic = true
	if a.Code == CodeInsufficientQuota && a.Status == http.StatusTooManyRequests {
		a.Status, a.NoRetry = http.StatusPaymentRequired, true
		a.Message = "Your credit balance is too low for this request. Add credit and retry."
		if rest, ok := strings.CutPrefix(e.Message, quotaPrefix); ok {
			a.Message = "Your credit balance is too low for this request" + rest // with the numbers
		}
	}
	switch s := a.Status; {
	case s == http.StatusUnauthorized:
		a.Type = AnthropicAuthentication
	case s == http.StatusPaymentRequired:
		a.Type = AnthropicBilling
	case s == http.StatusForbidden:
		a.Type = AnthropicPermission
	case s == http.StatusNotFound:
		a.Type = AnthropicNotFound
	case s == http.StatusRequestEntityTooLarge:
		a.Type = AnthropicTooLarge
	case s == http.StatusTooManyRequests:
		a.Type = AnthropicRateLimit
	case s == http.StatusServiceUnavailable || s == 529:
		a.Type = AnthropicOverloaded
	case s == http.StatusGatewayTimeout:
		a.Type = AnthropicTimeout
	case s >= 500:
		a.Type = AnthropicAPI
	default:
		a.Type = AnthropicInvalidRequest
	}
	return &a
}

// The Messages API's fields escrow knows. A key that folds to one of these must be spelled
// exactly and appear once (fields.go); other keys are unknown, and an unknown non-null key
// keeps the learned max.
var (
	// msgTopPlain: fields that carry only text, or switches that do not change what a token
	// costs. thinking is plain: thinking tokens are output tokens, within max_tokens.
	msgTopPlain = []string{
		"model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k",
		"stop_sequences", "metadata", "thinking", "service_tier", "cache_control", "tools", "tool_choice",
		"max_completion_tokens", "max_output_tokens", // refused: not Anthropic's (capField)
	}
	// msgTopOther: fields escrow reads or knows to change the price or the input beyond what
	// the request bounds. (tools bring Anthropic's tool-use system prompt with them: bounded by
	// the spec's ToolOverhead.)
	msgTopOther = []string{
		"mcp_servers", "container", "context_management", "inference_geo", "speed",
		"anthropic_beta",
	}
	msgTopFields     = newFieldSet(append(slices.Clip(msgTopPlain), msgTopOther...)...)
	msgTopPlainMask  = msgTopFields.mask(msgTopPlain...)
	msgToolFields    = newFieldSet("type", "name", "description", "input_schema", "cache_control")
	msgChoiceFields  = newFieldSet("type", "name", "disable_parallel_tool_use")
	msgMessageFields = newFieldSet("role", "content")
	msgBlockFields   = newFieldSet("type", "text", "cache_control", "source", "id", "name", "input", "tool_use_id",
		"content", "is_error", "thinking", "signature", "data", "citations")
	msgCacheFields    = newFieldSet("type", "ttl")
	msgThinkingFields = newFieldSet("type", "budget_tokens")
	msgSourceFields   = newFieldSet("type", "media_type", "data", "url", "file_id")
)

// msgClientTools reports whether a tool type is run by the client (its use is priced by tokens
// alone): custom tools (no type, or "custom") and the Anthropic-defined client tools (bash,
// text editor, computer use, memory). Server tools — web search, code execution, web fetch,
// tool search, … — run on Anthropic's side, some with per-call or per-hour fees: refused unless
// Config.Allow names "tool:<type>".
func msgClientTools(typ string) bool {
	if typ == "" || typ == "custom" {
		return true
	}
	for _, p := range []string{"bash_", "text_editor_", "computer_", "memory_"} {
		if strings.HasPrefix(typ, p) {
			return true
		}
	}
	return false
}

// parseMessages reads a Messages API body like parseRequest reads OpenAI's: the top-level
// fields, tools[*], tool_choice, system blocks, messages[*] and their content blocks (nested
// tool_result content too) and every cache_control, without decoding the whole body.
func parseMessages(spec *endpoint.Spec, body []byte) (Request, *Error) {
	r, e := walkTop(spec, body, msgTopFields, msgTopPlainMask, (*reqParser).msgTop)
	switch {
	case e != nil:
	case r.Model == "":
		e = errMissing("model", "model: Field required")
	case r.OutputCap == 0: // max_tokens is required, and ≥ 1 when present
		e = errMissing("max_tokens", "max_tokens: Field required")
	}
	return r, e
}

// msgTop reads a top-level field of msgTopFields other than model and stream (walkTop).
func (p *reqParser) msgTop(name string, kind byte, v string) {
	r := &p.r
	switch name {
	case "max_tokens", "max_completion_tokens", "max_output_tokens":
		p.capField(name, kind, v)
	case "thinking":
		p.msgThinking(v)
	case "tools":
		p.tools(v, msgToolFields, false, msgClientTools)
	case "tool_choice":
		if kind == '{' {
			p.typeOf(v, msgChoiceFields, loc{field: name, i: -1}, false)
		}
	case "mcp_servers":
		if kind != 'n' && v != "[]" {
			r.addFeature("mcp_servers")
		}
	case "container":
		if kind != 'n' {
			r.addFeature("container")
		}
	case "inference_geo", "speed", "service_tier":
		if s := rawString(v); kind != 'n' && !msgStandard(name, s) {
			r.addFeature(name + ":" + s)
		}
	case "cache_control":
		p.msgCache(v, name)
	case "metadata":
		p.msgMetadata(v)
	case "anthropic_beta":
		p.msgBodyBetas(v)
	case "system":
		if kind == '[' {
			p.msgBlocks(v, name)
		} else if kind != '"' && kind != 'n' {
			r.Bounded = false
		}
	case "messages":
		p.msgMessages(v)
	}
}

// msgThinking reads the thinking object: the budget of an enabled one (fit keeps it below the
// cap it writes, Spec.Thinking).
func (p *reqParser) msgThinking(v string) {
	if !p.nullOr("thinking", v, shapeObject) {
		return
	}
	enabled, budget := false, int64(0)
	if !p.members(v, msgThinkingFields, allPlain, loc{field: "thinking", i: -1}, func(i int, val string) {
		switch msgThinkingFields.names[i] {
		case "type":
			enabled = rawString(val) == "enabled"
		case "budget_tokens":
			if rawKind(val) != 'n' {
				budget = p.positive("thinking.budget_tokens", val)
			}
		}
	}) {
		p.r.Bounded = false
	}
	if enabled {
		p.r.ThinkingBudget = budget
	}
}

// msgStandard reports whether s is the value of an option (inference_geo, speed,
// service_tier) that the price table prices: any other is a feature.
func msgStandard(option, s string) bool {
	switch option {
	case "inference_geo":
		return s == "global"
	case "speed":
		return s == "standard"
	}
	return s == "auto" || s == "standard_only" // service_tier
}

// msgCache checks a cache_control object: the 5-minute cache (pricing.CacheWrite) and the
// 1-hour cache (pricing.CacheWrite1h, read from usage.cache_creation) are priced; another
// ttl is a feature the price table cannot price.
func (p *reqParser) msgCache(v, path string) {
	if rawKind(v) != '{' {
		return
	}
	p.members(v, msgCacheFields, allPlain, loc{field: path, i: -1}, func(i int, val string) {
		if msgCacheFields.names[i] == "ttl" && rawKind(val) != 'n' {
			if ttl := rawString(val); ttl != "5m" && ttl != "1h" {
				p.r.addFeature("cache_ttl:" + ttl)
			}
		}
	})
}

// msgMessages reads the messages array: each message an object with a role and content.
func (p *reqParser) msgMessages(v string) {
	if rawKind(v) != '[' {
		p.mustBe("messages", shapeArray)
		return
	}
	j := 0
	forEachRaw(v, func(_, m string) bool {
		p.msgMessage(m, loc{field: "messages", i: j})
		j++
		return p.fail == nil
	})
}

func (p *reqParser) msgMessage(raw string, l loc) {
	if rawKind(raw) != '{' {
		p.mustBe(l.String(), shapeObject)
		return
	}
	if !p.members(raw, msgMessageFields, allPlain, l, func(i int, v string) {
		if msgMessageFields.names[i] != "content" {
			return
		}
		switch rawKind(v) {
		case '"':
		case '[':
			p.msgBlocks(v, l.String()+".content")
		default:
			p.r.Bounded = false
		}
	}) {
		p.r.Bounded = false
	}
}

// msgBlocks checks an array of content blocks (of a message, of system, of a tool_result).
func (p *reqParser) msgBlocks(v, path string) {
	j := 0
	forEachRaw(v, func(_, b string) bool {
		p.msgBlock(b, loc{field: path, i: j})
		j++
		return p.fail == nil
	})
}

// msgBlock checks one content block: bounded when its type is a text part of the spec and it
// refers to nothing outside the body, or an image whose data or URL is in the body (the image
// rule); a document, a file source or citations are not.
func (p *reqParser) msgBlock(raw string, l loc) {
	if rawKind(raw) != '{' {
		p.r.Bounded = false
		return
	}
	typ, source := "", ""
	p.members(raw, msgBlockFields, allPlain, l, func(i int, v string) {
		kind := rawKind(v)
		switch msgBlockFields.names[i] {
		case "type":
			typ = rawString(v)
		case "cache_control":
			p.msgCache(v, l.String()+".cache_control")
		case "content": // a tool_result's content: a string or blocks
			if kind == '[' {
				p.msgBlocks(v, l.String()+".content")
			}
		case "source":
			source = v
		case "citations":
			if kind != 'n' {
				p.r.Bounded = false
			}
		}
	})
	switch {
	case p.fail != nil:
	case p.r.Spec.ImagePart(typ) && p.msgImageSource(source, l.String()+".source"):
		p.r.ImagesHigh++ // bounded by the image rule
	case source != "" && rawKind(source) != 'n', !p.r.Spec.TextPart(typ):
		p.r.Bounded = false
	}
}

// msgImageSource reports whether an image block's source is in the request (base64 data or a
// URL): such an image is bounded by the image rule; a file id is server-side.
func (p *reqParser) msgImageSource(v, path string) bool {
	if rawKind(v) != '{' {
		return false
	}
	typ := ""
	plain := p.members(v, msgSourceFields, allPlain, loc{field: path, i: -1}, func(i int, val string) {
		if msgSourceFields.names[i] == "type" {
			typ = rawString(val)
		}
	})
	return plain && (typ == "base64" || typ == "url")
}

// msgSafeBetas are the anthropic-beta flags that pass as they are: none changes what a token
// costs or adds a fee, and what they enable in the body (tools, documents, cache lifetimes,
// longer outputs within max_tokens) is checked there. Any other beta is a feature, refused
// unless Config.Allow names "beta:<name>": context-1m-… (long prompts billed at a premium rate),
// the betas of server tools, MCP, skills and files, and every beta not known here yet.
var msgSafeBetas = map[string]bool{
	"messages-2023-12-15":                    true,
	"tools-2024-04-04":                       true,
	"tools-2024-05-16":                       true,
	"prompt-caching-2024-07-31":              true,
	"extended-cache-ttl-2025-04-11":          true,
	"max-tokens-3-5-sonnet-2024-07-15":       true,
	"output-128k-2025-02-19":                 true,
	"token-efficient-tools-2025-02-19":       true,
	"fine-grained-tool-streaming-2025-05-14": true,
	"interleaved-thinking-2025-05-14":        true,
	"pdfs-2024-09-25":                        true,
	"token-counting-2024-11-01":              true,
	"computer-use-2024-10-22":                true,
	"computer-use-2025-01-24":                true,
}

// msgBetas reads the anthropic-beta headers of a priced request (on any path: a gateway behind
// an OpenAI-style route may pass them on to Anthropic) as the Messages API does:
// comma-separated names, spaces and quotes around each trimmed. Each beta outside msgSafeBetas
// becomes a feature of r (the body's anthropic_beta list is read alike, by parseMessages). A
// name that is not plain — letters, digits, '.', '_' and '-' — is refused: a ';' or a space
// inside one is a list another reader could split differently. The header is then rewritten as
// the names read (lower case, one comma-separated value), so the upstream gets exactly the
// betas checked here.
func msgBetas(h http.Header, r *Request) *Error {
	var betas []string
	for _, v := range h.Values("Anthropic-Beta") {
		bs, e := splitBetas(v, "anthropic-beta")
		if e != nil {
			return e
		}
		betas = append(betas, bs...)
	}
	if len(betas) == 0 {
		h.Del("Anthropic-Beta")
		return nil
	}
	for _, b := range betas {
		if !msgSafeBetas[b] {
			r.addFeature("beta:" + b)
		}
	}
	h.Set("Anthropic-Beta", strings.Join(slices.Compact(betas), ","))
	return nil
}

// splitBetas splits a list of betas (a header value, or one member of anthropic_beta) into
// their names, lower-cased; param names the list in a refusal.
func splitBetas(v, param string) ([]string, *Error) {
	var out []string
	for _, b := range strings.Split(v, ",") {
		b = strings.ToLower(strings.Trim(b, " \t\"'"))
		if b == "" {
			continue
		}
		for i := 0; i < len(b); i++ {
			if c := b[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
				return nil, errInvalid(param, fmt.Sprintf("%s: %q is not a beta name (names are separated by commas only)", param, b))
			}
		}
		out = append(out, b)
	}
	return out, nil
}

// msgBodyBetas reads the body's anthropic_beta (a list of betas, as some platforms take them)
// the same way as the header: each beta outside msgSafeBetas is a feature.
func (p *reqParser) msgBodyBetas(v string) {
	if !p.nullOr("anthropic_beta", v, shapeArray) {
		return
	}
	forEachRaw(v, func(_, b string) bool {
		if rawKind(b) != '"' {
			p.mustBe("anthropic_beta[]", shapeString)
			return false
		}
		bs, e := splitBetas(rawString(b), "anthropic_beta")
		if e != nil {
			p.fail = e
			return false
		}
		for _, name := range bs {
			if !msgSafeBetas[name] {
				p.r.addFeature("beta:" + name)
			}
		}
		return true
	})
}

// anthUsage is Anthropic's usage as read so far, each count with whether it was present.
// write5m and write1h are cache_creation's ephemeral_5m_input_tokens and
// ephemeral_1h_input_tokens: the cache writes (write) by lifetime.
type anthUsage struct {
	in, write, read, out, write5m, write1h                         int64
	haveIn, haveWrite, haveRead, haveOut, haveWrite5m, haveWrite1h bool
}

// anthUsageNames are the members anthropicUsageOf reads, in anthUsage's order; cache_creation is
// an object of anthCacheNames.
var (
	anthUsageNames = [...]string{"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens", "cache_creation"}
	anthCacheNames = [...]string{"ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"}
)

// anthropicUsageOf reads an Anthropic usage object (input_tokens — the uncached input only —
// cache_creation_input_tokens, cache_read_input_tokens, output_tokens, and cache_creation's
// ephemeral_5m_input_tokens and ephemeral_1h_input_tokens), matching member names as a
// client's decoder does (case folded, the last of duplicates wins). ok is false unless u is an
// object whose present counts are all valid (and cache_creation, when present, an object).
func anthropicUsageOf(u gjson.Result) (a anthUsage, ok bool) {
	if !u.IsObject() {
		return a, false
	}
	var f [len(anthUsageNames)]gjson.Result
	lastMembers(u, anthUsageNames[:], f[:])
	var cf [len(anthCacheNames)]gjson.Result
	if cc := f[len(f)-1]; present(cc) {
		if !cc.IsObject() {
			return anthUsage{}, false
		}
		lastMembers(cc, anthCacheNames[:], cf[:])
	}
	for _, c := range [...]struct {
		v    gjson.Result
		n    *int64
		have *bool
	}{{f[0], &a.in, &a.haveIn}, {f[1], &a.write, &a.haveWrite}, {f[2], &a.read, &a.haveRead}, {f[3], &a.out, &a.haveOut},
		{cf[0], &a.write5m, &a.haveWrite5m}, {cf[1], &a.write1h, &a.haveWrite1h}} {
		if !present(c.v) {
			continue
		}
		n, ok := tokenCount(c.v)
		if !ok {
			return anthUsage{}, false
		}
		*c.n, *c.have = n, true
	}
	return a, true
}

// merge takes the counts present in b over a's (message_delta's cumulative counts over
// message_start's).
func (a *anthUsage) merge(b anthUsage) {
	if b.haveIn {
		a.in, a.haveIn = b.in, true
	}
	if b.haveWrite {
		a.write, a.haveWrite = b.write, true
	}
	if b.haveRead {
		a.read, a.haveRead = b.read, true
	}
	if b.haveOut {
		a.out, a.haveOut = b.out, true
	}
	if b.haveWrite5m {
		a.write5m, a.haveWrite5m = b.write5m, true
	}
	if b.haveWrite1h {
		a.write1h, a.haveWrite1h = b.write1h, true
	}
}

// usage maps Anthropic's counts onto pricing.Usage (pricing.AnthropicCounts: the rule).
func (a anthUsage) usage() pricing.Usage {
	return pricing.AnthropicCounts{Input: a.in, CacheRead: a.read, CacheWrite: a.write, CacheWrite5m: a.write5m, CacheWrite1h: a.write1h, Output: a.out}.Usage()
}

// complete reports whether the counts bill a whole request: the input and the output.
func (a anthUsage) complete() bool { return a.haveIn && a.haveOut }
