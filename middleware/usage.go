package middleware

import (
	"strconv"
	"strings"

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
//
// Member names are matched as a client's decoder matches them (case folded, escapes decoded,
// the last of duplicates wins), so the counts billed are the counts the client reads.
func usageOf(u gjson.Result) (accounting.Usage, bool) {
	if !u.IsObject() {
		return accounting.Usage{}, false
	}
	var f usageFields
	u.ForEach(func(k, v gjson.Result) bool {
		switch name := k.String(); {
		case strings.EqualFold(name, "prompt_tokens"):
			f.prompt = v
		case strings.EqualFold(name, "input_tokens"):
			f.input = v
		case strings.EqualFold(name, "completion_tokens"):
			f.completion = v
		case strings.EqualFold(name, "output_tokens"):
			f.output = v
		case strings.EqualFold(name, "prompt_tokens_details"):
			f.promptDetails = v
		case strings.EqualFold(name, "input_tokens_details"):
			f.inputDetails = v
		case strings.EqualFold(name, "completion_tokens_details"):
			f.completionDetails = v
		case strings.EqualFold(name, "output_tokens_details"):
			f.outputDetails = v
		}
		return true
	})
	var out accounting.Usage
	var ok bool
	if out.Prompt, ok = tokenCount(either(f.prompt, f.input)); !ok {
		return accounting.Usage{}, false
	}
	if out.Completion, ok = optCount(either(f.completion, f.output)); !ok {
		return accounting.Usage{}, false
	}
	if out.Cached, ok = optCount(either(member(f.promptDetails, "cached_tokens"), member(f.inputDetails, "cached_tokens"))); !ok {
		return accounting.Usage{}, false
	}
	if out.Reasoning, ok = optCount(either(member(f.completionDetails, "reasoning_tokens"), member(f.outputDetails, "reasoning_tokens"))); !ok {
		return accounting.Usage{}, false
	}
	return out, true
}

type usageFields struct {
	prompt, input, completion, output                             gjson.Result
	promptDetails, inputDetails, completionDetails, outputDetails gjson.Result
}

// present reports whether v exists and is not null.
func present(v gjson.Result) bool { return v.Exists() && v.Type != gjson.Null }

// either is a when present, else b.
func either(a, b gjson.Result) gjson.Result {
	if present(a) {
		return a
	}
	return b
}

// member is the last member of object o named name (case folded); nothing when o is no object.
func member(o gjson.Result, name string) gjson.Result {
	var out gjson.Result
	if !o.IsObject() {
		return out
	}
	o.ForEach(func(k, v gjson.Result) bool {
		if strings.EqualFold(k.String(), name) {
			out = v
		}
		return true
	})
	return out
}

// optCount is tokenCount where absence (or null) means 0.
func optCount(v gjson.Result) (int64, bool) {
	if !present(v) {
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

// usageFromBody reads the top-level usage of a whole JSON response body, with the same
// scanner that reads bodies as they stream.
func usageFromBody(body []byte) (accounting.Usage, bool) {
	var s usageScanner
	s.Write(body)
	s.finish()
	if !s.complete() {
		return accounting.Usage{}, false
	}
	return s.usage()
}
