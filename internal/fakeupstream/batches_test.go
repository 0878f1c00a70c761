package fakeupstream

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

type batchClient struct {
	t   *testing.T
	s   *Server
	url string
}

func newBatchClient(t *testing.T) *batchClient {
	s := New(Options{APIKey: "k", BatchLineDelay: time.Millisecond})
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return &batchClient{t: t, s: s, url: srv.URL}
}

func (c *batchClient) do(method, path, ctype string, body []byte, out any) int {
	c.t.Helper()
	req, _ := http.NewRequest(method, c.url+path, bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer k")
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if out != nil {
		if p, ok := out.(*[]byte); ok {
			*p = b
		} else if err := json.Unmarshal(b, out); err != nil {
			c.t.Fatalf("%s %s: %d %s", method, path, res.StatusCode, b)
		}
	}
	return res.StatusCode
}

func (c *batchClient) upload(lines ...string) FileObject {
	c.t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	_ = mw.WriteField("purpose", "batch")
	fw, _ := mw.CreateFormFile("file", "in.jsonl")
	_, _ = io.WriteString(fw, strings.Join(lines, "\n")+"\n")
	_ = mw.Close()
	var f FileObject
	if st := c.do("POST", "/v1/files", mw.FormDataContentType(), buf.Bytes(), &f); st != 200 {
		c.t.Fatalf("upload: %d", st)
	}
	return f
}

func (c *batchClient) wait(id string) {
	c.t.Helper()
	select {
	case <-c.s.BatchDone(id):
	case <-time.After(30 * time.Second):
		c.t.Fatalf("batch %s did not end", id)
	}
}

// until polls cond with a generous deadline.
func until(t *testing.T, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("condition not met in time")
		}
	}
}

func chatLine(id, text string) string {
	return `{"custom_id":"` + id + `","method":"POST","url":"/v1/chat/completions","body":{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"` + text + `"}]}}`
}

// fileLines reads a JSONL file's lines by custom_id.
func (c *batchClient) fileLines(id *string) map[string]map[string]any {
	c.t.Helper()
	out := map[string]map[string]any{}
	if id == nil {
		return out
	}
	var b []byte
	if st := c.do("GET", "/v1/files/"+*id+"/content", "", nil, &b); st != 200 {
		c.t.Fatalf("content: %d", st)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			c.t.Fatal(err)
		}
		out[m["custom_id"].(string)] = m
	}
	return out
}

// TestBatchCompleted: each line runs through the live handler (same usage as sent live), a
// failing line goes to the error file.
func TestBatchCompleted(t *testing.T) {
	t.Parallel()
	c := newBatchClient(t)
	f := c.upload(chatLine("a", "one two three"), chatLine("b", "x [fail]"), chatLine("c", "one"))
	var b Batch
	if st := c.do("POST", "/v1/batches", "application/json", []byte(`{"input_file_id":"`+f.ID+`","endpoint":"/v1/chat/completions","completion_window":"24h"}`), &b); st != 200 {
		t.Fatalf("create: %d", st)
	}
	c.wait(b.ID)
	c.do("GET", "/v1/batches/"+b.ID, "", nil, &b)
	if b.Status != "completed" || b.RequestCounts != (BatchCounts{Total: 3, Completed: 2, Failed: 1}) {
		t.Fatalf("%+v", b)
	}
	out, errs := c.fileLines(b.OutputFileID), c.fileLines(b.ErrorFileID)
	if len(out) != 2 || len(errs) != 1 || errs["b"] == nil {
		t.Fatalf("out %v errs %v", out, errs)
	}
	usage := out["a"]["response"].(map[string]any)["body"].(map[string]any)["usage"].(map[string]any)
	if usage["prompt_tokens"].(float64) != 3 || usage["completion_tokens"].(float64) != 5 {
		t.Fatalf("usage %v", usage)
	}
	if st := c.do("GET", "/v1/batches/nope", "", nil, nil); st != 404 {
		t.Fatalf("unknown batch: %d", st)
	}
	if st := c.do("DELETE", "/v1/files/"+f.ID, "", nil, nil); st != 200 {
		t.Fatalf("delete: %d", st)
	}
	if st := c.do("GET", "/v1/files/"+f.ID, "", nil, nil); st != 404 {
		t.Fatalf("deleted file: %d", st)
	}
}

