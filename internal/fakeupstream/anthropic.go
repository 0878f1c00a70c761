package fakeupstream

import (
	"net/http"
	"regexp"
	"strconv"
	"time"
)

// The fake Anthropic Messages API: POST /v1/messages (JSON, or server-sent events with
// "stream": true) and POST /v1/messages/count_tokens.
//
//   - input tokens = the words of the system prompt (a string or text blocks) and of every
//     message (string content, or the "text" of every block), as for chat; markers are looked
//     for in the last user message. [cache_write:N] makes N of them 5-minute cache writes and
//     [cache_write_1h:N] N of the rest 1-hour cache writes (cache_creation_input_tokens counts
//     both; usage.cache_creation splits them into ephemeral_5m_input_tokens and
//     ephemeral_1h_input_tokens, as Anthropic does), and [cached:N] N of the rest cache reads
//     (cache_read_input_tokens); usage.input_tokens is what remains, as Anthropic counts it
//     (the uncached input only).
//   - output tokens = max_tokens (required: a 400 in Anthropic's shape without it), capped at
//     Options.MaxOutputTokens; the reply is that many words.
//   - [fail] answers 500 api_error; [slow] pauses Options.SlowDelay per output word;
//     [error_after:N] ends a stream after N words with an "error" event (overloaded_error), as
//     Anthropic does when it fails mid-stream: no message_delta, no message_stop.
//   - a stream sends message_start (message.usage with the input counts and output_tokens 1),
//     content_block_start, ping, one content_block_delta per word, content_block_stop,
//     message_delta (usage.output_tokens, the cumulative count) and message_stop.
//   - count_tokens answers {"input_tokens": N} with every input word counted.

// AnthropicUsage is the usage object of a Messages reply.
type AnthropicUsage struct {
	InputTokens              int                    `json:"input_tokens"`
	CacheCreationInputTokens int                    `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int                    `json:"cache_read_input_tokens"`
	OutputTokens             int                    `json:"output_tokens"`
	CacheCreation            AnthropicCacheCreation `json:"cache_creation"`
}

// AnthropicCacheCreation splits a reply's cache writes by the cache's lifetime.
type AnthropicCacheCreation struct {
	Ephemeral5mInputTokens int `json:"ephemeral_5m_input_tokens"`
	Ephemeral1hInputTokens int `json:"ephemeral_1h_input_tokens"`
}

type anthropicBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// AnthropicMessage is a Messages API reply.
type AnthropicMessage struct {
	ID           string           `json:"id"`
	Type         string           `json:"type"`
	Role         string           `json:"role"`
	Model        string           `json:"model"`
	Content      []anthropicBlock `json:"content"`
	StopReason   string           `json:"stop_reason"`
	StopSequence *string          `json:"stop_sequence"`
	Usage        AnthropicUsage   `json:"usage"`
}

var (
	cacheWriteMarker   = regexp.MustCompile(`\[cache_write:(\d+)\]`)
	cacheWrite1hMarker = regexp.MustCompile(`\[cache_write_1h:(\d+)\]`)
	errorAfterMarker   = regexp.MustCompile(`\[error_after:(\d+)\]`)
)

// writeAnthropicError writes Anthropic's error shape.
func writeAnthropicError(w http.ResponseWriter, status int, typ, msg string) {
	type inner struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	}
	writeJSON(w, status, struct {
		Type  string `json:"type"`
		Error inner  `json:"error"`
	}{"error", inner{typ, msg}})
}

// anthropicInput returns the words of the system prompt and the messages, and the text of the
// last user message.
func anthropicInput(req *apiRequest) (words int, lastUser string) {
	words, lastUser = chatInput(req)
	return words + countWords(contentText(req.System)), lastUser
}

func (s *Server) countTokens(w http.ResponseWriter, _ *http.Request, req *apiRequest) {
	words, _ := anthropicInput(req)
	writeJSON(w, http.StatusOK, map[string]int{"input_tokens": words})
}

func (s *Server) messages(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	if req.MaxTokens == nil {
		writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "max_tokens: Field required")
		return
	}
	if *req.MaxTokens < 1 {
		writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "max_tokens: Input should be greater than or equal to 1")
		return
	}
	words, last := anthropicInput(req)
	if s.opts.Worst {
		words = req.worst.input
	}
	p := s.newPlan(words, last, req.MaxTokens, nil, 0)
	if p.fail {
		writeAnthropicError(w, http.StatusInternalServerError, "api_error", "Internal server error")
		return
	}
	written, written1h := 0, 0
	if m := cacheWriteMarker.FindStringSubmatch(last); m != nil {
		v, _ := strconv.Atoi(m[1])
		written = min(v, p.promptTokens)
	}
	if m := cacheWrite1hMarker.FindStringSubmatch(last); m != nil {
		v, _ := strconv.Atoi(m[1])
		written1h = min(v, p.promptTokens-written)
	}
	read := min(p.cachedTokens, p.promptTokens-written-written1h)
	u := AnthropicUsage{InputTokens: p.promptTokens - written - written1h - read, CacheCreationInputTokens: written + written1h,
		CacheReadInputTokens: read, OutputTokens: p.completionTokens,
		CacheCreation: AnthropicCacheCreation{Ephemeral5mInputTokens: written, Ephemeral1hInputTokens: written1h}}
	out := outputWords(p.completionTokens)
	stop := "end_turn"
	if p.capped {
		stop = "max_tokens"
	}
	id := s.nextID("msg")
	if !req.Stream {
		if p.slow && !pause(r.Context(), time.Duration(p.completionTokens)*s.opts.SlowDelay) {
			return
		}
		writeJSON(w, http.StatusOK, AnthropicMessage{ID: id, Type: "message", Role: "assistant", Model: req.Model,
			Content: []anthropicBlock{{Type: "text", Text: joinWords(out)}}, StopReason: stop, Usage: u})
		return
	}
	e := startSSE(w)
	start := u
	start.OutputTokens = 1
	msg := AnthropicMessage{ID: id, Type: "message", Role: "assistant", Model: req.Model, Content: []anthropicBlock{}, Usage: start}
	type obj = map[string]any
	events := []struct {
		name string
		v    any
	}{
		{"message_start", obj{"type": "message_start", "message": msg}},
		{"content_block_start", obj{"type": "content_block_start", "index": 0, "content_block": anthropicBlock{Type: "text"}}},
		{"ping", obj{"type": "ping"}},
	}
	for _, ev := range events {
		if e.event(ev.name, ev.v) != nil {
			return
		}
	}
	errorAfter := -1
	if m := errorAfterMarker.FindStringSubmatch(last); m != nil {
		errorAfter, _ = strconv.Atoi(m[1])
	}
	for i, word := range out {
		if i == errorAfter {
			_ = e.event("error", obj{"type": "error", "error": obj{"type": "overloaded_error", "message": "Overloaded"}})
			return
		}
		if p.slow && !pause(r.Context(), s.opts.SlowDelay) {
			return
		}
		if e.event("content_block_delta", obj{"type": "content_block_delta", "index": 0,
			"delta": obj{"type": "text_delta", "text": word}}) != nil {
			return
		}
	}
	_ = e.event("content_block_stop", obj{"type": "content_block_stop", "index": 0})
	_ = e.event("message_delta", obj{"type": "message_delta", "delta": obj{"stop_reason": stop, "stop_sequence": nil},
		"usage": obj{"output_tokens": u.OutputTokens}})
	_ = e.event("message_stop", obj{"type": "message_stop"})
}
