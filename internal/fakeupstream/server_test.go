package fakeupstream_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// ---- OpenAI response shapes, written independently of the package's own types ----

type apiError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

type chatUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	CompletionTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"completion_tokens_details"`
}

type chatCompletion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int `json:"index"`
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage chatUsage `json:"usage"`
}

type chatChunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index int `json:"index"`
		Delta struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *chatUsage `json:"usage"`
}

type textCompletion struct {
	Object  string `json:"object"`
	Choices []struct {
		Text         string  `json:"text"`
		Index        int     `json:"index"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	} `json:"usage"`
}

type embeddingList struct {
	Object string `json:"object"`
	Data   []struct {
		Object    string          `json:"object"`
		Index     int             `json:"index"`
		Embedding json.RawMessage `json:"embedding"`
	} `json:"data"`
	Model string `json:"model"`
	Usage struct {
		PromptTokens int `json:"prompt_tokens"`
		TotalTokens  int `json:"total_tokens"`
	} `json:"usage"`
}

type responsesUsage struct {
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

type responseObject struct {
	ID                string `json:"id"`
	Object            string `json:"object"`
	Status            string `json:"status"`
	Model             string `json:"model"`
	IncompleteDetails *struct {
		Reason string `json:"reason"`
	} `json:"incomplete_details"`
	Output []struct {
		Type    string `json:"type"`
		Role    string `json:"role"`
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
	} `json:"output"`
	Usage *responsesUsage `json:"usage"`
}

// ---- helpers ----

func newServer(t *testing.T, opts fakeupstream.Options) (*fakeupstream.Server, *httptest.Server) {
	t.Helper()
	f := fakeupstream.New(opts)
	ts := httptest.NewServer(f)
	t.Cleanup(ts.Close)
	return f, ts
}

func post(t *testing.T, ts *httptest.Server, path string, body any) *http.Response {
	t.Helper()
	return postCtx(t, context.Background(), ts, path, body, nil)
}

func postCtx(t *testing.T, ctx context.Context, ts *httptest.Server, path string, body any, hdr map[string]string) *http.Response {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case string:
		b = []byte(v)
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+path, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := ts.Client().Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	t.Cleanup(func() { _ = resp.Body.Close() })
	return resp
}

// decode reads a JSON body into v, refusing trailing garbage, and checks status and type.
func decode(t *testing.T, resp *http.Response, status int, v any) {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, b)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("Content-Type %q", ct)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	if dec.More() {
		t.Fatalf("trailing data after JSON: %s", b)
	}
}

type frame struct {
	event string
	data  string
	at    time.Time
}

// readSSE reads a whole event stream, checking its framing: every event is "event:" and/or
// "data:" lines ended by one blank line, nothing else.
func readSSE(t *testing.T, resp *http.Response) []frame {
	t.Helper()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("Content-Type %q", ct)
	}
	var frames []frame
	var cur frame
	var open bool
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if !open || cur.data == "" {
				t.Fatalf("blank line without a data line before it (frame %d)", len(frames))
			}
			cur.at = time.Now()
			frames = append(frames, cur)
			cur, open = frame{}, false
		case strings.HasPrefix(line, "event: "):
			if open {
				t.Fatalf("event line inside a frame: %q", line)
			}
			cur.event, open = strings.TrimPrefix(line, "event: "), true
		case strings.HasPrefix(line, "data: "):
			if cur.data != "" {
				t.Fatalf("two data lines in one frame: %q", line)
			}
			cur.data, open = strings.TrimPrefix(line, "data: "), true
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if open {
		t.Fatalf("stream ended inside a frame: %+v", cur)
	}
	return frames
}

func strictUnmarshal(t *testing.T, data string, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(data), v); err != nil {
		t.Fatalf("decode %s: %v", data, err)
	}
}

func words(n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = fmt.Sprintf("tok%d", i+1)
	}
	return strings.Join(w, " ")
}

// ---- chat completions ----

