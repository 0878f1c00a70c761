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

// answer is one OpenAI-style reply in the making: its plan, id, creation time and the words of
// each choice's output.
type answer struct {
	plan
	id      string
	created int64
	out     []string
}

// start computes the plan of an OpenAI-style reply and wraps w for the plan's encoding; ok is
// false when the plan says [fail] (a 500 is written then). done must be called when the reply is
// written.
func (s *Server) start(w http.ResponseWriter, req *apiRequest, words int, last string, outCap, n *int64) (p plan, ew http.ResponseWriter, done func(), ok bool) {
	if s.opts.Worst {
		words, n = req.worst.input, &req.worst.choices
	}
	p = s.newPlan(words, last, outCap, n, req.worst.defaultCap)
	if p.fail {
		writeServerError(w)
		return p, w, nil, false
	}
	ew, done = p.encode(w)
	return p, ew, done, true
}

// step waits n × SlowDelay when the plan is [slow]; false: the client left meanwhile.
func (s *Server) step(ctx context.Context, p plan, n int) bool {
	return !p.slow || pause(ctx, time.Duration(n)*s.opts.SlowDelay)
}

// jsonReady plays a JSON reply's markers: [hang] sends its first bytes and waits for the client
// to leave, [slow] waits tokens × SlowDelay. false: write nothing more.
func (s *Server) jsonReady(w http.ResponseWriter, r *http.Request, p plan, tokens int) bool {
	if p.hang {
		hangJSON(w, r)
		return false
	}
	return s.step(r.Context(), p, tokens)
}

// usageSlot is the usage of a stream's chunks before the usage chunk: null when the client asked
// for usage (stream_options.include_usage), else absent (nil).
func usageSlot(req *apiRequest) json.RawMessage {
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		return json.RawMessage("null")
	}
	return nil
}

// endStream sends each choice's last chunk, then the usage chunk when there is one (nil: the
// client did not ask for it), then [DONE]; it stops at the first write that fails.
func endStream(e *sse, choices int, last func(i int) any, usage any) {
	for i := 0; i < choices; i++ {
		if e.data(last(i)) != nil {
			return
		}
	}
	if usage != nil && e.data(usage) != nil {
		return
	}
	_ = e.raw("", []byte("[DONE]"))
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
	u.PromptTokensDetails.AudioTokens, u.CompletionTokensDetails.AudioTokens = p.audioIn, p.audioOut
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
	p, w, done, ok := s.start(w, req, words, last, outCap, req.N)
	if !ok {
		return
	}
	defer done()
	a := answer{plan: p, id: s.nextID("chatcmpl"), created: time.Now().Unix(), out: outputWords(p.completionTokens)}
	if req.Stream {
		s.chatStream(w, r, req, a)
	} else if s.jsonReady(w, r, p, p.totalCompletion()) {
		writeJSON(w, http.StatusOK, chatReply(req, a))
	}
}

// chatReply is the JSON reply of a chat completion: every choice says the same words.
func chatReply(req *apiRequest, a answer) chatCompletion {
	resp := chatCompletion{ID: a.id, Object: "chat.completion", Created: a.created, Model: req.Model,
		Usage: a.chatUsage(), SystemFingerprint: fingerprint}
	var lp *chatLogprobs
	if top := req.chatLogprobs(); top >= 0 {
		lp = &chatLogprobs{Content: logprobsOf(a.out, top)}
	}
	for i := 0; i < a.choices; i++ {
		resp.Choices = append(resp.Choices, chatChoice{Index: i, FinishReason: a.finishReason(),
			Message: chatMessage{Role: "assistant", Content: joinWords(a.out)}, Logprobs: lp})
	}
	return resp
}

// chatStream streams a chat completion: each choice's role, then word by word (each word for
// every choice in turn), each choice's finish reason, the usage chunk when asked for, [DONE].
func (s *Server) chatStream(w http.ResponseWriter, r *http.Request, req *apiRequest, a answer) {
	slot := usageSlot(req)
	e := startSSE(w)
	chunk := func(usage json.RawMessage, choices []chunkChoice) chatChunk {
		return chatChunk{ID: a.id, Object: "chat.completion.chunk", Created: a.created, Model: req.Model,
			SystemFingerprint: fingerprint, Choices: choices, Usage: usage}
	}
	empty := ""
	for i := 0; i < a.choices; i++ {
		if e.data(chunk(slot, []chunkChoice{{Index: i, Delta: chatDelta{Role: "assistant", Content: &empty}}})) != nil {
			return
		}
	}
	if a.hang {
		<-r.Context().Done()
		return
	}
	top := req.chatLogprobs()
	for _, word := range a.out {
		var lp *chatLogprobs
		if top >= 0 {
			lp = &chatLogprobs{Content: logprobsOf([]string{word}, top)}
		}
		for i := 0; i < a.choices; i++ {
			if !s.step(r.Context(), a.plan, 1) ||
				e.data(chunk(slot, []chunkChoice{{Index: i, Delta: chatDelta{Content: &word}, Logprobs: lp}})) != nil {
				return
			}
		}
	}
	reason := a.finishReason()
	var final any
	if slot != nil {
		u, _ := json.Marshal(a.chatUsage())
		final = chunk(u, []chunkChoice{})
	}
	endStream(e, a.choices, func(i int) any { return chunk(slot, []chunkChoice{{Index: i, FinishReason: &reason}}) }, final)
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
	p, w, done, ok := s.start(w, req, words, last, req.MaxTokens, req.N)
	if !ok {
		return
	}
	defer done()
	a := answer{plan: p, id: s.nextID("cmpl"), created: time.Now().Unix(), out: outputWords(p.completionTokens)}
	usage, _ := json.Marshal(CompletionUsage{PromptTokens: p.promptTokens,
		CompletionTokens: p.totalCompletion(), TotalTokens: p.promptTokens + p.totalCompletion()})
	if req.Stream {
		s.completionStream(w, r, req, a, usage)
		return
	}
	if !s.jsonReady(w, r, p, p.totalCompletion()) {
		return
	}
	reason := p.finishReason()
	resp := completion{ID: a.id, Object: "text_completion", Created: a.created, Model: req.Model,
		SystemFingerprint: fingerprint, Usage: usage}
	for i := 0; i < p.choices; i++ {
		resp.Choices = append(resp.Choices, completionChoice{Text: joinWords(a.out), Index: i, FinishReason: &reason})
	}
	writeJSON(w, http.StatusOK, resp)
}

