package middleware

import (
	"net/http"
	"slices"
	"strings"

	"github.com/llmescrow/escrow/accounting"
	"github.com/tidwall/gjson"
)

// Anthropic's Messages API (issue 15): POST /v1/messages is priced like the OpenAI endpoints —
// the same hold rule, the same lenient reading of keys (fields.go), the same refusal of what
// the price table cannot price — with Anthropic's own fields, usage and error shape.
// POST /v1/messages/count_tokens costs nothing upstream: it is authenticated and passed on
// without a hold.
const (
	EndpointMessages    = "/v1/messages"
	EndpointCountTokens = "/v1/messages/count_tokens"
)

// isAnthropic reports whether a path is answered in Anthropic's shape.
func isAnthropic(path string) bool { return path == EndpointMessages || path == EndpointCountTokens }

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
		"stop_sequences", "metadata", "thinking", "service_tier", "cache_control",
	}
	// msgTopOther: fields escrow reads or knows to change the price or the input beyond the
	// body's bytes (tools bring Anthropic's tool-use system prompt with them).
	msgTopOther = []string{
		"tools", "tool_choice", "mcp_servers", "container", "context_management", "inference_geo", "speed",
	}
	msgTopFields     = newFieldSet(append(slices.Clip(msgTopPlain), msgTopOther...)...)
	msgTopPlainMask  = msgTopFields.mask(msgTopPlain...)
	msgToolFields    = newFieldSet("type", "name", "description", "input_schema", "cache_control")
	msgChoiceFields  = newFieldSet("type", "name", "disable_parallel_tool_use")
	msgMessageFields = newFieldSet("role", "content")
	msgBlockFields   = newFieldSet("type", "text", "cache_control", "source", "id", "name", "input", "tool_use_id",
		"content", "is_error", "thinking", "signature", "data", "citations")
	msgCacheFields = newFieldSet("type", "ttl")
)

// msgPlainBlocks are the content block types whose tokens the body's bytes bound.
var msgPlainBlocks = map[string]bool{
	"text": true, "tool_use": true, "tool_result": true, "thinking": true, "redacted_thinking": true,
}

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
func parseMessages(body []byte) (Request, *Error) {
	r := Request{Endpoint: EndpointMessages, N: 1, PlainText: true, Size: len(body)}
	if e := checkJSONObject(body); e != nil {
		return r, e
	}
	p := reqParser{r: r}
	haveCap := false
	forEachRaw(bstr(body), func(key, v string) bool {
		if p.msgTop(key, v) {
			haveCap = true
		}
		return p.fail == nil
	})
	switch {
	case p.fail != nil:
		return p.r, p.fail
	case p.r.Model == "":
		return p.r, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: "model", Code: CodeMissingField,
			Message: "model: Field required"}
	case !haveCap:
		return p.r, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: "max_tokens", Code: CodeMissingField,
			Message: "max_tokens: Field required"}
	}
	return p.r, nil
}