func TestChatJSON(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	body := `{"model":"gpt-4o","max_tokens":5,"messages":[
		{"role":"system","content":"You are  helpful"},
		{"role":"user","content":[{"type":"text","text":"two words"},{"type":"image_url","image_url":{"url":"data:x"}}]},
		{"role":"assistant","content":"ok"},
		{"role":"user","content":"hello\nthere\tworld [cached:4] [reasoning:2]"}]}`
	var got chatCompletion
	decode(t, post(t, ts, "/v1/chat/completions", body), 200, &got)
	// 3 + 2 + 1 + 5 words (markers are words too).
	if got.Usage.PromptTokens != 11 || got.Usage.CompletionTokens != 5 || got.Usage.TotalTokens != 16 {
		t.Fatalf("usage = %+v", got.Usage)
	}
	if got.Usage.PromptTokensDetails.CachedTokens != 4 || got.Usage.CompletionTokensDetails.ReasoningTokens != 2 {
		t.Fatalf("details = %+v", got.Usage)
	}
	if got.Object != "chat.completion" || !strings.HasPrefix(got.ID, "chatcmpl-") || got.Model != "gpt-4o" || got.Created == 0 {
		t.Fatalf("envelope = %+v", got)
	}
	if len(got.Choices) != 1 || got.Choices[0].Message.Role != "assistant" ||
		got.Choices[0].Message.Content != words(5) || got.Choices[0].FinishReason != "length" {
		t.Fatalf("choices = %+v", got.Choices)
	}
}

func TestChatCompletionTokensRules(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{MaxOutputTokens: 100})
	cases := []struct {
		name   string
		extra  string
		want   int
		reason string
	}{
		{"default", ``, 20, "stop"},
		{"max_tokens", `,"max_tokens":3`, 3, "length"},
		{"max_completion_tokens wins", `,"max_tokens":3,"max_completion_tokens":7`, 7, "length"},
		// The answer is 20 words long: a cap above it does not lengthen it, [fill] does.
		{"a cap above the answer", `,"max_tokens":50`, 20, "stop"},
		{"[fill]: the cap", `,"max_tokens":50,"messages":[{"role":"user","content":"a [fill]"}]`, 50, "length"},
		{"capped by MaxOutputTokens", `,"max_tokens":5000,"messages":[{"role":"user","content":"a [fill]"}]`, 100, "length"},
		{"n=3", `,"max_tokens":2,"n":3`, 6, "length"},
	}
	for _, tc := range cases {
		var got chatCompletion
		body := `{"model":"m","messages":[{"role":"user","content":"a b"}]` + tc.extra + `}`
		if strings.Contains(tc.extra, "messages") {
			body = `{"model":"m"` + tc.extra + `}`
		}
		decode(t, post(t, ts, "/v1/chat/completions", body), 200, &got)
		if got.Usage.CompletionTokens != tc.want || got.Usage.PromptTokens != 2 {
			t.Errorf("%s: usage %+v, want completion %d", tc.name, got.Usage, tc.want)
		}
		for i, c := range got.Choices {
			if c.Index != i || c.FinishReason != tc.reason || len(strings.Fields(c.Message.Content)) != tc.want/len(got.Choices) {
				t.Errorf("%s: choice %d = %+v", tc.name, i, c)
			}
		}
	}
}

func TestCachedAndReasoningAreClamped(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	var got chatCompletion
	decode(t, post(t, ts, "/v1/chat/completions", `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"x [cached:99] [reasoning:99]"}]}`), 200, &got)
	if got.Usage.PromptTokensDetails.CachedTokens != 3 || got.Usage.CompletionTokensDetails.ReasoningTokens != 2 {
		t.Fatalf("usage = %+v; cached ≤ prompt (3), reasoning ≤ completion (2)", got.Usage)
	}
}

func chatStream(t *testing.T, ts *httptest.Server, extra string) []frame {
	t.Helper()
	return readSSE(t, post(t, ts, "/v1/chat/completions",
		`{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"one two three [cached:1]"}]`+extra+`}`))
}

