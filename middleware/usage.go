package middleware

import (
	"strconv"

	"github.com/llmescrow/escrow/accounting"
	"github.com/tidwall/gjson"
)

// maxTokens bounds a believable token count; larger (or negative, fractional, non-numeric)
// counts are not usage.
const maxTokens = 1_000_000_000_000

// usageOf reads an OpenAI usage object: chat/completions and embeddings (prompt_tokens,
// completion_tokens, *_details) or the Responses API (input_tokens, output_tokens, *_details).
// ok is false unless u is an object with a valid input token count: usage that is not there is
// never invented. A missing output count is 0 (embeddings have none).
func usageOf(u gjson.Result) (accounting.Usage, bool) {
	if !u.IsObject() {
		return accounting.Usage{}, false
	}
	var out accounting.Usage
	var ok bool
	if out.Prompt, ok = firstCount(u, "prompt_tokens", "input_tokens"); !ok {
		return accounting.Usage{}, false
	}
	if out.Completion, ok = optCount(u, "completion_tokens", "output_tokens"); !ok {
		return accounting.Usage{}, false
	}
	if out.Cached, ok = optCount(u, "prompt_tokens_details.cached_tokens", "input_tokens_details.cached_tokens"); !ok {
		return accounting.Usage{}, false
	}
	if out.Reasoning, ok = optCount(u, "completion_tokens_details.reasoning_tokens", "output_tokens_details.reasoning_tokens"); !ok {
		return accounting.Usage{}, false
	}
	return out, true
}

// firstCount returns the first of paths that exists; it must be a valid count.
func firstCount(u gjson.Result, a, b string) (int64, bool) {
	v := u.Get(a)
	if !v.Exists() || v.Type == gjson.Null {
		v = u.Get(b)
	}
	return tokenCount(v)
}

// optCount is firstCount where absence (or null) means 0.
func optCount(u gjson.Result, a, b string) (int64, bool) {
	v := u.Get(a)
	if !v.Exists() || v.Type == gjson.Null {
		v = u.Get(b)
	}
	if !v.Exists() || v.Type == gjson.Null {
		return 0, true
	}
	return tokenCount(v)
}

func tokenCount(v gjson.Result) (int64, bool) {
	if v.Type != gjson.Number {
		return 0, false
	}
	n, err := strconv.ParseInt(v.Raw, 10, 64)
	if err != nil || n < 0 || n > maxTokens {
		return 0, false
	}
	return n, true
}

// usageFromBody reads the top-level usage of a JSON response body.
func usageFromBody(body []byte) (accounting.Usage, bool) {
	if !gjson.ValidBytes(body) {
		return accounting.Usage{}, false
	}
	return usageOf(gjson.GetBytes(body, "usage"))
}

// outputBytesOfBody counts the generated text of a JSON response without usage, for estimates.
func outputBytesOfBody(body []byte) int64 {
	if !gjson.ValidBytes(body) {
		return 0
	}
	var n int64
	for _, p := range []string{"choices.#.message.content", "choices.#.text", "choices.#.message.tool_calls.#.function.arguments", "output.#.content.#.text"} {
		gjson.GetBytes(body, p).ForEach(func(_, v gjson.Result) bool {
			n += textLen(v)
			return true
		})
	}
	return n
}

// textLen is the length of a string, or of the strings nested in an array.
func textLen(v gjson.Result) int64 {
	if v.Type == gjson.String {
		return int64(len(v.Str))
	}
	var n int64
	if v.IsArray() {
		v.ForEach(func(_, e gjson.Result) bool {
			n += textLen(e)
			return true
		})
	}
	return n
}
