// Package fakeupstream is an OpenAI-compatible fake LLM: an http.Handler that answers
// POST /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/responses, as JSON or as
// server-sent events (stream: true), with token usage that a test can predict exactly; and a
// fake of Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens (rules in
// anthropic.go); and the Files and Batch APIs of both (/v1/files, /v1/batches,
// /v1/messages/batches: batches.go), whose lines run through the same handlers. The
// tests use it, and the runnable proxy uses it as its built-in upstream.
//
// # Usage rules
//
//   - prompt tokens (input_tokens) = the number of whitespace-separated words in the input: the
//     text of every message (string content, or the "text" of every text part) for chat; the
//     prompt (a string, or every string of an array; a token array counts its tokens) for
//     completions; the input (the same shapes) for embeddings; for responses, the input string
//     or the text of every input item's content. Markers such as [slow] are words too.
//   - completion tokens (output_tokens): the answer is 20 words long (Options.
//     DefaultCompletionTokens; [stop:N] makes it N; [fill] makes it fill its cap), cut to the
//     cap the endpoint reads when that is lower — max_tokens, max_completion_tokens (chat, which
//     wins over max_tokens) or max_output_tokens (responses); cap fields of other endpoints are
//     ignored — and to Options.MaxOutputTokens. A model stops on its own: escrow writes the cap
//     it held into every body, and a cap above the answer does not lengthen it. With n > 1
//     (chat, completions) every choice gets that many and the usage counts them all.
//     Embeddings have none. Options.Worst bills the most instead (worst.go).
//   - the reply is that many words, "tok1 tok2 …"; a stream sends one word per chunk.
//
// # Markers
//
// Markers are looked for in the last user message (chat), the last prompt (completions), the
// last input (embeddings) or the last user input item (responses):
//
//	[fail]         HTTP 500 with an OpenAI error body
//	[slow]         a stream sends one chunk every Options.SlowDelay (200 ms); a JSON reply
//	               waits SlowDelay per output word
//	[hang]         headers and one chunk are sent, then the handler blocks until the request's
//	               context ends
//	[cached:N]     N of the prompt tokens are cached (at most all of them)
//	[reasoning:N]  N of the completion tokens are reasoning tokens (at most all of them)
//	[audio_in:N]   chat: N of the uncached prompt tokens are audio tokens
//	               (prompt_tokens_details.audio_tokens); [audio_out:N] N of the completion
//	               tokens that are not reasoning are audio (completion_tokens_details.audio_tokens)
//	[stop:N]       the reply stops after N words when its cap allows more (finish_reason
//	               "stop"), as a model that is done before its cap
//	[fill]         the reply fills its cap (finish_reason "length"); without one, the
//	               upstream's default (MaxOutputTokens; legacy completions 16)
//	[incomplete]   responses only: status "incomplete" (reason max_output_tokens), and a
//	               stream ends with response.incomplete instead of response.completed
//	[encoding:X]   the reply (JSON or stream) is compressed with X — gzip, deflate (zlib) or br —
//	               whatever Accept-Encoding asked, as an upstream that ignores it; any other X
//	               is only announced in Content-Encoding over the plain bytes
//
// # Logprobs
//
// Chat requests with "logprobs": true get, per choice (and per stream chunk), one logprobs entry
// per output word with "top_logprobs" alternatives (at most 20); Responses requests that include
// "message.output_text.logprobs" get them on their output_text. With n and a large output cap
// this makes the very large replies (n: 64 × 16,384 tokens is 8.7 MB) that billing must read.
//
// # Streams
//
// Chat and completions streams end with "data: [DONE]". When stream_options.include_usage is
// true, every chunk carries "usage": null and a last chunk with "choices": [] carries the usage,
// as OpenAI does; otherwise no chunk has a usage field. Responses streams send typed events
// (response.created, response.in_progress, response.output_item.added,
// response.content_part.added, response.output_text.delta per word, response.output_text.done,
// response.content_part.done, response.output_item.done, then response.completed — or
// response.incomplete — whose response.usage has input_tokens, output_tokens, total_tokens,
// input_tokens_details.cached_tokens and output_tokens_details.reasoning_tokens) and no [DONE].
package fakeupstream

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Options configures a Server. The zero value gives the documented defaults.
type Options struct {
	// SlowDelay is the pause per chunk (stream) or per output word (JSON) of a [slow] request.
	// Default 200 ms.
	SlowDelay time.Duration
	// DefaultCompletionTokens is the length of an answer (completion tokens per choice) when
	// its cap is not lower. Default 20.
	DefaultCompletionTokens int
	// MaxOutputTokens caps the completion tokens of one choice, whatever the request asks.
	// Default 65536.
	MaxOutputTokens int
	// MaxBodyBytes limits the request body; a larger one gets 413. Default 8 MiB.
	MaxBodyBytes int64
	// APIKey, when set, is required as "Authorization: Bearer <APIKey>" or "x-api-key:
	// <APIKey>"; other requests get 401 invalid_api_key. Default: any key, or none, is accepted.
	APIKey string
	// OnRequest, when set, is called for every request, after its body has been read and
	// before it is answered, from the request's goroutine. Its Body is a copy it may keep.
	OnRequest func(Request)
	// Worst makes the fake bill the most an upstream that reads the body as it is may bill
	// (worst.go): every reply fills its cap, a request without one gets the upstream's full
	// default (MaxOutputTokens; legacy completions 16), and the input is every byte of the
	// fields read as input plus each image's most under the provider's rule and the tool
	// preamble. Cap fields of other endpoints are ignored, as vLLM, Ollama and most
	// OpenAI-compatible servers ignore unknown fields.
	Worst bool
	// KeepRequests is how many of the latest requests Seen and LastRequest remember; each
	// remembered Body is cut to its first 64 KiB (so at most KeepRequests × 64 KiB is held).
	// Default 1000; negative: none (for long-running use, e.g. the proxy's built-in upstream).
	KeepRequests int
	// BatchLineDelay is the pause before each line of a batch runs (batches.go). Default 5 ms.
	BatchLineDelay time.Duration
	// BackgroundDelay is how long a background response runs (queued for the first half,
	// in progress for the second) before it ends (background.go). Default 300 ms.
	BackgroundDelay time.Duration
	// BackgroundKeep is how long an ended background response is kept before it is gone
	// (404). Default 10 minutes.
	BackgroundKeep time.Duration
}

