package fakeupstream_test

import (
	"compress/gzip"
	"compress/zlib"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/andybalholm/brotli"
	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestEncodingMarker: [encoding:NAME] compresses the reply whatever Accept-Encoding says (gzip,
// deflate as zlib, br), JSON and streams alike; another NAME is only announced.
func TestEncodingMarker(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	identity := map[string]string{"Accept-Encoding": "identity"}
	for _, coding := range []string{"gzip", "deflate", "br", "zstd"} {
		for _, stream := range []bool{false, true} {
			body := `{"model":"m","max_tokens":3,"stream":` + map[bool]string{false: "false", true: "true"}[stream] +
				`,"messages":[{"role":"user","content":"[encoding:` + coding + `] hi"}]}`
			resp := postCtx(t, context.Background(), ts, "/v1/chat/completions", body, identity)
			if resp.StatusCode != 200 || resp.Header.Get("Content-Encoding") != coding {
				t.Fatalf("%s: %d %v", coding, resp.StatusCode, resp.Header)
			}
			var r io.Reader = resp.Body
			var err error
			switch coding {
			case "gzip":
				r, err = gzip.NewReader(r)
			case "deflate":
				r, err = zlib.NewReader(r)
			case "br":
				r = brotli.NewReader(r)
			}
			if err != nil {
				t.Fatal(err)
			}
			plain, err := io.ReadAll(r)
			if err != nil {
				t.Fatalf("%s: %v", coding, err)
			}
			if stream && !strings.HasSuffix(string(plain), "data: [DONE]\n\n") || !stream && !json.Valid(plain) {
				t.Fatalf("%s stream=%v: %.200s", coding, stream, plain)
			}
		}
	}
}

// TestLogprobs: chat logprobs carry one entry per output token with top_logprobs alternatives
// (capped at 20); Responses output_text carries them when included.
func TestLogprobs(t *testing.T) {
	t.Parallel()
	_, ts := newServer(t, fakeupstream.Options{})
	var c struct {
		Choices []struct {
			Logprobs struct {
				Content []struct {
					Token       string `json:"token"`
					Bytes       []int  `json:"bytes"`
					TopLogprobs []struct {
						Token string `json:"token"`
					} `json:"top_logprobs"`
				} `json:"content"`
			} `json:"logprobs"`
		} `json:"choices"`
	}
	decode(t, post(t, ts, "/v1/chat/completions", `{"model":"m","max_tokens":5,"n":2,"logprobs":true,"top_logprobs":50,"messages":[{"role":"user","content":"hi"}]}`), http.StatusOK, &c)
	if len(c.Choices) != 2 {
		t.Fatalf("%d choices", len(c.Choices))
	}
	for _, ch := range c.Choices {
		lp := ch.Logprobs.Content
		if len(lp) != 5 || lp[1].Token != " tok2" || len(lp[1].Bytes) != 5 || len(lp[1].TopLogprobs) != 20 {
			t.Fatalf("logprobs %+v", lp)
		}
	}
	var r struct {
		Output []struct {
			Content []struct {
				Logprobs []struct {
					TopLogprobs []struct{} `json:"top_logprobs"`
				} `json:"logprobs"`
			} `json:"content"`
		} `json:"output"`
	}
	decode(t, post(t, ts, "/v1/responses", `{"model":"m","input":"hi","max_output_tokens":4,"include":["message.output_text.logprobs"],"top_logprobs":3}`), http.StatusOK, &r)
	if lp := r.Output[0].Content[0].Logprobs; len(lp) != 4 || len(lp[0].TopLogprobs) != 3 {
		t.Fatalf("responses logprobs %+v", lp)
	}
}
