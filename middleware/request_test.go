package middleware

import (
	"encoding/json"
	"github.com/llmescrow/escrow/endpoint"
	"slices"
	"strings"
	"testing"

	"github.com/tidwall/gjson"
)

func TestParseRequest(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, endpoint, body string
		want                 Request // Size and Endpoint are filled in
	}{
		{"minimal chat", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
			Request{Model: "m", N: 1, Bounded: true}},
		{"stream with usage and cap", EndpointChat,
			`{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":50,"n":3,"messages":[]}`,
			Request{Model: "m", Stream: true, IncludeUsage: true, OutputCap: 50, N: 3, Bounded: true}},
		{"largest cap wins", EndpointChat, `{"model":"m","max_tokens":10,"max_completion_tokens":70}`,
			Request{Model: "m", OutputCap: 70, N: 1, Bounded: true}},
		{"best_of above n", EndpointCompletions, `{"model":"m","prompt":"x","n":2,"best_of":5,"max_tokens":9}`,
			Request{Model: "m", OutputCap: 9, N: 5, Bounded: true}},
		{"nulls are absent", EndpointChat, `{"model":"m","stream":null,"stream_options":null,"max_tokens":null,"n":null,"audio":null,"service_tier":null,"tools":null}`,
			Request{Model: "m", N: 1, Bounded: true}},
		{"text parts are plain", EndpointChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`,
			Request{Model: "m", N: 1, Bounded: true}},
		// Issue 32: an image in the body is bounded by the image rule of its detail.
		{"image part is bounded", EndpointChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x"}}]}]}`,
			Request{Model: "m", N: 1, Bounded: true, ImagesHigh: 1}},
		{"low detail image", EndpointChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://x","detail":"low"}}]}]}`,
			Request{Model: "m", N: 1, Bounded: true, ImagesLow: 1}},
		{"file part is not bounded", EndpointChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"file","file":{"file_id":"f"}}]}]}`,
			Request{Model: "m", N: 1}},
		{"responses input text", EndpointResponses, `{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]}],"max_output_tokens":5}`,
			Request{Model: "m", N: 1, OutputCap: 5, Bounded: true}},
		{"responses file is not plain", EndpointResponses, `{"model":"m","input":[{"role":"user","content":[{"type":"input_file","file_id":"f"}]}]}`,
			Request{Model: "m", N: 1}},
		{"item reference is not plain", EndpointResponses, `{"model":"m","input":[{"type":"item_reference","id":"x"}]}`,
			Request{Model: "m", N: 1}},
		{"previous_response_id is not plain", EndpointResponses, `{"model":"m","input":"hi","previous_response_id":"r"}`,
			Request{Model: "m", N: 1}},
		{"unknown field is not plain", EndpointChat, `{"model":"m","foo":1}`, Request{Model: "m", N: 1}},
		{"function tool is plain", EndpointChat, `{"model":"m","tools":[{"type":"function","function":{"name":"f"}}]}`,
			Request{Model: "m", N: 1, Bounded: true, Tools: true}},
		{"functions are bounded", EndpointChat, `{"model":"m","functions":[{"name":"f","parameters":{}}]}`,
			Request{Model: "m", N: 1, Bounded: true, Tools: true}},
		{"hosted tool", EndpointResponses, `{"model":"m","tools":[{"type":"web_search"},{"type":"function"}]}`,
			Request{Model: "m", N: 1, Tools: true, Features: []string{"tool:web_search"}}},
		{"audio", EndpointChat, `{"model":"m","modalities":["text","audio"],"audio":{"voice":"x"}}`,
			Request{Model: "m", N: 1, Features: []string{"audio"}}},
		{"priority tier", EndpointChat, `{"model":"m","service_tier":"priority"}`,
			Request{Model: "m", N: 1, Bounded: true, Features: []string{"service_tier:priority"}}},
		{"auto tier", EndpointChat, `{"model":"m","service_tier":"auto"}`, Request{Model: "m", N: 1, Bounded: true}},
		{"web_search_options", EndpointChat, `{"model":"m","web_search_options":{}}`,
			Request{Model: "m", N: 1, Features: []string{"tool:web_search"}}},
		{"background", EndpointResponses, `{"model":"m","background":true}`, Request{Model: "m", N: 1, Background: true}},
		{"embeddings tokens", EndpointEmbeddings, `{"model":"e","input":[[1,2,3],[4]]}`, Request{Model: "e", N: 1, Bounded: true}},
		{"escaped key", EndpointChat, `{"mod\u0065l":"m"}`, Request{Model: "m", N: 1, Bounded: true}},
		{"stored prompt is not plain", EndpointResponses, `{"model":"m","prompt":{"id":"pmpt_1"},"max_output_tokens":5}`,
			Request{Model: "m", N: 1, OutputCap: 5}},
		{"completions prompt is plain", EndpointCompletions, `{"model":"m","prompt":["a",[1,2]],"max_tokens":5}`,
			Request{Model: "m", N: 1, OutputCap: 5, Bounded: true}},
		{"function_call_output string is plain", EndpointResponses,
			`{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":"42"}]}`, Request{Model: "m", N: 1, Bounded: true}},
		{"function_call_output image is bounded", EndpointResponses,
			`{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":[{"type":"input_image","image_url":"u","detail":"low"}]}]}`,
			Request{Model: "m", N: 1, Bounded: true, ImagesLow: 1}},
		{"uploaded image is not bounded", EndpointResponses,
			`{"model":"m","input":[{"type":"function_call_output","call_id":"c","output":[{"type":"input_image","file_id":"f"}]}]}`,
			Request{Model: "m", N: 1}},
		{"responses output_text is plain", EndpointResponses,
			`{"model":"m","input":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"b","annotations":[]}]}]}`,
			Request{Model: "m", N: 1, Bounded: true}},
		{"chat text part on responses is not plain", EndpointResponses,
			`{"model":"m","input":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`, Request{Model: "m", N: 1}},
		{"input_text part on chat is not plain", EndpointChat,
			`{"model":"m","messages":[{"role":"user","content":[{"type":"input_text","text":"a"}]}]}`, Request{Model: "m", N: 1}},
		{"text part with a file id is not plain", EndpointResponses,
			`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a","file_id":"f"}]}]}`, Request{Model: "m", N: 1}},
		{"unknown item field is not plain", EndpointChat, `{"model":"m","messages":[{"role":"user","content":"a","attachments":[1]}]}`,
			Request{Model: "m", N: 1}},
		{"audio input part", EndpointChat,
			`{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"x","format":"wav"}}]}]}`,
			Request{Model: "m", N: 1, Features: []string{"audio"}}},
		{"hosted tool_choice", EndpointResponses, `{"model":"m","input":"hi","tool_choice":{"type":"web_search_preview"}}`,
			Request{Model: "m", N: 1, Features: []string{"tool:web_search_preview"}}},
		{"function tool_choice", EndpointChat, `{"model":"m","tool_choice":{"type":"function","function":{"name":"f"}}}`,
			Request{Model: "m", N: 1, Bounded: true}},
		{"variants inside metadata are nobody's business", EndpointChat, `{"model":"m","metadata":{"Model":"x","N":"2","a":"1","a":"2"}}`,
			Request{Model: "m", N: 1, Bounded: true}},
		{"unknown field variants are unknown", EndpointChat, `{"model":"m","Foo":1,"foo":2}`, Request{Model: "m", N: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, e := parseRequest(tt.endpoint, []byte(tt.body))
			if e != nil {
				t.Fatalf("error %v", e)
			}
			tt.want.Spec, tt.want.Size = endpoint.Lookup(tt.endpoint), len(tt.body)
			if got.Model != tt.want.Model || got.Stream != tt.want.Stream || got.IncludeUsage != tt.want.IncludeUsage ||
				got.OutputCap != tt.want.OutputCap || got.N != tt.want.N || got.Background != tt.want.Background ||
				got.Bounded != tt.want.Bounded || !slices.Equal(got.Features, tt.want.Features) ||
				got.Size != tt.want.Size || got.Spec != tt.want.Spec {
				t.Fatalf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseRequestErrors(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, body, code, param string }{
		{"not json", `{"model":`, CodeInvalidJSON, ""},
		{"array", `[1]`, CodeInvalidJSON, ""},
		{"empty", ``, CodeInvalidJSON, ""},
		{"no model", `{"messages":[]}`, CodeMissingField, "model"},
		{"model not string", `{"model":3}`, CodeInvalidValue, "model"},
		{"empty model", `{"model":""}`, CodeInvalidValue, "model"},
		{"duplicate model", `{"model":"cheap","model":"dear"}`, CodeInvalidValue, "model"},
		{"duplicate escaped model", `{"model":"cheap","mod\u0065l":"dear"}`, CodeInvalidValue, "model"},
		{"duplicate include_usage", `{"model":"m","stream_options":{"include_usage":true,"include_usage":false}}`, CodeInvalidValue, "stream_options.include_usage"},
		{"stream string", `{"model":"m","stream":"true"}`, CodeInvalidValue, "stream"},
		{"cap zero", `{"model":"m","max_tokens":0}`, CodeInvalidValue, "max_tokens"},
		{"cap negative", `{"model":"m","max_completion_tokens":-5}`, CodeInvalidValue, "max_completion_tokens"},
		{"cap fraction", `{"model":"m","max_completion_tokens":1.5}`, CodeInvalidValue, "max_completion_tokens"},
		// Issue 32: a cap field chat does not define is refused, never held.
		{"responses cap on chat", `{"model":"m","max_output_tokens":1}`, CodeUnsupportedParam, "max_output_tokens"},
		{"cap exponent", `{"model":"m","max_tokens":1e3}`, CodeInvalidValue, "max_tokens"},
		{"cap string", `{"model":"m","max_tokens":"10"}`, CodeInvalidValue, "max_tokens"},
		{"cap huge", `{"model":"m","max_tokens":99999999999999999999}`, CodeInvalidValue, "max_tokens"},
		{"n zero", `{"model":"m","n":0}`, CodeInvalidValue, "n"},
		{"stream_options array", `{"model":"m","stream_options":[]}`, CodeInvalidValue, "stream_options"},
		{"tools object", `{"model":"m","tools":{}}`, CodeInvalidValue, "tools"},
		{"background string", `{"model":"m","background":"yes"}`, CodeInvalidValue, "background"},
		{"case variant", `{"model":"m","Model":"x"}`, CodeInvalidValue, "Model"},
		{"long s variant", "{\"model\":\"m\",\"\u017ftream\":true}", CodeInvalidValue, "\u017ftream"},
		{"v2 variant", `{"model":"m","bestOf":3}`, CodeInvalidValue, "bestOf"},
		{"tool type duplicate", `{"model":"m","tools":[{"type":"function","type":"web_search"}]}`, CodeInvalidValue, "tools[0].type"},
		{"tool without type", `{"model":"m","tools":[{"function":{}}]}`, CodeMissingField, "tools[0].type"},
		{"tool type not a string", `{"model":"m","tools":[{"type":1}]}`, CodeInvalidValue, "tools[0].type"},
		{"tool not an object", `{"model":"m","tools":["web_search"]}`, CodeInvalidValue, "tools[0]"},
		{"part type variant", `{"model":"m","messages":[{"role":"user","content":[{"Type":"image_url"}]}]}`, CodeInvalidValue, "messages[0].content[0].Type"},
		{"single item variant", `{"model":"m","input":{"role":"user","Content":"x"}}`, CodeInvalidValue, "input.Content"},
		{"modalities string", `{"model":"m","modalities":"audio"}`, CodeInvalidValue, "modalities"},
		{"not utf-8", "{\"model\":\"m\xff\"}", CodeInvalidJSON, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, e := parseRequest(EndpointChat, []byte(tt.body))
			if e == nil {
				t.Fatal("no error")
			}
			if e.Status != 400 || e.Code != tt.code || e.Param != tt.param || e.Type != TypeInvalidRequest {
				t.Fatalf("got %+v, want 400 %s param %q", e, tt.code, tt.param)
			}
			var shape struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    *string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(e.Body(), &shape); err != nil || shape.Error.Message == "" || shape.Error.Code == nil {
				t.Fatalf("body %s: %v", e.Body(), err)
			}
		})
	}
}

func TestInjectIncludeUsage(t *testing.T) {
	t.Parallel()
	for _, body := range []string{
		`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`,
		`{"model":"m","stream":true,"stream_options":null}`,
		`{"model":"m","stream":true,"stream_options":{"include_usage":false}}`,
		`{"model":"m","stream":true,"stream_options":{"x":1}}`,
		`{ "model" : "m" , "stream" : true }`,
	} {
		out, err := injectIncludeUsage([]byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		r, e := parseRequest(EndpointChat, out)
		if e != nil || !r.IncludeUsage || !r.Stream || r.Model != "m" {
			t.Fatalf("%s -> %s: %+v %v", body, out, r, e)
		}
		// Nothing else changes: every other top-level field keeps its raw bytes.
		gjson.Parse(body).ForEach(func(k, v gjson.Result) bool {
			if k.String() != "stream_options" && gjson.GetBytes(out, k.String()).Raw != v.Raw {
				t.Errorf("%s: field %s changed in %s", body, k, out)
			}
			return true
		})
		if x := gjson.Get(body, "stream_options.x"); x.Exists() && gjson.GetBytes(out, "stream_options.x").Raw != x.Raw {
			t.Errorf("stream_options.x lost: %s", out)
		}
		if strings.Count(string(out), "include_usage") != 1 {
			t.Errorf("include_usage twice: %s", out)
		}
	}
}
