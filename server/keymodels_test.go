package server

import (
	"bytes"
	"net/http"
	"testing"
	"time"
)

// TestKeyModelsProxy (issue 36): a key limited to models ("m" and the prefix "claude-*") gets its
// models; any other model, priced or not, is answered exactly as a model that does not exist
// (404 model_not_found, the same body), with nothing held or charged; another key of the org is
// not limited; lifting the list lets the key use every model again.
func TestKeyModelsProxy(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		p := startTestProxy(t, real, func(c *Config) { c.KeyCacheTTL = time.Nanosecond }) // the list is read at each request
		limited := p.setup("acme", 10_000, 65)
		for _, m := range []string{"other", "claude-x"} {
			p.admin("PUT", "/models/"+m, map[string]any{"input_price": 0, "output_price": 1_000_000,
				"max_input_tokens": 100_000, "max_output_tokens": 65, "max_cost": 65, "default_hold": 65}, http.StatusOK, nil)
		}
		var keys struct {
			Data []struct{ ID string } `json:"data"`
		}
		p.admin("GET", "/orgs/acme/keys", nil, http.StatusOK, &keys)
		var free struct{ Key string }
		p.admin("POST", "/orgs/acme/keys", nil, http.StatusCreated, &free)
		p.admin("PUT", "/keys/"+keys.Data[0].ID+"/models", map[string]any{"models": []string{"m", "claude-*"}}, http.StatusOK, nil)

		req := func(key, model string) (int, []byte) {
			st, _, b := p.do("POST", "/v1/chat/completions", key, map[string]any{"model": model,
				"messages": []map[string]string{{"role": "user", "content": "hi"}}})
			return st, b
		}
		for _, m := range []string{"m", "claude-x"} {
			if st, b := req(limited, m); st != http.StatusOK {
				t.Fatalf("real=%v: allowed model %s: %d %s", real, m, st, b)
			}
		}
		stAbsent, absent := req(limited, "no-such-model")
		stOther, other := req(limited, "other")
		if stAbsent != http.StatusNotFound || stOther != http.StatusNotFound ||
			!bytes.Equal(bytes.ReplaceAll(other, []byte("'other'"), []byte("'no-such-model'")), absent) ||
			!bytes.Contains(other, []byte(`"code":"model_not_found"`)) {
			t.Fatalf("real=%v: model outside the list: %d %s; absent model: %d %s", real, stOther, other, stAbsent, absent)
		}
		if st, b := req(free.Key, "other"); st != http.StatusOK {
			t.Fatalf("real=%v: a key without a list: %d %s", real, st, b)
		}
		b := p.settled("acme")
		if b.LedgerBalance != 10_000-3*20 {
			t.Fatalf("real=%v: %+v: want 3 requests charged", real, b)
		}
		var lifted struct{ Models []string }
		p.admin("PUT", "/keys/"+keys.Data[0].ID+"/models", map[string]any{"models": nil}, http.StatusOK, &lifted)
		if st, b := req(limited, "other"); st != http.StatusOK || len(lifted.Models) != 0 {
			t.Fatalf("real=%v: after lifting the list: %d %s", real, st, b)
		}
	}
}
