package fakeupstream

import (
	"cmp"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
)

// apiRequest holds the request fields the fake reads, for every endpoint.
type apiRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	Messages []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	} `json:"messages"`
	System              json.RawMessage `json:"system"` // Anthropic Messages
	Prompt              json.RawMessage `json:"prompt"`
	Input               json.RawMessage `json:"input"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	MaxOutputTokens     *int64          `json:"max_output_tokens"`
	N                   *int64          `json:"n"`
	BestOf              *int64          `json:"best_of"`
	Dimensions          int             `json:"dimensions"`
	EncodingFormat      string          `json:"encoding_format"`
	Logprobs            json.RawMessage `json:"logprobs"`       // chat: true; completions: an integer (ignored)
	TopLogprobs         *int            `json:"top_logprobs"`   // alternatives per token, 0–20
	Include             []string        `json:"include"`        // responses: "message.output_text.logprobs"
	Size                string          `json:"size"`           // images
	Quality             string          `json:"quality"`        // images
	Voice               string          `json:"voice"`          // speech
	PartialImages       int64           `json:"partial_images"` // images: partial images of a stream
	Background          json.RawMessage `json:"background"`     // responses: true runs it in the background (background.go); images: "transparent" and the like

	worst worstRead // what Options.Worst bills (worst.go)
	files int       // multipart: the file parts (media.go)
	audio []byte    // multipart: the first file named "file"
}

// maxTopLogprobs bounds top_logprobs, as OpenAI does.
const maxTopLogprobs = 20

// chatLogprobs is how many alternatives each output token's logprobs carry; -1: no logprobs.
func (r *apiRequest) chatLogprobs() int {
	if string(r.Logprobs) != "true" {
		return -1
	}
	return r.topLogprobs()
}

// responsesLogprobs is chatLogprobs for the Responses API.
func (r *apiRequest) responsesLogprobs() int {
	for _, inc := range r.Include {
		if inc == "message.output_text.logprobs" {
			return r.topLogprobs()
		}
	}
	return -1
}

func (r *apiRequest) topLogprobs() int {
	if r.TopLogprobs == nil {
		return 0
	}
	return min(max(*r.TopLogprobs, 0), maxTopLogprobs)
}

// plan is what the fake will answer: token counts and behaviour markers.
type plan struct {
	promptTokens     int
	completionTokens int // per choice
	choices          int
	cachedTokens     int
	reasoningTokens  int
	audioIn          int // of promptTokens ([audio_in:N])
	audioOut         int // of the completion tokens ([audio_out:N])
	fail, slow, hang bool
	incomplete       bool
	capped           bool   // the request set an output cap (finish_reason "length")
	encoding         string // [encoding:NAME]: the reply's Content-Encoding
}

var (
	cachedMarker    = regexp.MustCompile(`\[cached:(\d+)\]`)
	reasoningMarker = regexp.MustCompile(`\[reasoning:(\d+)\]`)
	audioInMarker   = regexp.MustCompile(`\[audio_in:(\d+)\]`)
	audioOutMarker  = regexp.MustCompile(`\[audio_out:(\d+)\]`)
	stopMarker      = regexp.MustCompile(`\[stop:(\d+)\]`)
	encodingMarker  = regexp.MustCompile(`\[encoding:([A-Za-z0-9_-]+)\]`)
)

// newPlan computes the answer's plan from the words counted, the text in which markers are
// looked for, and the output cap the request set (nil: none).
func (s *Server) newPlan(words int, markerText string, outCap *int64, n *int64, defaultCap int) plan {
	p := plan{
		promptTokens: words,
		choices:      1,
		fail:         strings.Contains(markerText, "[fail]"),
		slow:         strings.Contains(markerText, "[slow]"),
		hang:         strings.Contains(markerText, "[hang]"),
		incomplete:   strings.Contains(markerText, "[incomplete]"),
	}
	// The answer's own length (the model stops there), then cut to the cap when that is lower.
	natural := s.opts.DefaultCompletionTokens
	switch m := stopMarker.FindStringSubmatch(markerText); {
	case m != nil:
		natural, _ = strconv.Atoi(m[1])
	case s.opts.Worst || strings.Contains(markerText, "[fill]"):
		natural = cmp.Or(defaultCap, s.opts.MaxOutputTokens) // its full default
		if outCap != nil && *outCap > 0 {
			natural = int(min(*outCap, 1<<40)) // fills whatever cap it gets
		}
	}
	p.completionTokens = min(natural, s.opts.MaxOutputTokens)
	if outCap != nil && *outCap > 0 && int64(natural) >= *outCap {
		p.completionTokens = int(min(*outCap, int64(s.opts.MaxOutputTokens)))
		p.capped = true
	}
	if n != nil && *n > 1 {
		p.choices = int(*n)
	}
	if m := encodingMarker.FindStringSubmatch(markerText); m != nil {
		p.encoding = m[1]
	}
	if m := cachedMarker.FindStringSubmatch(markerText); m != nil {
		v, _ := strconv.Atoi(m[1])
		p.cachedTokens = min(v, p.promptTokens)
	}
	if m := reasoningMarker.FindStringSubmatch(markerText); m != nil {
		v, _ := strconv.Atoi(m[1])
		p.reasoningTokens = min(v, p.completionTokens*p.choices)
	}
	if m := audioInMarker.FindStringSubmatch(markerText); m != nil {
		v, _ := strconv.Atoi(m[1])
		p.audioIn = min(v, p.promptTokens-p.cachedTokens)
	}
	if m := audioOutMarker.FindStringSubmatch(markerText); m != nil {
		v, _ := strconv.Atoi(m[1])
		p.audioOut = min(v, p.completionTokens*p.choices-p.reasoningTokens)
	}
	return p
}

// totalCompletion is the completion tokens of all choices.
func (p plan) totalCompletion() int { return p.completionTokens * p.choices }

// countWords is the number of whitespace-separated words in s.
func countWords(s string) int { return len(strings.Fields(s)) }

// contentText returns the text of a message content: a string, or the "text" of every part of
// an array (text, input_text, output_text parts); other parts (images, audio, files) add
// nothing.
func contentText(raw json.RawMessage) string {
	if len(raw) == 0 {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Text *string `json:"text"`
	}
	if json.Unmarshal(raw, &parts) != nil {
		return ""
	}
	var b strings.Builder
	for _, p := range parts {
		if p.Text != nil {
			b.WriteString(*p.Text)
			b.WriteByte(' ')
		}
	}
	return b.String()
}

// promptInput returns the word count and the last element's text of a completions prompt or
// an embeddings input: a string, an array of strings, a token array (each token counts) or an
// array of token arrays. ok is false for any other shape.
func promptInput(raw json.RawMessage) (words int, last string, ok bool) {
	if len(raw) == 0 || string(raw) == "null" {
		return 0, "", false
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return countWords(s), s, true
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil {
		for _, x := range ss {
			words += countWords(x)
		}
		if len(ss) > 0 {
			last = ss[len(ss)-1]
		}
		return words, last, true
	}
	var toks []int64
	if json.Unmarshal(raw, &toks) == nil {
		return len(toks), "", true
	}
	var toks2 [][]int64
	if json.Unmarshal(raw, &toks2) == nil {
		for _, t := range toks2 {
			words += len(t)
		}
		return words, "", true
	}
	return 0, "", false
}

// responsesInput returns the word count and the last user text of a Responses API input: a
// string, or an array of items whose content is a string or an array of parts.
func responsesInput(raw json.RawMessage) (words int, lastUser string, ok bool) {
	if len(raw) == 0 || string(raw) == "null" {
		return 0, "", false
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return countWords(s), s, true
	}
	var items []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &items) != nil {
		return 0, "", false
	}
	for _, it := range items {
		t := contentText(it.Content)
		words += countWords(t)
		if it.Role == "user" || it.Role == "" {
			lastUser = t
		}
	}
	return words, lastUser, true
}

// chatInput returns the word count of every message and the text of the last user message.
func chatInput(req *apiRequest) (words int, lastUser string) {
	for _, m := range req.Messages {
		t := contentText(m.Content)
		words += countWords(t)
		if m.Role == "user" {
			lastUser = t
		}
	}
	return words, lastUser
}