// completionStream streams a legacy completion word by word (each word for every choice in
// turn), then each choice's finish reason, the usage chunk when asked for, [DONE].
func (s *Server) completionStream(w http.ResponseWriter, r *http.Request, req *apiRequest, a answer, usage json.RawMessage) {
	slot := usageSlot(req)
	e := startSSE(w)
	chunk := func(usage json.RawMessage, choices []completionChoice) completion {
		return completion{ID: a.id, Object: "text_completion", Created: a.created, Model: req.Model,
			SystemFingerprint: fingerprint, Choices: choices, Usage: usage}
	}
	for j, word := range a.out {
		for i := 0; i < a.choices; i++ {
			if !s.step(r.Context(), a.plan, 1) || e.data(chunk(slot, []completionChoice{{Text: word, Index: i}})) != nil {
				return
			}
			if a.hang && j == 0 && i == 0 {
				<-r.Context().Done()
				return
			}
		}
	}
	reason := a.finishReason()
	var final any
	if slot != nil {
		final = chunk(usage, []completionChoice{})
	}
	endStream(e, a.choices, func(i int) any {
		return chunk(slot, []completionChoice{{Text: "", Index: i, FinishReason: &reason}})
	}, final)
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
	p, w, done, ok := s.start(w, req, words, last, nil, nil)
	if !ok {
		return
	}
	defer done()
	if !s.jsonReady(w, r, p, 1) {
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
	if string(req.Background) == "true" && !req.Stream {
		s.background(w, req, words, last)
		return
	}
	p, w, done, ok := s.start(w, req, words, last, req.MaxOutputTokens, nil)
	if !ok {
		return
	}
	defer done()
	id, msgID, created := s.nextID("resp"), s.nextID("msg"), time.Now().Unix()
	a := answer{plan: p, id: id, created: created, out: outputWords(p.completionTokens)}
	final := finalResponse(req, a, msgID)
	if req.Stream {
		s.responseStream(w, r, a, final)
	} else if s.jsonReady(w, r, p, p.completionTokens) {
		writeJSON(w, http.StatusOK, final)
	}
}

// finalResponse is the response as it ends: the JSON reply, and the last event of a stream.
func finalResponse(req *apiRequest, a answer, msgID string) response {
	final := response{ID: a.id, Object: "response", CreatedAt: a.created, Status: "completed",
		MaxOutputTokens: req.MaxOutputTokens, Model: req.Model, Usage: a.responsesUsage(),
		Output: []outputItem{{ID: msgID, Type: "message", Status: "completed", Role: "assistant",
			Content: []outputText{{Type: "output_text", Text: joinWords(a.out), Annotations: []any{}}}}}}
	if top := req.responsesLogprobs(); top >= 0 {
		final.Output[0].Content[0].Logprobs = logprobsOf(a.out, top)
	}
	if a.incomplete {
		final.Status = "incomplete"
		final.IncompleteDetails = &incompleteDetails{Reason: "max_output_tokens"}
		final.Output[0].Status = "incomplete"
	}
	return final
}

// responseStream streams a response as the Responses API does: created, in progress, the
// message item and its text part opened, the text word by word, everything closed again, and
// final (completed or incomplete); each event numbered.
func (s *Server) responseStream(w http.ResponseWriter, r *http.Request, a answer, final response) {
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
	if a.hang {
		<-r.Context().Done()
		return
	}
	msgID := final.Output[0].ID
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
	for _, word := range a.out {
		if !s.step(r.Context(), a.plan, 1) || !send("response.output_text.delta", loc(map[string]any{"delta": word})) {
			return
		}
	}
	text := joinWords(a.out)
	part.Text = text
	if !send("response.output_text.done", loc(map[string]any{"text": text})) ||
		!send("response.content_part.done", loc(map[string]any{"part": part})) ||
		!send("response.output_item.done", map[string]any{"output_index": 0, "item": final.Output[0]}) {
		return
	}
	end := "response.completed"
	if a.incomplete {
		end = "response.incomplete"
	}
	send(end, map[string]any{"response": final})
}
