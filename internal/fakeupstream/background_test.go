package fakeupstream_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestBackgroundResponses: a background response is queued, then in progress, then completed
// with its usage; [hold] runs until cancelled (input billed); [lose] is gone (404) once it ended;
// [bgfail] fails billing its input; EndBackground ends a held one, completed.
func TestBackgroundResponses(t *testing.T) {
	fake := fakeupstream.New(fakeupstream.Options{BackgroundDelay: 200 * time.Millisecond})
	srv := httptest.NewServer(fake)
	defer srv.Close()
	call := func(method, path, body string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		var out map[string]any
		_ = json.Unmarshal(b, &out)
		return res.StatusCode, out
	}
	start := func(input string) string {
		st, r := call("POST", "/v1/responses", `{"model":"m","background":true,"input":"`+input+`"}`)
		if st != 200 || r["status"] != "queued" || r["usage"] != nil {
			t.Fatalf("create %q: %d %v", input, st, r)
		}
		return r["id"].(string)
	}
	waitEnd := func(id string) (int, map[string]any) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			st, r := call("GET", "/v1/responses/"+id, "")
			if st != 200 || (r["status"] != "queued" && r["status"] != "in_progress") {
				return st, r
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s never ended: %v", id, r)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	usage := func(r map[string]any) (in, out float64) {
		u, _ := r["usage"].(map[string]any)
		in, _ = u["input_tokens"].(float64)
		out, _ = u["output_tokens"].(float64)
		return in, out
	}

	done := start("one two three")
	held := start("[hold] x")
	lost := start("[lose] y")
	failed := start("[bgfail] z")
	if st, r := waitEnd(done); st != 200 || r["status"] != "completed" || r["completed_at"] == nil {
		t.Fatalf("completed: %d %v", st, r)
	} else if in, out := usage(r); in != 3 || out != 20 {
		t.Fatalf("completed usage %v %v", in, out)
	}
	if st, r := waitEnd(failed); r["status"] != "failed" {
		t.Fatalf("failed: %d %v", st, r)
	} else if in, out := usage(r); in != 2 || out != 0 {
		t.Fatalf("failed usage %v %v", in, out)
	}
	if st, _ := waitEnd(lost); st != http.StatusNotFound {
		t.Fatalf("lost: %d, want 404", st)
	}
	if st, r := call("GET", "/v1/responses/"+held, ""); st != 200 || r["status"] != "in_progress" {
		t.Fatalf("[hold] after the delay: %d %v", st, r)
	}
	if st, r := call("POST", "/v1/responses/"+held+"/cancel", ""); st != 200 || r["status"] != "cancelled" {
		t.Fatalf("cancel: %d %v", st, r)
	} else if in, out := usage(r); in != 2 || out != 0 {
		t.Fatalf("cancelled usage %v %v", in, out)
	}
	ended := start("[hold] w")
	if st, r := waitEnd(done); st != 200 {
		t.Fatalf("%d %v", st, r)
	}
	if st, r := call("GET", "/v1/responses/"+ended, ""); st != 200 || r["status"] == "completed" {
		t.Fatalf("[hold] before EndBackground: %d %v", st, r)
	}
	if !fake.EndBackground(ended) {
		t.Fatal("EndBackground of a held response: false")
	}
	if st, r := call("GET", "/v1/responses/"+ended, ""); st != 200 || r["status"] != "completed" || r["completed_at"] == nil {
		t.Fatalf("[hold] after EndBackground: %d %v", st, r)
	} else if in, out := usage(r); in != 2 || out != 20 {
		t.Fatalf("ended usage %v %v", in, out)
	}
	if fake.EndBackground(ended) || fake.EndBackground(held) || fake.EndBackground(done) {
		t.Fatal("EndBackground of a response that is not held and running: true")
	}
	if st, r := call("GET", "/v1/responses/"+held+"/input_items", ""); st != 200 || !strings.Contains(toJSON(r), "[hold] x") {
		t.Fatalf("input items: %d %v", st, r)
	}
	if st, _ := call("DELETE", "/v1/responses/"+done, ""); st != 200 {
		t.Fatalf("delete: %d", st)
	}
	if st, _ := call("GET", "/v1/responses/"+done, ""); st != http.StatusNotFound {
		t.Fatalf("after delete: %d, want 404", st)
	}
}

func toJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