func TestChatStreamWithUsage(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	frames := chatStream(t, ts, `,"stream_options":{"include_usage":true}`)
	if last := frames[len(frames)-1]; last.data != "[DONE]" || last.event != "" {
		t.Fatalf("last frame = %+v, want data: [DONE]", last)
	}
	frames = frames[:len(frames)-1]
	var text strings.Builder
	var contentChunks int
	for i, f := range frames {
		var raw map[string]json.RawMessage
		strictUnmarshal(t, f.data, &raw)
		u, has := raw["usage"]
		if !has {
			t.Fatalf("chunk %d has no usage field under include_usage: %s", i, f.data)
		}
		var c chatChunk
		strictUnmarshal(t, f.data, &c)
		if c.Object != "chat.completion.chunk" || c.Model != "m" || !strings.HasPrefix(c.ID, "chatcmpl-") {
			t.Fatalf("chunk %d envelope: %s", i, f.data)
		}
		if i < len(frames)-1 {
			if string(u) != "null" || len(c.Choices) != 1 {
				t.Fatalf("chunk %d: want usage null and one choice: %s", i, f.data)
			}
			if d := c.Choices[0].Delta.Content; d != nil && *d != "" {
				contentChunks++
				text.WriteString(*d)
			}
			continue
		}
		if len(c.Choices) != 0 || c.Usage == nil {
			t.Fatalf("final chunk: want choices [] and usage: %s", f.data)
		}
		if !strings.Contains(f.data, `"choices":[]`) {
			t.Fatalf("final chunk choices must be an empty array, not null: %s", f.data)
		}
		if c.Usage.PromptTokens != 4 || c.Usage.CompletionTokens != 4 || c.Usage.TotalTokens != 8 ||
			c.Usage.PromptTokensDetails.CachedTokens != 1 {
			t.Fatalf("usage = %+v", c.Usage)
		}
	}
	if contentChunks != 4 || text.String() != words(4) {
		t.Fatalf("%d content chunks, text %q", contentChunks, text.String())
	}
	// The first chunk carries the role, the one before the usage the finish reason.
	var first, fin chatChunk
	strictUnmarshal(t, frames[0].data, &first)
	strictUnmarshal(t, frames[len(frames)-2].data, &fin)
	if first.Choices[0].Delta.Role != "assistant" {
		t.Fatalf("first chunk: %s", frames[0].data)
	}
	if fin.Choices[0].FinishReason == nil || *fin.Choices[0].FinishReason != "length" {
		t.Fatalf("finish chunk: %s", frames[len(frames)-2].data)
	}
}

func TestChatStreamWithoutUsage(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	for _, extra := range []string{``, `,"stream_options":{"include_usage":false}`} {
		frames := chatStream(t, ts, extra)
		if frames[len(frames)-1].data != "[DONE]" {
			t.Fatal("no [DONE]")
		}
		// role chunk + 4 words + finish chunk + [DONE]
		if len(frames) != 7 {
			t.Fatalf("%d frames, want 7", len(frames))
		}
		for _, f := range frames[:len(frames)-1] {
			var raw map[string]json.RawMessage
			strictUnmarshal(t, f.data, &raw)
			if _, has := raw["usage"]; has {
				t.Fatalf("usage field without include_usage: %s", f.data)
			}
		}
	}
}

func TestChatStreamN(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	frames := readSSE(t, post(t, ts, "/v1/chat/completions",
		`{"model":"m","stream":true,"n":2,"max_tokens":3,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`))
	texts := map[int]string{}
	var usage *chatUsage
	for _, f := range frames[:len(frames)-1] {
		var c chatChunk
		strictUnmarshal(t, f.data, &c)
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil {
				texts[ch.Index] += *ch.Delta.Content
			}
		}
		if c.Usage != nil {
			usage = c.Usage
		}
	}
	if texts[0] != words(3) || texts[1] != words(3) || usage == nil || usage.CompletionTokens != 6 {
		t.Fatalf("texts %v, usage %+v", texts, usage)
	}
}

// ---- completions ----

func TestCompletions(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	for _, tc := range []struct {
		prompt string
		want   int
	}{
		{`"say this is a test"`, 5},
		{`["a b", "c d e"]`, 5},
		{`[1, 2, 3]`, 3},
		{`[[1, 2], [3]]`, 3},
	} {
		var got textCompletion
		decode(t, post(t, ts, "/v1/completions", `{"model":"m","max_tokens":2,"prompt":`+tc.prompt+`}`), 200, &got)
		if got.Object != "text_completion" || got.Usage == nil || got.Usage.PromptTokens != tc.want ||
			got.Usage.CompletionTokens != 2 || got.Usage.TotalTokens != tc.want+2 {
			t.Fatalf("prompt %s: %+v", tc.prompt, got)
		}
		if len(got.Choices) != 1 || got.Choices[0].Text != words(2) {
			t.Fatalf("choices %+v", got.Choices)
		}
	}
}

