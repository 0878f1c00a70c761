package fakeupstream

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"
)

// maxChoices bounds n, as OpenAI does.
const maxChoices = 128

// maxDimensions bounds an embedding's dimensions.
const maxDimensions = 4096

// defaultDimensions is an embedding's length when the request does not say.
const defaultDimensions = 8

// sse writes server-sent events and flushes each one.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func startSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("Connection", "keep-alive")
	w.WriteHeader(http.StatusOK)
	return &sse{w: w, rc: http.NewResponseController(w)}
}

// data writes "data: <json>\n\n".
func (e *sse) data(v any) error { return e.event("", v) }

// event writes "event: <name>\ndata: <json>\n\n" (no event line when name is "").
func (e *sse) event(name string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.raw(name, b)
}

func (e *sse) raw(name string, data []byte) error {
	var buf []byte
	if name != "" {
		buf = append(buf, "event: "+name+"\n"...)
	}
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	if _, err := e.w.Write(buf); err != nil {
		return err
	}
	return e.rc.Flush()
}

// pause waits d or until ctx ends; it reports whether to go on.
func pause(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// hangJSON sends the headers and the first bytes of a JSON body, then waits for the request's
// context to end.
func hangJSON(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte(`{"id":`))
	_ = http.NewResponseController(w).Flush()
	<-r.Context().Done()
}

// badN checks n; it writes a 400 and reports true when n is out of range.
func badN(w http.ResponseWriter, n *int64) bool {
	if n != nil && (*n < 1 || *n > maxChoices) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "integer_out_of_range",
			fmt.Sprintf("Invalid 'n': integer must be between 1 and %d.", maxChoices))
		return true
	}
	return false
}

// badCap checks an output cap; a 400 for one ≤ 0, as OpenAI answers.
func badCap(w http.ResponseWriter, name string, v *int64) bool {
	if v != nil && *v <= 0 {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "integer_below_min_value",
			fmt.Sprintf("Invalid '%s': integer below minimum value. Expected a value >= 1, but got %d instead.", name, *v))
		return true
	}
	return false
}

// ---- chat completions ----

// ChatUsage is the usage object of chat completions (JSON and the last stream chunk).
type ChatUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
		AudioTokens  int `json:"audio_tokens"`
	} `json:"prompt_tokens_details"`
	CompletionTokensDetails struct {
		ReasoningTokens          int `json:"reasoning_tokens"`
		AudioTokens              int `json:"audio_tokens"`
		AcceptedPredictionTokens int `json:"accepted_prediction_tokens"`
		RejectedPredictionTokens int `json:"rejected_prediction_tokens"`
	} `json:"completion_tokens_details"`
}

func (p plan) chatUsage() ChatUsage {
	var u ChatUsage
	u.PromptTokens, u.CompletionTokens = p.promptTokens, p.totalCompletion()
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails.CachedTokens = p.cachedTokens
	u.CompletionTokensDetails.ReasoningTokens = p.reasoningTokens
	return u
}

func (p plan) finishReason() string {
	if p.capped {
		return "length"
	}
	return "stop"
}

type chatMessage struct {
	Role    string  `json:"role"`
	Content string  `json:"content"`
	Refusal *string `json:"refusal"`
}

type chatChoice struct {
	Index        int           `json:"index"`
	Message      chatMessage   `json:"message"`
	Logprobs     *chatLogprobs `json:"logprobs"`
	FinishReason string        `json:"finish_reason"`
}

// chatLogprobs is a choice's logprobs: one entry per output token.
type chatLogprobs struct {
	Content []tokenLogprob `json:"content"`
}

// tokenLogprob is one output token's logprob with its top alternatives (chat and responses).
type tokenLogprob struct {
	Token       string       `json:"token"`
	Logprob     float64      `json:"logprob"`
	Bytes       []int        `json:"bytes"`
	TopLogprobs []topLogprob `json:"top_logprobs"`
}

