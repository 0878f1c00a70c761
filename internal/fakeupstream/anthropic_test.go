package fakeupstream

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func postAnthropic(t *testing.T, s *Server, path, body string) *http.Response {
	t.Helper()
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(body))
	req.Header.Set("x-api-key", "k")
	req.Header.Set("anthropic-version", "2023-06-01")
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = res.Body.Close() })
	return res
}

// TestAnthropicMessages: deterministic usage with cache writes and reads, as JSON and as a
// stream whose message_start and message_delta carry it; the x-api-key is accepted.
func TestAnthropicMessages(t *testing.T) {
	t.Parallel()
	s := New(Options{APIKey: "k"})
	body := `{"model":"claude-x","max_tokens":3,"system":"be brief please","messages":[{"role":"user","content":[{"type":"text","text":"one two three four five six [cache_write:2] [cached:4]"}]}]}`
	res := postAnthropic(t, s, "/v1/messages", body)
	var m AnthropicMessage
	if err := json.NewDecoder(res.Body).Decode(&m); err != nil || res.StatusCode != 200 {
		t.Fatalf("%d %v", res.StatusCode, err)
	}
	// 3 + 8 words = 11 input tokens: 2 written, 4 read, 5 plain.
	if want := (AnthropicUsage{InputTokens: 5, CacheCreationInputTokens: 2, CacheReadInputTokens: 4, OutputTokens: 3,
		CacheCreation: AnthropicCacheCreation{Ephemeral5mInputTokens: 2}}); m.Usage != want ||
		m.Content[0].Text != "tok1 tok2 tok3" || m.StopReason != "max_tokens" {
		t.Fatalf("reply %+v", m)
	}
	if seen, _ := s.LastRequest(); seen.Header.Get("Anthropic-Version") != "2023-06-01" {
		t.Fatalf("headers not kept: %v", seen.Header)
	}

	res = postAnthropic(t, s, "/v1/messages", strings.Replace(body, `"max_tokens":3`, `"max_tokens":3,"stream":true`, 1))
	raw, _ := io.ReadAll(res.Body)
	stream := string(raw)
	for _, want := range []string{
		`"usage":{"input_tokens":5,"cache_creation_input_tokens":2,"cache_read_input_tokens":4,"output_tokens":1,` +
			`"cache_creation":{"ephemeral_5m_input_tokens":2,"ephemeral_1h_input_tokens":0}}`,
		"event: message_delta\ndata: {\"delta\":{\"stop_reason\":\"max_tokens\",\"stop_sequence\":null},\"type\":\"message_delta\",\"usage\":{\"output_tokens\":3}}",
		"event: message_stop\n",
	} {
		if !strings.Contains(stream, want) {
			t.Fatalf("stream lacks %q:\n%s", want, stream)
		}
	}
	if strings.Count(stream, "event: content_block_delta") != 3 {
		t.Fatalf("stream:\n%s", stream)
	}
}

func TestAnthropicMessagesErrors(t *testing.T) {
	t.Parallel()
	s := New(Options{})
	res := postAnthropic(t, s, "/v1/messages", `{"model":"claude-x","messages":[{"role":"user","content":"hi"}]}`)
	raw, _ := io.ReadAll(res.Body)
	if res.StatusCode != 400 || !strings.Contains(string(raw), `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Field required"}}`) {
		t.Fatalf("no max_tokens: %d %s", res.StatusCode, raw)
	}
	res = postAnthropic(t, s, "/v1/messages", `{"model":"claude-x","max_tokens":1,"messages":[{"role":"user","content":"[fail]"}]}`)
	if res.StatusCode != 500 {
		t.Fatalf("[fail]: %d", res.StatusCode)
	}
	res = postAnthropic(t, s, "/v1/messages", `{"model":"claude-x","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"[error_after:2]"}]}`)
	raw, _ = io.ReadAll(res.Body)
	if st := string(raw); res.StatusCode != 200 || strings.Count(st, "event: content_block_delta") != 2 ||
		!strings.HasSuffix(st, "event: error\ndata: {\"error\":{\"message\":\"Overloaded\",\"type\":\"overloaded_error\"},\"type\":\"error\"}\n\n") ||
		strings.Contains(st, "message_delta") {
		t.Fatalf("[error_after:2]: %d\n%s", res.StatusCode, raw)
	}
	res = postAnthropic(t, s, "/v1/messages/count_tokens", `{"model":"claude-x","system":"a b","messages":[{"role":"user","content":"c d e"}]}`)
	raw, _ = io.ReadAll(res.Body)
	if res.StatusCode != 200 || strings.TrimSpace(string(raw)) != `{"input_tokens":5}` {
		t.Fatalf("count_tokens: %d %s", res.StatusCode, raw)
	}
}

// TestAnthropicCache1h: [cache_write_1h:N] makes N input tokens 1-hour cache writes, counted in
// cache_creation_input_tokens and split out in cache_creation.
func TestAnthropicCache1h(t *testing.T) {
	t.Parallel()
	s := New(Options{APIKey: "k"})
	body := `{"model":"claude-x","max_tokens":3,"system":"be brief please","messages":[{"role":"user","content":"one two three four five [cache_write:2] [cache_write_1h:3] [cached:4]"}]}`
	res := postAnthropic(t, s, "/v1/messages", body)
	var m AnthropicMessage
	if err := json.NewDecoder(res.Body).Decode(&m); err != nil || res.StatusCode != 200 {
		t.Fatalf("%d %v", res.StatusCode, err)
	}
	// 3 + 8 words = 11 input tokens: 2 written for 5 minutes, 3 for an hour, 4 read, 2 plain.
	if want := (AnthropicUsage{InputTokens: 2, CacheCreationInputTokens: 5, CacheReadInputTokens: 4, OutputTokens: 3,
		CacheCreation: AnthropicCacheCreation{Ephemeral5mInputTokens: 2, Ephemeral1hInputTokens: 3}}); m.Usage != want {
		t.Fatalf("usage %+v, want %+v", m.Usage, want)
	}
}