// msgTop reads one top-level member of a Messages body; it reports whether it was max_tokens.
func (p *reqParser) msgTop(key, v string) (outputCap bool) {
	r := &p.r
	kind := rawKind(v)
	i, kc := msgTopFields.check(key, &p.seen)
	switch kc {
	case keyUnknown:
		if kind != 'n' {
			r.PlainText = false
		}
		return false
	case keyVariant, keyDuplicate:
		p.fail = keyError("", key, msgTopFields.names[i], kc)
		return false
	}
	if msgTopPlainMask&(1<<i) == 0 && kind != 'n' {
		r.PlainText = false
	}
	switch name := msgTopFields.names[i]; name {
	case "model":
		if m := rawString(v); kind == '"' && m != "" {
			r.Model = strings.Clone(m)
		} else {
			p.fail = errInvalid("model", "model: Input should be a non-empty string")
		}
	case "stream":
		b, ok := rawBool(v)
		if !ok {
			p.fail = errInvalid("stream", "stream: Input should be a valid boolean")
		}
		r.Stream = b
	case "max_tokens":
		n, ok := rawPositiveInt(v)
		if !ok {
			p.fail = errInvalid("max_tokens", "max_tokens: Input should be a positive integer")
			return false
		}
		r.OutputCap = n
		return true
	case "tools":
		p.msgTools(v)
	case "tool_choice":
		if kind == '{' {
			p.msgObject(v, msgChoiceFields, "tool_choice")
		}
	case "mcp_servers":
		if kind != 'n' && v != "[]" {
			r.addFeature("mcp_servers")
		}
	case "container":
		if kind != 'n' {
			r.addFeature("container")
		}
	case "inference_geo":
		if s := rawString(v); kind != 'n' && s != "global" {
			r.addFeature("inference_geo:" + s)
		}
	case "speed":
		if s := rawString(v); kind != 'n' && s != "standard" {
			r.addFeature("speed:" + s)
		}
	case "service_tier":
		if s := rawString(v); kind != 'n' && s != "auto" && s != "standard_only" {
			r.addFeature("service_tier:" + s)
		}
	case "cache_control":
		p.msgCache(v, "cache_control")
	case "system":
		if kind == '[' {
			p.msgBlocks(v, "system")
		} else if kind != '"' && kind != 'n' {
			r.PlainText = false
		}
	case "messages":
		if kind != '[' {
			p.fail = errInvalid("messages", "messages: Input should be a valid list")
			return false
		}
		j := 0
		forEachRaw(v, func(_, m string) bool {
			p.msgMessage(m, at("messages", j))
			j++
			return p.fail == nil
		})
	}
	return false
}

// msgObject checks the spelling of an object's known keys and returns its "type" ("" if none).
func (p *reqParser) msgObject(raw string, set *fieldSet, path string) (typ string) {
	var seen uint64
	forEachRaw(raw, func(key, v string) bool {
		i, kc := set.check(key, &seen)
		switch kc {
		case keyUnknown:
			return true
		case keyVariant, keyDuplicate:
			p.fail = keyError(path, key, set.names[i], kc)
			return false
		}
		switch set.names[i] {
		case "type":
			if rawKind(v) != '"' {
				p.fail = errInvalid(path+".type", path+".type: Input should be a valid string")
				return false
			}
			typ = rawString(v)
		case "cache_control":
			p.msgCache(v, path+".cache_control")
		}
		return p.fail == nil
	})
	return typ
}

func (p *reqParser) msgTools(v string) {
	switch rawKind(v) {
	case 'n':
		return
	case '[':
	default:
		p.fail = errInvalid("tools", "tools: Input should be a valid list")
		return
	}
	j := 0
	forEachRaw(v, func(_, t string) bool {
		path := at("tools", j)
		j++
		if rawKind(t) != '{' {
			p.fail = errInvalid(path, path+": Input should be a valid dictionary")
			return false
		}
		typ := p.msgObject(t, msgToolFields, path)
		if p.fail == nil && !msgClientTools(typ) {
			p.r.addFeature("tool:" + typ)
		}
		return p.fail == nil
	})
}

// msgCache checks a cache_control object: only the 5-minute cache is priced
// (Prices.CacheWriteInput); another ttl is a feature the price table cannot price.
func (p *reqParser) msgCache(v, path string) {
	if rawKind(v) != '{' {
		return
	}
	var seen uint64
	forEachRaw(v, func(key, val string) bool {
		i, kc := msgCacheFields.check(key, &seen)
		switch kc {
		case keyUnknown:
			return true
		case keyVariant, keyDuplicate:
			p.fail = keyError(path, key, msgCacheFields.names[i], kc)
			return false
		}
		if msgCacheFields.names[i] == "ttl" && rawKind(val) != 'n' {
			if ttl := rawString(val); ttl != "5m" {
				p.r.addFeature("cache_ttl:" + ttl)
			}
		}
		return true
	})
}

func (p *reqParser) msgMessage(raw, path string) {
	if rawKind(raw) != '{' {
		p.fail = errInvalid(path, path+": Input should be a valid dictionary")
		return
	}
	var seen uint64
	forEachRaw(raw, func(key, v string) bool {
		kind := rawKind(v)
		i, kc := msgMessageFields.check(key, &seen)
		switch kc {
		case keyUnknown:
			if kind != 'n' {
				p.r.PlainText = false
			}
			return true
		case keyVariant, keyDuplicate:
			p.fail = keyError(path, key, msgMessageFields.names[i], kc)
			return false
		}
		if msgMessageFields.names[i] == "content" {
			switch kind {
			case '"':
			case '[':
				p.msgBlocks(v, path+".content")
			default:
				p.r.PlainText = false
			}
		}
		return p.fail == nil
	})
}

