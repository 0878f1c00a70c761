package middleware

import (
	"strconv"
	"strings"

	"github.com/llmescrow/escrow/pricing"
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
func usageOf(u gjson.Result) (pricing.Usage, bool) {
	if !u.IsObject() {
		return pricing.Usage{}, false
	}
	var f [len(usageNames)]gjson.Result
	lastMembers(u, usageNames[:], f[:])
	var c counts
	out := pricing.OpenAICounts{
		Prompt:     c.required(either(f[0], f[1])),
		Completion: c.optional(either(f[2], f[3])),
		Cached:     c.optional(either(member(f[4], "cached_tokens"), member(f[5], "cached_tokens"))),
		AudioIn:    c.optional(either(member(f[4], "audio_tokens"), member(f[5], "audio_tokens"))),
		Reasoning:  c.optional(either(member(f[6], "reasoning_tokens"), member(f[7], "reasoning_tokens"))),
		AudioOut:   c.optional(either(member(f[6], "audio_tokens"), member(f[7], "audio_tokens"))),
	}
	if c.bad {
		return pricing.Usage{}, false
	}
	return out.Usage(), true
}

// usageNames are the members usageOf reads, each under its chat/completions name and then its
// Responses API name.
var usageNames = [...]string{
	"prompt_tokens", "input_tokens",
	"completion_tokens", "output_tokens",
	"prompt_tokens_details", "input_tokens_details",
	"completion_tokens_details", "output_tokens_details",
}

// counts reads the token counts of one usage object; bad is set once one is not valid.
type counts struct{ bad bool }

// required is the count v, which must be there.
func (c *counts) required(v gjson.Result) int64 {
	n, ok := tokenCount(v)
	c.bad = c.bad || !ok
	return n
}

// optional is the count v, 0 when absent or null.
func (c *counts) optional(v gjson.Result) int64 {
	if !present(v) {
		return 0
	}
	return c.required(v)
}

// lastMembers sets out[k] to the last member of the object u whose name matches names[k] as a
// client's decoder matches it (case folded); out[k] is left alone when there is none.
func lastMembers(u gjson.Result, names []string, out []gjson.Result) {
	if !u.IsObject() {
		return
	}
	u.ForEach(func(k, v gjson.Result) bool {
		name := k.String()
		for j, n := range names {
			if strings.EqualFold(name, n) {
				out[j] = v
				break
			}
		}
		return true
	})
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
	var out [1]gjson.Result
	lastMembers(o, []string{name}, out[:])
	return out[0]
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
func usageFromBody(body []byte) (pricing.Usage, bool) {
	var s usageScanner
	s.Write(body)
	s.finish()
	if !s.complete() {
		return pricing.Usage{}, false
	}
	return s.usage()
}