type topLogprob struct {
	Token   string  `json:"token"`
	Logprob float64 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// logprobsOf gives each word its logprob and top alternatives (deterministic values).
func logprobsOf(words []string, top int) []tokenLogprob {
	out := make([]tokenLogprob, len(words))
	for i, w := range words {
		lp := tokenLogprob{Token: w, Logprob: -float64(i%7+1) / 64, Bytes: make([]int, len(w)), TopLogprobs: make([]topLogprob, top)}
		for k := range w {
			lp.Bytes[k] = int(w[k])
		}
		for j := range lp.TopLogprobs {
			alt := fmt.Sprintf("alt%d", j)
			b := make([]int, len(alt))
			for k := range alt {
				b[k] = int(alt[k])
			}
			lp.TopLogprobs[j] = topLogprob{Token: alt, Logprob: -float64(j+2) / 8, Bytes: b}
		}
		out[i] = lp
	}
	return out
}

type chatCompletion struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	Usage             ChatUsage    `json:"usage"`
	SystemFingerprint string       `json:"system_fingerprint"`
}

type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chunkChoice struct {
	Index        int           `json:"index"`
	Delta        chatDelta     `json:"delta"`
	Logprobs     *chatLogprobs `json:"logprobs"`
	FinishReason *string       `json:"finish_reason"`
}

type chatChunk struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	Created           int64           `json:"created"`
	Model             string          `json:"model"`
	SystemFingerprint string          `json:"system_fingerprint"`
	Choices           []chunkChoice   `json:"choices"`
	Usage             json.RawMessage `json:"usage,omitempty"` // absent, null, or the usage
}

const fingerprint = "fp_fakeupstream"

func (s *Server) chat(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	if len(req.Messages) == 0 {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "empty_array",
			"Invalid 'messages': empty array. Expected an array with minimum length 1.")
		return
	}
	if badN(w, req.N) || badCap(w, "max_tokens", req.MaxTokens) ||
		badCap(w, "max_completion_tokens", req.MaxCompletionTokens) {
		return
	}
	words, last := chatInput(req)
	outCap := req.MaxCompletionTokens
	if outCap == nil {
		outCap = req.MaxTokens
	}
	p := s.newPlan(words, last, outCap, req.N)
	if p.fail {
		writeServerError(w)
		return
	}
	w, done := p.encode(w)
	defer done()
	id, created := s.nextID("chatcmpl"), time.Now().Unix()
	out := outputWords(p.completionTokens)
	if !req.Stream {
		if p.hang {
			hangJSON(w, r)
			return
		}
		if p.slow && !pause(r.Context(), time.Duration(p.totalCompletion())*s.opts.SlowDelay) {
			return
		}
		resp := chatCompletion{ID: id, Object: "chat.completion", Created: created, Model: req.Model,
			Usage: p.chatUsage(), SystemFingerprint: fingerprint}
		var lp *chatLogprobs
		if top := req.chatLogprobs(); top >= 0 {
			lp = &chatLogprobs{Content: logprobsOf(out, top)}
		}
		for i := 0; i < p.choices; i++ {
			resp.Choices = append(resp.Choices, chatChoice{Index: i, FinishReason: p.finishReason(),
				Message: chatMessage{Role: "assistant", Content: joinWords(out)}, Logprobs: lp})
		}
		writeJSON(w, http.StatusOK, resp)
		return
	}

	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	e := startSSE(w)
	chunk := func(choices []chunkChoice) chatChunk {
		c := chatChunk{ID: id, Object: "chat.completion.chunk", Created: created, Model: req.Model,
			SystemFingerprint: fingerprint, Choices: choices}
		if includeUsage {
			c.Usage = json.RawMessage("null")
		}
		return c
	}
	empty := ""
	for i := 0; i < p.choices; i++ {
		if e.data(chunk([]chunkChoice{{Index: i, Delta: chatDelta{Role: "assistant", Content: &empty}}})) != nil {
			return
		}
	}
	if p.hang {
		<-r.Context().Done()
		return
	}
	top := req.chatLogprobs()
	for _, word := range out {
		var lp *chatLogprobs
		if top >= 0 {
			lp = &chatLogprobs{Content: logprobsOf([]string{word}, top)}
		}
		for i := 0; i < p.choices; i++ {
			if p.slow && !pause(r.Context(), s.opts.SlowDelay) {
				return
			}
			if e.data(chunk([]chunkChoice{{Index: i, Delta: chatDelta{Content: &word}, Logprobs: lp}})) != nil {
				return
			}
		}
	}
	reason := p.finishReason()
	for i := 0; i < p.choices; i++ {
		if e.data(chunk([]chunkChoice{{Index: i, FinishReason: &reason}})) != nil {
			return
		}
	}
	if includeUsage {
		u, _ := json.Marshal(p.chatUsage())
		c := chunk([]chunkChoice{})
		c.Usage = u
		if e.data(c) != nil {
			return
		}
	}
	_ = e.raw("", []byte("[DONE]"))
}