func TestCompletionsStream(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	frames := readSSE(t, post(t, ts, "/v1/completions",
		`{"model":"m","stream":true,"max_tokens":3,"stream_options":{"include_usage":true},"prompt":"a b c d"}`))
	if frames[len(frames)-1].data != "[DONE]" {
		t.Fatal("no [DONE]")
	}
	var text string
	var final textCompletion
	for i, f := range frames[:len(frames)-1] {
		var c textCompletion
		strictUnmarshal(t, f.data, &c)
		if c.Object != "text_completion" {
			t.Fatalf("chunk %d: %s", i, f.data)
		}
		if i < len(frames)-2 {
			if !strings.Contains(f.data, `"usage":null`) {
				t.Fatalf("chunk %d: want usage null: %s", i, f.data)
			}
			text += c.Choices[0].Text
		} else {
			final = c
		}
	}
	if text != words(3) || final.Usage == nil || final.Usage.PromptTokens != 4 || final.Usage.CompletionTokens != 3 || len(final.Choices) != 0 {
		t.Fatalf("text %q final %+v", text, final)
	}
	// Without include_usage: no usage anywhere.
	frames = readSSE(t, post(t, ts, "/v1/completions", `{"model":"m","stream":true,"max_tokens":3,"prompt":"a"}`))
	for _, f := range frames {
		if strings.Contains(f.data, `"usage"`) {
			t.Fatalf("usage without include_usage: %s", f.data)
		}
	}
	if len(frames) != 5 { // 3 words, finish, [DONE]
		t.Fatalf("%d frames, want 5", len(frames))
	}
}

// ---- embeddings ----

func TestEmbeddings(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	var got embeddingList
	decode(t, post(t, ts, "/v1/embeddings", `{"model":"text-embedding-3-small","input":["the quick fox","jumps"],"dimensions":4}`), 200, &got)
	if got.Object != "list" || got.Model != "text-embedding-3-small" || got.Usage.PromptTokens != 4 || got.Usage.TotalTokens != 4 {
		t.Fatalf("envelope %+v", got)
	}
	if len(got.Data) != 2 {
		t.Fatalf("%d embeddings, want 2", len(got.Data))
	}
	var vec []float32
	strictUnmarshal(t, string(got.Data[1].Embedding), &vec)
	if got.Data[1].Object != "embedding" || got.Data[1].Index != 1 || len(vec) != 4 {
		t.Fatalf("embedding %+v", got.Data[1])
	}

	var b64 embeddingList
	decode(t, post(t, ts, "/v1/embeddings", `{"model":"e","input":"the quick fox","encoding_format":"base64"}`), 200, &b64)
	var s string
	strictUnmarshal(t, string(b64.Data[0].Embedding), &s)
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil || len(raw) != 8*4 || b64.Usage.PromptTokens != 3 {
		t.Fatalf("base64 embedding: %d bytes, %v, usage %+v", len(raw), err, b64.Usage)
	}
	f := math.Float32frombits(binary.LittleEndian.Uint32(raw))
	if f <= 0 || f >= 1 {
		t.Fatalf("first float %v", f)
	}
}

// ---- responses ----

func TestResponsesJSON(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	var got responseObject
	decode(t, post(t, ts, "/v1/responses", `{"model":"gpt-4.1","max_output_tokens":6,"input":[
		{"role":"developer","content":"be brief"},
		{"role":"user","content":[{"type":"input_text","text":"tell me a story [cached:2] [reasoning:1]"},{"type":"input_image","image_url":"x"}]}]}`), 200, &got)
	if got.Object != "response" || got.Status != "completed" || !strings.HasPrefix(got.ID, "resp") || got.Usage == nil {
		t.Fatalf("envelope %+v", got)
	}
	u := got.Usage
	if u.InputTokens != 8 || u.OutputTokens != 6 || u.TotalTokens != 14 ||
		u.InputTokensDetails.CachedTokens != 2 || u.OutputTokensDetails.ReasoningTokens != 1 {
		t.Fatalf("usage %+v", u)
	}
	if len(got.Output) != 1 || got.Output[0].Type != "message" || got.Output[0].Content[0].Type != "output_text" ||
		got.Output[0].Content[0].Text != words(6) {
		t.Fatalf("output %+v", got.Output)
	}

	var str responseObject
	decode(t, post(t, ts, "/v1/responses", `{"model":"m","input":"just a string [incomplete]"}`), 200, &str)
	if str.Usage.InputTokens != 4 || str.Usage.OutputTokens != 20 || str.Status != "incomplete" ||
		str.IncompleteDetails == nil || str.IncompleteDetails.Reason != "max_output_tokens" {
		t.Fatalf("string input: %+v", str)
	}
}