// Request is what the server saw of one request.
type Request struct {
	Method        string
	Path          string
	Query         string      // the raw query string as received
	Authorization string      // the Authorization header as received
	Header        http.Header // every header as received (a copy)
	Model         string      // the body's "model", "" when absent or unparsable
	Stream        bool
	IncludeUsage  bool   // stream_options.include_usage
	Body          []byte // the raw body (a copy; in Seen and LastRequest, its first 64 KiB)
	Time          time.Time
}

// Server is the fake upstream. It is safe for concurrent use.
type Server struct {
	opts     Options
	requests atomic.Int64
	ids      atomic.Int64

	mu   sync.Mutex
	seen []Request

	batchOnce sync.Once
	batch     *batchState            // files and batches (batches.go)
	bg        map[string]*bgResponse // background responses by id (background.go)
}

// New returns a fake upstream with opts' defaults filled in.
func New(opts Options) *Server {
	opts.SlowDelay = cmp.Or(opts.SlowDelay, 200*time.Millisecond)
	opts.DefaultCompletionTokens = cmp.Or(opts.DefaultCompletionTokens, 20)
	opts.MaxOutputTokens = cmp.Or(opts.MaxOutputTokens, 65536)
	opts.MaxBodyBytes = cmp.Or(opts.MaxBodyBytes, 8<<20)
	opts.KeepRequests = cmp.Or(opts.KeepRequests, 1000)
	opts.BatchLineDelay = cmp.Or(opts.BatchLineDelay, 5*time.Millisecond)
	opts.BackgroundDelay = cmp.Or(opts.BackgroundDelay, 300*time.Millisecond)
	opts.BackgroundKeep = cmp.Or(opts.BackgroundKeep, 10*time.Minute)
	return &Server{opts: opts}
}

// Requests is the number of requests the server has received (any path, any outcome).
func (s *Server) Requests() int64 { return s.requests.Load() }

// Seen returns the latest requests (at most Options.KeepRequests), oldest first.
func (s *Server) Seen() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.seen...)
}

// LastRequest returns the latest request, and false when there was none.
func (s *Server) LastRequest() (Request, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.seen) == 0 {
		return Request{}, false
	}
	return s.seen[len(s.seen)-1], true
}

// Reset forgets the requests seen and sets the counter to zero.
func (s *Server) Reset() {
	s.mu.Lock()
	s.seen = nil
	s.requests.Store(0)
	s.mu.Unlock()
}

