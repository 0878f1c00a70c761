package middleware

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/labstack/echo/v4"
)

func TestSetTopString(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{`{"model":"a","x":1}`, `{"model":"b<&>","x":1}`},
		{` { "x" : {"model":"keep"} , "model" : "a" } `, ` { "x" : {"model":"keep"} , "model" : "b<&>" } `},
		{`{"mod\u0065l":"a","messages":[]}`, `{"mod\u0065l":"b<&>","messages":[]}`},
		{`{"x":"model"}`, `{"x":"model"}`},
	} {
		got := string(setTopString([]byte(tc.in), "model", "b<&>"))
		want := strings.ReplaceAll(tc.want, "b<&>", `b\u003c\u0026\u003e`)
		if got != want {
			t.Errorf("%s: %s, want %s", tc.in, got, want)
		}
	}
}

// TestRouteRename: the upstream gets the route's model name in the body's one "model" member
// (also when the client escaped the key), everything else byte for byte, while the request is
// priced and recorded as the model the client asked for.
func TestRouteRename(t *testing.T) {
	t.Parallel()
	var asked []string
	e := newEnv(t, envOpt{cfg: func(c *Config) {
		c.Route = func(c echo.Context, model string) (string, error) {
			asked = append(asked, model)
			c.Set("route", "seen")
			return "upstream-dear-model", nil
		}
	}})
	for _, body := range []string{
		`{"model":"` + testModel + `","messages":[{"role":"user","content":"model"}],"max_tokens":5}`,
		`{"mod\u0065l":"` + testModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`,
	} {
		resp := e.post(context.Background(), EndpointChat, e.key, body)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		o := e.outcome()
		if resp.StatusCode != 200 || o.Kind != OutcomeRecorded || o.Model != testModel || o.Cost != cost(t, chatUsage) {
			t.Fatalf("%s: %d %+v", body, resp.StatusCode, o)
		}
		ups := e.upstreamRequests()
		got := string(ups[len(ups)-1].Body)
		want := strings.Replace(body, `"`+testModel+`"`, `"upstream-dear-model"`, 1)
		if got != want {
			t.Fatalf("upstream body %s, want %s", got, want)
		}
		for _, ev := range e.rec.events() {
			if ev.Model != testModel {
				t.Fatalf("event priced as %q, want the requested %q", ev.Model, testModel)
			}
		}
	}
	if len(asked) != 2 || asked[0] != testModel || asked[1] != testModel {
		t.Fatalf("Route asked for %q", asked)
	}
}

// TestRouteRefusal: a model without a route is refused with the Route's error (or 503 for an
// error that is not an *Error) before anything is held or sent upstream.
func TestRouteRefusal(t *testing.T) {
	t.Parallel()
	var fail error = &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: CodeModelNotFound, Message: "no route"}
	e := newEnv(t, envOpt{cfg: func(c *Config) {
		c.Route = func(echo.Context, string) (string, error) { return "", fail }
	}})
	body := `{"model":"` + testModel + `","messages":[{"role":"user","content":"hi"}]}`
	resp := e.post(context.Background(), EndpointChat, e.key, body)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if o := e.outcome(); resp.StatusCode != 404 || o.Kind != OutcomeRefused || !strings.Contains(string(b), `"model_not_found"`) {
		t.Fatalf("%d %s %+v", resp.StatusCode, b, o)
	}
	fail = errors.New("table unreadable")
	resp = e.post(context.Background(), EndpointChat, e.key, body)
	resp.Body.Close()
	if o := e.outcome(); resp.StatusCode != 503 || o.Kind != OutcomeRefused {
		t.Fatalf("%d %+v", resp.StatusCode, o)
	}
	if ups := e.upstreamRequests(); len(ups) != 0 {
		t.Fatalf("upstream called: %+v", ups)
	}
	e.assertNothingDebited()
}

// TestPassThroughDir: "/v1/models/*" passes the paths below /v1/models, not /v1/models itself
// nor its look-alikes.
func TestPassThroughDir(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{cfg: func(c *Config) { c.PassThrough = []string{"/v1/models/*"} }})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) { _, _ = io.WriteString(w, `{}`) })
	for path, want := range map[string]int{"/v1/models/gpt-x": 200, "/v1/models/a/b": 200, "/v1/models": 404, "/v1/models/": 404, "/v1/modelsx/y": 404} {
		req, _ := http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
		req.Header.Set("Authorization", "Bearer "+e.key)
		resp, err := http.DefaultClient.Do(req)
		must(t, err)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("%s: %d, want %d", path, resp.StatusCode, want)
		}
		e.outcome()
	}
	e.assertNothingDebited()
}

// TestRouteCountTokens: with a Route, an unbilled count_tokens request is routed by its
// body's model (renamed like a priced request) and passed on; a model without a route, or a
// model member that is duplicated, misspelt in case or missing, is refused in Anthropic's
// shape before anything reaches the upstream; nothing is debited.
func TestRouteCountTokens(t *testing.T) {
	t.Parallel()
	var asked []string
	e := newEnv(t, envOpt{cfg: func(c *Config) {
		c.Route = func(c echo.Context, model string) (string, error) {
			asked = append(asked, model)
			if model == "claude-alias" {
				return "claude-real", nil
			}
			return "", &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: CodeModelNotFound, Message: "no route"}
		}
	}})
	e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
		_, _ = io.WriteString(w, `{"input_tokens":3}`)
	})
	resp := e.post(context.Background(), EndpointCountTokens, e.key, `{"model":"claude-alias","messages":[{"role":"user","content":"model"}]}`)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if o := e.outcome(); resp.StatusCode != 200 || o.Kind != OutcomePassed {
		t.Fatalf("routed: %d %+v", resp.StatusCode, o)
	}
	ups := e.upstreamRequests()
	if len(ups) != 1 || ups[0].Path != EndpointCountTokens || string(ups[0].Body) != `{"model":"claude-real","messages":[{"role":"user","content":"model"}]}` {
		t.Fatalf("upstream got %+v", ups)
	}
	for body, want := range map[string]int{
		`{"model":"gpt-x","messages":[]}`:                        404,
		`{"model":"claude-alias","Model":"gpt-x","messages":[]}`: 400,
		`{"model":"claude-alias","model":"claude-alias"}`:        400,
		`{"messages":[]}`: 400,
		`{"model":7}`:     400,
		`not json`:        400,
	} {
		resp := e.post(context.Background(), EndpointCountTokens, e.key, body)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if o := e.outcome(); resp.StatusCode != want || o.Kind != OutcomeRefused || !strings.HasPrefix(string(b), `{"type":"error","error":{"type":`) {
			t.Errorf("%s: %d %s %+v, want %d", body, resp.StatusCode, b, o, want)
		}
	}
	if ups := e.upstreamRequests(); len(ups) != 1 {
		t.Fatalf("refused requests reached the upstream: %+v", ups[1:])
	}
	if len(asked) != 2 {
		t.Errorf("Route asked for %q, want claude-alias and gpt-x", asked)
	}
	e.assertNothingDebited()
}