func TestResponsesStream(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	frames := readSSE(t, post(t, ts, "/v1/responses", `{"model":"m","stream":true,"max_output_tokens":3,"input":"a b [cached:1]"}`))
	var types []string
	var text string
	for i, f := range frames {
		var ev struct {
			Type     string          `json:"type"`
			Seq      *int            `json:"sequence_number"`
			Delta    string          `json:"delta"`
			Response *responseObject `json:"response"`
		}
		strictUnmarshal(t, f.data, &ev)
		if ev.Type != f.event || ev.Seq == nil || *ev.Seq != i {
			t.Fatalf("frame %d: event %q, data %s", i, f.event, f.data)
		}
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.output_text.delta":
			text += ev.Delta
		case "response.created":
			if ev.Response == nil || ev.Response.Status != "in_progress" || ev.Response.Usage != nil {
				t.Fatalf("created: %s", f.data)
			}
		case "response.completed":
			u := ev.Response.Usage
			if ev.Response.Status != "completed" || u == nil || u.InputTokens != 3 || u.OutputTokens != 3 ||
				u.TotalTokens != 6 || u.InputTokensDetails.CachedTokens != 1 || u.OutputTokensDetails.ReasoningTokens != 0 {
				t.Fatalf("completed: %s", f.data)
			}
			if !strings.Contains(f.data, `"output_tokens_details":{"reasoning_tokens":0}`) {
				t.Fatalf("reasoning_tokens must be present: %s", f.data)
			}
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added",
		"response.content_part.added", "response.output_text.delta", "response.output_text.delta",
		"response.output_text.delta", "response.output_text.done", "response.content_part.done",
		"response.output_item.done", "response.completed"}
	if strings.Join(types, ",") != strings.Join(want, ",") {
		t.Fatalf("events:\n%v\nwant\n%v", types, want)
	}
	if text != words(3) {
		t.Fatalf("deltas %q", text)
	}

	frames = readSSE(t, post(t, ts, "/v1/responses", `{"model":"m","stream":true,"max_output_tokens":1,"input":"x [incomplete]"}`))
	if last := frames[len(frames)-1]; last.event != "response.incomplete" || !strings.Contains(last.data, `"status":"incomplete"`) {
		t.Fatalf("last event %+v", last)
	}
}

// ---- markers ----

func TestFailMarker(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	for _, tc := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"please [fail]"}]}`},
		{"/v1/completions", `{"model":"m","prompt":"[fail]"}`},
		{"/v1/embeddings", `{"model":"m","input":["ok","[fail]"]}`},
		{"/v1/responses", `{"model":"m","input":[{"role":"user","content":"[fail] now"}]}`},
	} {
		var e apiError
		decode(t, post(t, ts, tc.path, tc.body), 500, &e)
		if e.Error.Type != "server_error" || e.Error.Message == "" {
			t.Fatalf("%s: %+v", tc.path, e)
		}
	}
	// Only the last user message counts.
	var ok chatCompletion
	decode(t, post(t, ts, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"[fail]"},{"role":"assistant","content":"x"},{"role":"user","content":"fine"}]}`), 200, &ok)
}

func TestSlowMarkerStream(t *testing.T) {
	t.Parallel()
	const delay = 40 * time.Millisecond
	// What the fake had written at each of its flushes: the chunks leave one by one if a flush
	// carries one content chunk, and another two, before the third is written. (Read from the
	// server's side: a client on a loaded machine may read chunks sent apart in one burst.)
	var mu sync.Mutex
	var flushed []string
	f := fakeupstream.New(fakeupstream.Options{SlowDelay: delay})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.ServeHTTP(&flushLog{ResponseWriter: w, onFlush: func(sofar string) {
			mu.Lock()
			flushed = append(flushed, sofar)
			mu.Unlock()
		}}, r)
	}))
	t.Cleanup(ts.Close)
	start := time.Now()
	frames := readSSE(t, post(t, ts, "/v1/chat/completions", `{"model":"m","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"[slow]"}]}`))
	var content []frame
	for _, f := range frames {
		if strings.Contains(f.data, `"content":"`) && !strings.Contains(f.data, `"content":""`) {
			content = append(content, f)
		}
	}
	if len(content) != 3 {
		t.Fatalf("%d content chunks", len(content))
	}
	if el := time.Since(start); el < 3*delay {
		t.Fatalf("stream of 3 slow chunks took %v, less than 3×%v", el, delay)
	}
	// Chunks leave one by one, not in one burst.
	mu.Lock()
	defer mu.Unlock()
	seen := map[int]bool{}
	for _, sofar := range flushed {
		seen[strings.Count(sofar, `"content":"`)-strings.Count(sofar, `"content":""`)] = true
	}
	if !seen[1] || !seen[2] {
		t.Fatalf("no flush with only the first, or the first two, content chunks: %q", flushed)
	}
}