// msgBlocks checks an array of content blocks (of a message, of system, of a tool_result).
func (p *reqParser) msgBlocks(v, path string) {
	j := 0
	forEachRaw(v, func(_, b string) bool {
		bp := at(path, j)
		j++
		if rawKind(b) != '{' {
			p.r.PlainText = false
			return true
		}
		typ := ""
		var seen uint64
		forEachRaw(b, func(key, val string) bool {
			kind := rawKind(val)
			i, kc := msgBlockFields.check(key, &seen)
			switch kc {
			case keyUnknown:
				return true
			case keyVariant, keyDuplicate:
				p.fail = keyError(bp, key, msgBlockFields.names[i], kc)
				return false
			}
			switch msgBlockFields.names[i] {
			case "type":
				typ = rawString(val)
			case "cache_control":
				p.msgCache(val, bp+".cache_control")
			case "content": // a tool_result's content: a string or blocks
				if kind == '[' {
					p.msgBlocks(val, bp+".content")
				}
			case "source", "citations":
				if kind != 'n' {
					p.r.PlainText = false
				}
			}
			return p.fail == nil
		})
		if !msgPlainBlocks[typ] {
			p.r.PlainText = false
		}
		return p.fail == nil
	})
}

// msgBetaFeatures adds the anthropic-beta flags that change the price without showing in the
// body: the 1M-token context window (context-1m-…) bills long prompts at a premium rate. The
// betas that enable priced features in the body (server tools, the 1-hour cache, MCP) are
// caught by those features.
func msgBetaFeatures(h http.Header, r *Request) {
	for _, v := range h.Values("Anthropic-Beta") {
		for _, b := range strings.Split(v, ",") {
			if b = strings.TrimSpace(b); strings.HasPrefix(strings.ToLower(b), "context-1m") {
				r.addFeature("beta:" + b)
			}
		}
	}
}

// anthUsage is Anthropic's usage as read so far, each count with whether it was present.
type anthUsage struct {
	in, write, read, out                 int64
	haveIn, haveWrite, haveRead, haveOut bool
}

// anthropicUsageOf reads an Anthropic usage object (input_tokens — the uncached input only —
// cache_creation_input_tokens, cache_read_input_tokens, output_tokens), matching member names
// as a client's decoder does (case folded, the last of duplicates wins). ok is false unless u
// is an object whose present counts are all valid.
func anthropicUsageOf(u gjson.Result) (a anthUsage, ok bool) {
	if !u.IsObject() {
		return a, false
	}
	var in, write, read, out gjson.Result
	u.ForEach(func(k, v gjson.Result) bool {
		switch name := k.String(); {
		case strings.EqualFold(name, "input_tokens"):
			in = v
		case strings.EqualFold(name, "cache_creation_input_tokens"):
			write = v
		case strings.EqualFold(name, "cache_read_input_tokens"):
			read = v
		case strings.EqualFold(name, "output_tokens"):
			out = v
		}
		return true
	})
	for _, f := range []struct {
		v    gjson.Result
		n    *int64
		have *bool
	}{{in, &a.in, &a.haveIn}, {write, &a.write, &a.haveWrite}, {read, &a.read, &a.haveRead}, {out, &a.out, &a.haveOut}} {
		if !present(f.v) {
			continue
		}
		n, ok := tokenCount(f.v)
		if !ok {
			return anthUsage{}, false
		}
		*f.n, *f.have = n, true
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
}

// usage maps Anthropic's counts onto accounting.Usage (see its comment): Prompt is every input
// token, cached and written ones included.
func (a anthUsage) usage() accounting.Usage {
	return accounting.Usage{Prompt: a.in + a.write + a.read, Cached: a.read, CacheWrite: a.write, Completion: a.out}
}

// complete reports whether the counts bill a whole request: the input and the output.
func (a anthUsage) complete() bool { return a.haveIn && a.haveOut }