// TestBatchEnds: expired with the lines before [batch_expire] done, cancelled at
// [batch_pause], failed validation with nothing run.
func TestBatchEnds(t *testing.T) {
	t.Parallel()
	c := newBatchClient(t)
	create := func(lines ...string) Batch {
		f := c.upload(lines...)
		var b Batch
		c.do("POST", "/v1/batches", "application/json", []byte(`{"input_file_id":"`+f.ID+`","endpoint":"/v1/chat/completions","completion_window":"24h"}`), &b)
		return b
	}
	b := create(chatLine("a", "one"), chatLine("b", "[batch_expire]"), chatLine("c", "two"))
	c.wait(b.ID)
	c.do("GET", "/v1/batches/"+b.ID, "", nil, &b)
	if out, errs := c.fileLines(b.OutputFileID), c.fileLines(b.ErrorFileID); b.Status != "expired" || len(out) != 1 || out["a"] == nil || len(errs) != 2 {
		t.Fatalf("expired: %+v %v %v", b, out, errs)
	}

	b = create(chatLine("a", "one"), chatLine("b", "[batch_pause]"), chatLine("c", "two"))
	until(t, func() bool { c.do("GET", "/v1/batches/"+b.ID, "", nil, &b); return b.RequestCounts.Completed == 1 })
	c.do("POST", "/v1/batches/"+b.ID+"/cancel", "", nil, &b)
	if b.Status != "cancelling" {
		t.Fatalf("cancel: %+v", b)
	}
	c.wait(b.ID)
	c.do("GET", "/v1/batches/"+b.ID, "", nil, &b)
	if out := c.fileLines(b.OutputFileID); b.Status != "cancelled" || len(out) != 1 || out["a"] == nil {
		t.Fatalf("cancelled: %+v %v", b, out)
	}

	b = create(chatLine("a", "one"), chatLine("b", "[batch_invalid]"))
	c.wait(b.ID)
	if b.Status != "failed" || b.Errors == nil || len(b.Errors.Data) != 1 || *b.Errors.Data[0].Line != 2 || b.OutputFileID != nil {
		t.Fatalf("failed: %+v", b)
	}
}

// TestMessageBatch: Anthropic's batch with inline requests: results by custom_id, cancel,
// delete once ended.
func TestMessageBatch(t *testing.T) {
	t.Parallel()
	c := newBatchClient(t)
	body := `{"requests":[{"custom_id":"a","params":{"model":"claude","max_tokens":4,"messages":[{"role":"user","content":"one two"}]}},` +
		`{"custom_id":"b","params":{"model":"claude","max_tokens":4,"messages":[{"role":"user","content":"[batch_pause]"}]}}]}`
	var b MessageBatch
	if st := c.do("POST", "/v1/messages/batches", "application/json", []byte(body), &b); st != 200 || b.ProcessingStatus != "in_progress" {
		t.Fatalf("create: %d %+v", st, b)
	}
	if st := c.do("DELETE", "/v1/messages/batches/"+b.ID, "", nil, nil); st != 400 {
		t.Fatalf("delete while running: %d", st)
	}
	until(t, func() bool {
		c.do("GET", "/v1/messages/batches/"+b.ID, "", nil, &b)
		return b.RequestCounts.Succeeded == 1
	})
	c.do("POST", "/v1/messages/batches/"+b.ID+"/cancel", "", nil, &b)
	c.wait(b.ID)
	var res []byte
	c.do("GET", "/v1/messages/batches/"+b.ID+"/results", "", nil, &res)
	lines := strings.Split(strings.TrimSpace(string(res)), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"type":"succeeded"`) || !strings.Contains(lines[0], `"input_tokens":2`) ||
		!strings.Contains(lines[1], `"type":"canceled"`) {
		t.Fatalf("results: %s", res)
	}
	if st := c.do("DELETE", "/v1/messages/batches/"+b.ID, "", nil, nil); st != 200 {
		t.Fatalf("delete: %d", st)
	}
	if st := c.do("GET", "/v1/messages/batches/"+b.ID, "", nil, nil); st != 404 {
		t.Fatalf("deleted: %d", st)
	}
}
