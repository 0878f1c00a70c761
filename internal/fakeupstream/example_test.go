package fakeupstream_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// A chat completion whose usage is known in advance: 4 words in, max_tokens out.
func ExampleNew() {
	up := fakeupstream.New(fakeupstream.Options{})
	srv := httptest.NewServer(up)
	defer srv.Close()

	body := `{"model":"gpt-4o-mini","max_tokens":3,"messages":[{"role":"user","content":"What is escrow? [cached:2]"}]}`
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer upstream-key")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		Usage fakeupstream.ChatUsage `json:"usage"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	last, _ := up.LastRequest()

	fmt.Println(resp.StatusCode, out.Choices[0].Message.Content)
	fmt.Println("prompt", out.Usage.PromptTokens, "cached", out.Usage.PromptTokensDetails.CachedTokens,
		"completion", out.Usage.CompletionTokens, "total", out.Usage.TotalTokens)
	fmt.Println("upstream saw", last.Authorization, "requests:", up.Requests())
	// Output:
	// 200 tok1 tok2 tok3
	// prompt 4 cached 2 completion 3 total 7
	// upstream saw Bearer upstream-key requests: 1
}