// flushLog passes writes on and tells onFlush what was written before each flush.
type flushLog struct {
	http.ResponseWriter
	sofar   strings.Builder
	onFlush func(sofar string)
}

func (l *flushLog) Write(p []byte) (int, error) {
	l.sofar.Write(p)
	return l.ResponseWriter.Write(p)
}

func (l *flushLog) Flush() {
	l.onFlush(l.sofar.String())
	http.NewResponseController(l.ResponseWriter).Flush()
}

func TestSlowMarkerJSONDefaultDelay(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	start := time.Now()
	var got chatCompletion
	decode(t, post(t, ts, "/v1/chat/completions", `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"[slow]"}]}`), 200, &got)
	if el := time.Since(start); el < 400*time.Millisecond {
		t.Fatalf("2 slow words answered in %v, want ≥ 2×200ms", el)
	}
}

func TestHangMarker(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, path, body string }{
		{"chat-stream", "/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"[hang]"}]}`},
		{"chat-json", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"[hang]"}]}`},
		{"completions-stream", "/v1/completions", `{"model":"m","stream":true,"prompt":"[hang]"}`},
		{"responses-stream", "/v1/responses", `{"model":"m","stream":true,"input":"[hang]"}`},
		{"embeddings", "/v1/embeddings", `{"model":"m","input":"[hang]"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var finished atomic.Bool
			done := make(chan struct{})
			f := fakeupstream.New(fakeupstream.Options{})
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				defer close(done)
				f.ServeHTTP(w, r)
				finished.Store(true)
			}))
			defer ts.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			resp := postCtx(t, ctx, ts, tc.path, tc.body, nil)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			// One chunk arrives...
			buf := make([]byte, 4)
			if _, err := io.ReadFull(resp.Body, buf); err != nil {
				t.Fatalf("first bytes: %v", err)
			}
			// ...then nothing: the handler is still blocked.
			select {
			case <-done:
				t.Fatal("handler returned while the client was still connected")
			case <-time.After(150 * time.Millisecond):
			}
			cancel()
			select {
			case <-done:
			case <-time.After(time.Minute): // bounds a hang
				t.Fatal("handler did not return after the request context ended")
			}
			if !finished.Load() {
				t.Fatal("handler did not finish")
			}
		})
	}
}

// ---- observation knobs and errors ----

func TestRequestObservation(t *testing.T) {
	t.Parallel()
	var hooked atomic.Int64
	f, ts := newServer(t, fakeupstream.Options{OnRequest: func(r fakeupstream.Request) {
		if r.Path == "/v1/chat/completions" {
			hooked.Add(1)
		}
	}})
	if _, ok := f.LastRequest(); ok {
		t.Fatal("LastRequest before any request")
	}
	body := `{"model":"gpt-x","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`
	readSSE(t, postCtx(t, context.Background(), ts, "/v1/chat/completions", body, map[string]string{"Authorization": "Bearer upstream-key"}))
	last, ok := f.LastRequest()
	if !ok || last.Authorization != "Bearer upstream-key" || last.Model != "gpt-x" || !last.Stream ||
		!last.IncludeUsage || string(last.Body) != body || last.Method != "POST" {
		t.Fatalf("last request %+v", last)
	}
	post(t, ts, "/v1/embeddings", `{"model":"e","input":"x"}`)
	if f.Requests() != 2 || hooked.Load() != 1 || len(f.Seen()) != 2 || f.Seen()[1].Authorization != "" {
		t.Fatalf("requests %d, hooked %d, seen %+v", f.Requests(), hooked.Load(), f.Seen())
	}
	f.Reset()
	if f.Requests() != 0 || len(f.Seen()) != 0 {
		t.Fatal("Reset kept requests")
	}
}