// ServeHTTP answers one OpenAI API request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	if isBatchPath(r.URL.Path) {
		s.record(Request{Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Authorization: r.Header.Get("Authorization"),
			Header: r.Header.Clone(), Time: time.Now()})
		s.serveBatch(w, r) // files and batches (batches.go): uploads are larger than MaxBodyBytes
		return
	}
	body, readErr := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxBodyBytes))
	var req apiRequest
	parseErr := readErr
	if readErr == nil && r.Method == http.MethodPost {
		if isForm(r) {
			parseErr = readForm(r, body, &req) // multipart uploads (media.go)
		} else {
			parseErr = json.Unmarshal(body, &req)
		}
		req.worst = s.readWorst(r.URL.Path, body, &req)
	}
	seen := Request{
		Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Authorization: r.Header.Get("Authorization"), Header: r.Header.Clone(),
		Model: req.Model, Stream: req.Stream, Body: body, Time: time.Now(),
		IncludeUsage: req.StreamOptions != nil && req.StreamOptions.IncludeUsage,
	}
	s.record(seen)

	endpoint, ok := endpoints[r.URL.Path]
	switch {
	case strings.HasPrefix(r.URL.Path, "/v1/responses/") && readErr == nil &&
		(s.opts.APIKey == "" || r.Header.Get("Authorization") == "Bearer "+s.opts.APIKey):
		s.backgroundRoute(w, r)
	case !ok:
		writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_url",
			fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path))
	case r.Method != http.MethodPost:
		w.Header().Set("Allow", http.MethodPost)
		writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
			fmt.Sprintf("Method %s not allowed on %s", r.Method, r.URL.Path))
	case s.opts.APIKey != "" && r.Header.Get("Authorization") != "Bearer "+s.opts.APIKey && r.Header.Get("X-Api-Key") != s.opts.APIKey:
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key",
			"Incorrect API key provided.")
	case readErr != nil:
		var tooBig *http.MaxBytesError
		if errors.As(readErr, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large",
				fmt.Sprintf("Request body larger than %d bytes.", tooBig.Limit))
			return
		}
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Could not read the request body.")
	case parseErr != nil:
		writeError(w, http.StatusBadRequest, "invalid_request_error", "",
			"We could not parse the JSON body of your request. ("+parseErr.Error()+")")
	case req.Model == "" && r.URL.Path != "/v1/moderations": // moderations default their model
		writeError(w, http.StatusBadRequest, "invalid_request_error", "",
			"you must provide a model parameter")
	default:
		endpoint(s, w, r, &req)
	}
}

// maxKeptBody is how much of a body Seen keeps.
const maxKeptBody = 64 << 10

func (s *Server) record(req Request) {
	if s.opts.KeepRequests > 0 {
		kept := req
		if len(kept.Body) > maxKeptBody {
			kept.Body = append([]byte(nil), kept.Body[:maxKeptBody]...)
		}
		s.mu.Lock()
		s.seen = append(s.seen, kept)
		if over := len(s.seen) - s.opts.KeepRequests; over > 0 {
			s.seen = append(s.seen[:0:0], s.seen[over:]...)
		}
		s.mu.Unlock()
	}
	if s.opts.OnRequest != nil {
		s.opts.OnRequest(req)
	}
}

var endpoints = map[string]func(*Server, http.ResponseWriter, *http.Request, *apiRequest){
	"/v1/chat/completions":      (*Server).chat,
	"/v1/completions":           (*Server).completions,
	"/v1/embeddings":            (*Server).embeddings,
	"/v1/responses":             (*Server).responses,
	"/v1/messages":              (*Server).messages,
	"/v1/messages/count_tokens": (*Server).countTokens,
	"/v1/moderations":           (*Server).moderations,
	"/v1/images/generations":    (*Server).imagesGenerations,
	"/v1/images/edits":          (*Server).imagesEdits,
	"/v1/audio/transcriptions":  (*Server).transcription,
	"/v1/audio/translations":    (*Server).transcription,
	"/v1/audio/speech":          (*Server).speech,
}

// errorBody is OpenAI's error shape.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	var b errorBody
	b.Error.Message, b.Error.Type = msg, typ
	if code != "" {
		b.Error.Code = &code
	}
	writeJSON(w, status, b)
}

// writeServerError is the [fail] answer.
func writeServerError(w http.ResponseWriter) {
	writeError(w, http.StatusInternalServerError, "server_error", "",
		"The server had an error while processing your request. Sorry about that!")
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", fmt.Sprint(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// nextID returns prefix followed by a per-server sequence number.
func (s *Server) nextID(prefix string) string {
	return fmt.Sprintf("%s-fake%06d", prefix, s.ids.Add(1))
}

// outputWords returns n words: "tok1", " tok2", … (each but the first with its leading space,
// so that their concatenation is the reply text). The words are made once and shared by every
// answer (a test that asks for a million-token reply thousands of times would otherwise spend
// most of its CPU formatting them); the slice is read-only and capped, so an append copies.
func outputWords(n int) []string {
	words.Lock()
	defer words.Unlock()
	for i := len(words.w); i < n; i++ {
		if i == 0 {
			words.w = append(words.w, "tok1")
		} else {
			words.w = append(words.w, " tok"+strconv.Itoa(i+1))
		}
	}
	return words.w[:n:n]
}

// words holds the words outputWords has made so far.
var words struct {
	sync.Mutex
	w []string
}

func joinWords(w []string) string { return strings.Join(w, "") }