// ---- legacy completions ----

// CompletionUsage is the usage object of legacy completions and (without completion tokens) of
// embeddings.
type CompletionUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type completionChoice struct {
	Text         string    `json:"text"`
	Index        int       `json:"index"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
}

type completion struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	SystemFingerprint string             `json:"system_fingerprint"`
	Choices           []completionChoice `json:"choices"`
	Usage             json.RawMessage    `json:"usage,omitempty"`
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	words, last, ok := promptInput(req.Prompt)
	if !ok {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "",
			"Invalid 'prompt': expected a string, an array of strings or an array of tokens.")
		return
	}
	if badN(w, req.N) || badCap(w, "max_tokens", req.MaxTokens) {
		return
	}
	p := s.newPlan(words, last, req.MaxTokens, req.N)
	if p.fail {
		writeServerError(w)
		return
	}
	w, done := p.encode(w)
	defer done()
	id, created := s.nextID("cmpl"), time.Now().Unix()
	out := outputWords(p.completionTokens)
	usage, _ := json.Marshal(CompletionUsage{PromptTokens: p.promptTokens,
		CompletionTokens: p.totalCompletion(), TotalTokens: p.promptTokens + p.totalCompletion()})
	reason := p.finishReason()
	if !req.Stream {
		if p.hang {
			hangJSON(w, r)
			return
		}
		if p.slow && !pause(r.Context(), time.Duration(p.totalCompletion())*s.opts.SlowDelay) {
			return
		}
		resp := completion{ID: id, Object: "text_completion", Created: created, Model: req.Model,
			SystemFingerprint: fingerprint, Usage: usage}
		for i := 0; i < p.choices; i++ {
			resp.Choices = append(resp.Choices, completionChoice{Text: joinWords(out), Index: i, FinishReason: &reason})
		}
		writeJSON(w, http.StatusOK, resp)
		return
	}

	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	e := startSSE(w)
	chunk := func(choices []completionChoice) completion {
		c := completion{ID: id, Object: "text_completion", Created: created, Model: req.Model,
			SystemFingerprint: fingerprint, Choices: choices}
		if includeUsage {
			c.Usage = json.RawMessage("null")
		}
		return c
	}
	for j, word := range out {
		for i := 0; i < p.choices; i++ {
			if p.slow && !pause(r.Context(), s.opts.SlowDelay) {
				return
			}
			if e.data(chunk([]completionChoice{{Text: word, Index: i}})) != nil {
				return
			}
			if p.hang && j == 0 && i == 0 {
				<-r.Context().Done()
				return
			}
		}
	}
	for i := 0; i < p.choices; i++ {
		if e.data(chunk([]completionChoice{{Text: "", Index: i, FinishReason: &reason}})) != nil {
			return
		}
	}
	if includeUsage {
		c := chunk([]completionChoice{})
		c.Usage = usage
		if e.data(c) != nil {
			return
		}
	}
	_ = e.raw("", []byte("[DONE]"))
}

// ---- embeddings ----

type embedding struct {
	Object    string `json:"object"`
	Index     int    `json:"index"`
	Embedding any    `json:"embedding"` // []float32, or a base64 string of little-endian float32s
}

type embeddingList struct {
	Object string          `json:"object"`
	Data   []embedding     `json:"data"`
	Model  string          `json:"model"`
	Usage  EmbeddingsUsage `json:"usage"`
}

// EmbeddingsUsage is the usage object of embeddings.
type EmbeddingsUsage struct {
	PromptTokens int `json:"prompt_tokens"`
	TotalTokens  int `json:"total_tokens"`
}

// embeddingInputs is how many embeddings the input asks for.
func embeddingInputs(raw json.RawMessage) int {
	var arr []json.RawMessage
	if json.Unmarshal(raw, &arr) != nil {
		return 1 // a string
	}
	var toks []int64
	if json.Unmarshal(raw, &toks) == nil {
		return 1 // one token array
	}
	return len(arr)
}

func (s *Server) embeddings(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	words, last, ok := promptInput(req.Input)
	if !ok {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "",
			"Invalid 'input': expected a string, an array of strings or an array of tokens.")
		return
	}
	dims := defaultDimensions
	if req.Dimensions != 0 {
		if req.Dimensions < 1 || req.Dimensions > maxDimensions {
			writeError(w, http.StatusBadRequest, "invalid_request_error", "integer_out_of_range",
				fmt.Sprintf("Invalid 'dimensions': integer must be between 1 and %d.", maxDimensions))
			return
		}
		dims = req.Dimensions
	}
	p := s.newPlan(words, last, nil, nil)
	if p.fail {
		writeServerError(w)
		return
	}
	w, done := p.encode(w)
	defer done()
	if p.hang {
		hangJSON(w, r)
		return
	}
	if p.slow && !pause(r.Context(), s.opts.SlowDelay) {
		return
	}
	resp := embeddingList{Object: "list", Model: req.Model,
		Usage: EmbeddingsUsage{PromptTokens: p.promptTokens, TotalTokens: p.promptTokens}}
	for i := 0; i < embeddingInputs(req.Input); i++ {
		vec := make([]float32, dims)
		for j := range vec {
			vec[j] = float32((i+1)*(j+3)%97) / 97
		}
		var v any = vec
		if req.EncodingFormat == "base64" {
			b := make([]byte, 4*dims)
			for j, f := range vec {
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(f))
			}
			v = base64.StdEncoding.EncodeToString(b)
		}
		resp.Data = append(resp.Data, embedding{Object: "embedding", Index: i, Embedding: v})
	}
	writeJSON(w, http.StatusOK, resp)
}

// ---- responses ----

// ResponsesUsage is the usage object of the Responses API.
type ResponsesUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

type outputText struct {
	Type        string         `json:"type"`
	Text        string         `json:"text"`
	Annotations []any          `json:"annotations"`
	Logprobs    []tokenLogprob `json:"logprobs,omitempty"`
}

type outputItem struct {
	ID      string       `json:"id"`
	Type    string       `json:"type"`
	Status  string       `json:"status"`
	Role    string       `json:"role"`
	Content []outputText `json:"content"`
}

type incompleteDetails struct {
	Reason string `json:"reason"`
}

type response struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	CreatedAt         int64              `json:"created_at"`
	Status            string             `json:"status"`
	Error             *struct{}          `json:"error"`
	IncompleteDetails *incompleteDetails `json:"incomplete_details"`
	MaxOutputTokens   *int64             `json:"max_output_tokens"`
	Model             string             `json:"model"`
	Output            []outputItem       `json:"output"`
	Usage             *ResponsesUsage    `json:"usage"`
}

func (p plan) responsesUsage() *ResponsesUsage {
	u := &ResponsesUsage{InputTokens: p.promptTokens, OutputTokens: p.completionTokens,
		TotalTokens: p.promptTokens + p.completionTokens}
	u.InputTokensDetails.CachedTokens = p.cachedTokens
	u.OutputTokensDetails.ReasoningTokens = p.reasoningTokens
	return u
}

func (s *Server) responses(w http.ResponseWriter, r *http.Request, req *apiRequest) {
	words, last, ok := responsesInput(req.Input)
	if !ok {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "",
			"Invalid 'input': expected a string or an array of input items.")
		return
	}
	if badCap(w, "max_output_tokens", req.MaxOutputTokens) {
		return
	}
	p := s.newPlan(words, last, req.MaxOutputTokens, nil)
	if p.fail {
		writeServerError(w)
		return
	}
	w, done := p.encode(w)
	defer done()
	id, msgID, created := s.nextID("resp"), s.nextID("msg"), time.Now().Unix()
	out := outputWords(p.completionTokens)
	final := response{ID: id, Object: "response", CreatedAt: created, Status: "completed",
		MaxOutputTokens: req.MaxOutputTokens, Model: req.Model, Usage: p.responsesUsage(),
		Output: []outputItem{{ID: msgID, Type: "message", Status: "completed", Role: "assistant",
			Content: []outputText{{Type: "output_text", Text: joinWords(out), Annotations: []any{}}}}}}
	if top := req.responsesLogprobs(); top >= 0 {
		final.Output[0].Content[0].Logprobs = logprobsOf(out, top)
	}
	if p.incomplete {
		final.Status = "incomplete"
		final.IncompleteDetails = &incompleteDetails{Reason: "max_output_tokens"}
		final.Output[0].Status = "incomplete"
	}
	if !req.Stream {
		if p.hang {
			hangJSON(w, r)
			return
		}
		if p.slow && !pause(r.Context(), time.Duration(p.completionTokens)*s.opts.SlowDelay) {
			return
		}
		writeJSON(w, http.StatusOK, final)
		return
	}

	e := startSSE(w)
	seq := 0
	send := func(typ string, fields map[string]any) bool {
		fields["type"] = typ
		fields["sequence_number"] = seq
		seq++
		return e.event(typ, fields) == nil
	}
	pending := final
	pending.Status, pending.Usage, pending.Output, pending.IncompleteDetails = "in_progress", nil, []outputItem{}, nil
	if !send("response.created", map[string]any{"response": pending}) {
		return
	}
	if p.hang {
		<-r.Context().Done()
		return
	}
	item := outputItem{ID: msgID, Type: "message", Status: "in_progress", Role: "assistant", Content: []outputText{}}
	part := outputText{Type: "output_text", Text: "", Annotations: []any{}}
	loc := func(m map[string]any) map[string]any {
		m["item_id"], m["output_index"], m["content_index"] = msgID, 0, 0
		return m
	}
	if !send("response.in_progress", map[string]any{"response": pending}) ||
		!send("response.output_item.added", map[string]any{"output_index": 0, "item": item}) ||
		!send("response.content_part.added", loc(map[string]any{"part": part})) {
		return
	}
	for _, word := range out {
		if p.slow && !pause(r.Context(), s.opts.SlowDelay) {
			return
		}
		if !send("response.output_text.delta", loc(map[string]any{"delta": word})) {
			return
		}
	}
	text := joinWords(out)
	part.Text = text
	if !send("response.output_text.done", loc(map[string]any{"text": text})) ||
		!send("response.content_part.done", loc(map[string]any{"part": part})) ||
		!send("response.output_item.done", map[string]any{"output_index": 0, "item": final.Output[0]}) {
		return
	}
	end := "response.completed"
	if p.incomplete {
		end = "response.incomplete"
	}
	send(end, map[string]any{"response": final})
}