func TestKeepRequestsBound(t *testing.T) {
	t.Parallel()
	f, ts := newServer(t, fakeupstream.Options{KeepRequests: 3})
	for i := 0; i < 5; i++ {
		post(t, ts, "/v1/embeddings", fmt.Sprintf(`{"model":"e%d","input":"x"}`, i))
	}
	seen := f.Seen()
	if len(seen) != 3 || seen[0].Model != "e2" || seen[2].Model != "e4" || f.Requests() != 5 {
		t.Fatalf("seen %d (%v…), requests %d", len(seen), seen[0].Model, f.Requests())
	}
}

func TestKeepRequestsNoneAndBodyCut(t *testing.T) {
	t.Parallel()
	var hookLen atomic.Int64
	f, ts := newServer(t, fakeupstream.Options{KeepRequests: -1, OnRequest: func(r fakeupstream.Request) { hookLen.Store(int64(len(r.Body))) }})
	post(t, ts, "/v1/embeddings", `{"model":"e","input":"x"}`)
	if _, ok := f.LastRequest(); ok || len(f.Seen()) != 0 || f.Requests() != 1 {
		t.Fatalf("KeepRequests -1 kept %d requests", len(f.Seen()))
	}
	g, ts2 := newServer(t, fakeupstream.Options{})
	big := `{"model":"e","input":"` + strings.Repeat("w ", 50000) + `"}`
	var got embeddingList
	decode(t, post(t, ts2, "/v1/embeddings", big), 200, &got)
	last, _ := g.LastRequest()
	if got.Usage.PromptTokens != 50000 || len(last.Body) != 64<<10 || !strings.HasPrefix(big, string(last.Body)) {
		t.Fatalf("prompt %d, kept body %d bytes", got.Usage.PromptTokens, len(last.Body))
	}
	post(t, ts, "/v1/embeddings", big)
	if hookLen.Load() != int64(len(big)) {
		t.Fatalf("OnRequest saw %d bytes, want the whole %d", hookLen.Load(), len(big))
	}
}

func TestAPIKeyOption(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{APIKey: "sk-up"})
	body := `{"model":"m","input":"x"}`
	var e apiError
	decode(t, postCtx(t, context.Background(), ts, "/v1/embeddings", body, map[string]string{"Authorization": "Bearer sk-client"}), 401, &e)
	if e.Error.Code == nil || *e.Error.Code != "invalid_api_key" {
		t.Fatalf("error %+v", e)
	}
	var ok embeddingList
	decode(t, postCtx(t, context.Background(), ts, "/v1/embeddings", body, map[string]string{"Authorization": "Bearer sk-up"}), 200, &ok)
}

func TestErrors(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{MaxBodyBytes: 1024})
	cases := []struct {
		name, path, body string
		status           int
		code             string
	}{
		{"unknown path", "/v1/images/variations", `{"model":"m"}`, 404, "unknown_url"},
		{"bad json", "/v1/chat/completions", `{"model":`, 400, ""},
		{"no model", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, 400, ""},
		{"no messages", "/v1/chat/completions", `{"model":"m","messages":[]}`, 400, "empty_array"},
		{"max_tokens 0", "/v1/chat/completions", `{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}`, 400, "integer_below_min_value"},
		{"n 0", "/v1/completions", `{"model":"m","n":0,"prompt":"x"}`, 400, "integer_out_of_range"},
		{"no prompt", "/v1/completions", `{"model":"m"}`, 400, ""},
		{"bad input", "/v1/embeddings", `{"model":"m","input":{"a":1}}`, 400, ""},
		{"no input", "/v1/responses", `{"model":"m"}`, 400, ""},
		{"bad dimensions", "/v1/embeddings", `{"model":"m","input":"x","dimensions":99999}`, 400, "integer_out_of_range"},
		{"too large", "/v1/embeddings", `{"model":"m","input":"` + strings.Repeat("x ", 1000) + `"}`, 413, "request_too_large"},
	}
	for _, tc := range cases {
		var e apiError
		decode(t, post(t, ts, tc.path, tc.body), tc.status, &e)
		if e.Error.Type != "invalid_request_error" || e.Error.Message == "" {
			t.Errorf("%s: %+v", tc.name, e)
		}
		if tc.code != "" && (e.Error.Code == nil || *e.Error.Code != tc.code) {
			t.Errorf("%s: code %v, want %s", tc.name, e.Error.Code, tc.code)
		}
	}
	resp, err := ts.Client().Get(ts.URL + "/v1/chat/completions")
	if err != nil {
		t.Fatal(err)
	}
	var e apiError
	decode(t, resp, 405, &e)
	_ = resp.Body.Close()
}
