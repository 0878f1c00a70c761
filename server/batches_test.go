package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/fakeupstream"
	"github.com/llmescrow/escrow/ledger/job"
)

// batchProxy is a proxy whose upstream is a fake the test can look into, polling batches
// often.
type batchProxy struct {
	*testProxy
	fake *fakeupstream.Server
}

func startBatchProxy(t *testing.T, real bool) *batchProxy {
	fake := fakeupstream.New(fakeupstream.Options{KeepRequests: -1, BatchLineDelay: time.Millisecond})
	p := startTestProxyWith(t, real, []Option{WithUpstream(fake, "sk-fake-upstream")}, func(c *Config) {
		c.JobMinBackoff, c.JobMaxBackoff = 20*time.Millisecond, 100*time.Millisecond
	})
	return &batchProxy{testProxy: p, fake: fake}
}

// batchOrg makes an org with funds and a key, and the model "bm": input 2 and output 4 per
// token live, so a batch line costs 1 per input and 2 per output token (half).
func (p *batchProxy) batchOrg(org string, funds int64) string {
	p.admin("PUT", "/models/bm", map[string]any{"input_price": 2_000_000, "output_price": 4_000_000,
		"max_input_tokens": 100_000, "max_output_tokens": 100, "default_hold": 100}, http.StatusOK, nil)
	p.admin("POST", "/orgs", map[string]string{"id": org}, http.StatusCreated, nil)
	if funds > 0 {
		p.admin("POST", "/orgs/"+org+"/credits", map[string]any{"amount": funds, "reference": "init-" + org}, http.StatusCreated, nil)
	}
	var k struct{ ID, Key string }
	p.admin("POST", "/orgs/"+org+"/keys", nil, http.StatusCreated, &k)
	return k.Key
}

// line is one chat line of a batch input file; the fake answers max_tokens words (its
// default of 20 is cut to the cap) unless a marker says otherwise.
func line(id, text string, maxTokens int) string {
	b, _ := json.Marshal(map[string]any{"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
		"body": map[string]any{"model": "bm", "max_tokens": maxTokens, "messages": []map[string]string{{"role": "user", "content": text}}}})
	return string(b)
}

// lineCost is what a chat line of in words and out output tokens costs at bm's batch prices.
func lineCost(in, out int64) int64 { return in*1 + out*2 }

func (p *batchProxy) upload(key string, lines ...string) (int, []byte) {
	p.t.Helper()
	var buf bytes.Buffer
	mw := multipart.NewWriter(&buf)
	fw, _ := mw.CreateFormFile("file", "input.jsonl")
	_, _ = io.WriteString(fw, strings.Join(lines, "\n")+"\n")
	_ = mw.WriteField("purpose", "batch") // after the file, as the openai SDKs send it
	_ = mw.Close()
	req, _ := http.NewRequest("POST", p.base+"/v1/files", &buf)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	req.Header.Set("Authorization", "Bearer "+key)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		p.t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, b
}

// createBatch uploads lines and creates their batch; it returns the batch id.
func (p *batchProxy) createBatch(key string, lines ...string) string {
	p.t.Helper()
	st, b := p.upload(key, lines...)
	if st != http.StatusOK {
		p.t.Fatalf("upload: %d %s", st, b)
	}
	var f struct{ ID string }
	_ = json.Unmarshal(b, &f)
	st, _, b = p.do("POST", "/v1/batches", key, map[string]any{"input_file_id": f.ID, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
	var bt struct{ ID string }
	if err := json.Unmarshal(b, &bt); st != http.StatusOK || err != nil || bt.ID == "" {
		p.t.Fatalf("create batch: %d %s", st, b)
	}
	return bt.ID
}

// settledJob waits until the batch's job is settled and returns it.
func (p *batchProxy) settledJob(kind job.Kind, id string) job.Job {
	p.t.Helper()
	js := p.app.ledger.(job.Store)
	deadline := time.Now().Add(60 * time.Second)
	for {
		j, err := js.JobByUpstream(context.Background(), kind, id)
		if err == nil && !j.Live() {
			return j
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("batch %s never settled: %+v %v", id, j, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// wantCharged checks that the org paid exactly cost over its funds and holds nothing.
func (p *batchProxy) wantCharged(org string, funds, cost int64) {
	p.t.Helper()
	if b := p.settled(org); b.LedgerBalance != funds-cost || b.Available != funds-cost || b.Held != 0 {
		p.t.Fatalf("%s: %+v, want ledger = available = %d (credit %d − billed %d), nothing held", org, b, funds-cost, funds, cost)
	}
}

// TestBatchesBilledPerLine: over HTTP against the fake upstream, batches that complete (one
// line failing), expire with part of their lines done, are cancelled with part done, or fail
// validation are each charged exactly the usage of the lines that ran, once; nothing else
// stays held and the ledger is the credit less what was billed.
func TestBatchesBilledPerLine(t *testing.T) {
	t.Parallel()
	for _, real := range []bool{true, false} {
		t.Run(fmt.Sprint("real=", real), func(t *testing.T) {
			t.Parallel()
			p := startBatchProxy(t, real)
			const funds = 100_000

			// Completed: a ran (3 in, 10 out), b failed (500: nothing), c ran (1 in, 4 out).
			key := p.batchOrg("done", funds)
			id := p.createBatch(key, line("a", "one two three", 10), line("b", "x [fail]", 10), line("c", "one", 4))
			j := p.settledJob(job.OpenAIBatch, id)
			if j.Status != job.Completed {
				t.Fatalf("completed: %+v", j)
			}
			p.wantCharged("done", funds, lineCost(3, 10)+lineCost(1, 4))

			// Expired on reaching b: a ran, b and c did not.
			key = p.batchOrg("exp", funds)
			id = p.createBatch(key, line("a", "one two", 5), line("b", "[batch_expire]", 5), line("c", "one", 5))
			if j := p.settledJob(job.OpenAIBatch, id); j.Status != job.Expired {
				t.Fatalf("expired: %+v", j)
			}
			p.wantCharged("exp", funds, lineCost(2, 5))

			// Cancelled while paused at b: a ran.
			key = p.batchOrg("cxl", funds)
			id = p.createBatch(key, line("a", "one two", 6), line("b", "[batch_pause]", 5), line("c", "one", 5))
			until(t, func() bool {
				_, _, b := p.do("GET", "/v1/batches/"+id, key, nil)
				return strings.Contains(string(b), `"completed":1`)
			})
			if st, _, b := p.do("POST", "/v1/batches/"+id+"/cancel", key, nil); st != http.StatusOK {
				t.Fatalf("cancel: %d %s", st, b)
			}
			if j := p.settledJob(job.OpenAIBatch, id); j.Status != job.Cancelled {
				t.Fatalf("cancelled: %+v", j)
			}
			p.wantCharged("cxl", funds, lineCost(2, 6))

			// Failed validation upstream: nothing ran, nothing is charged.
			key = p.batchOrg("fail", funds)
			id = p.createBatch(key, line("a", "one", 5), line("b", "[batch_invalid]", 5))
			if j := p.settledJob(job.OpenAIBatch, id); j.Status != job.Failed || j.Cost != 0 {
				t.Fatalf("failed: %+v", j)
			}
			p.wantCharged("fail", funds, 0)

			// Anthropic, inline: a succeeded (2 in, 7 out), b errored.
			key = p.batchOrg("anth", funds)
			body := `{"requests":[{"custom_id":"a","params":{"model":"bm","max_tokens":7,"messages":[{"role":"user","content":"one two"}]}},` +
				`{"custom_id":"b","params":{"model":"bm","max_tokens":7,"messages":[{"role":"user","content":"x [fail]"}]}}]}`
			st, _, b := p.do("POST", "/v1/messages/batches", key, body)
			var mb struct{ ID string }
			if err := json.Unmarshal(b, &mb); st != http.StatusOK || err != nil || mb.ID == "" {
				t.Fatalf("message batch: %d %s", st, b)
			}
			if j := p.settledJob(job.AnthropicBatch, mb.ID); j.Status != job.Completed {
				t.Fatalf("message batch: %+v", j)
			}
			// Its results_url is escrow's own route (the SDKs send the client's key there).
			_, _, b = p.do("GET", "/v1/messages/batches/"+mb.ID, key, nil)
			var got struct {
				ResultsURL string `json:"results_url"`
			}
			if err := json.Unmarshal(b, &got); err != nil || got.ResultsURL != p.base+"/v1/messages/batches/"+mb.ID+"/results" {
				t.Fatalf("results_url: %s", b)
			}
			if st, _, b := p.do("GET", "/v1/messages/batches/"+mb.ID+"/results", key, nil); st != http.StatusOK || !strings.Contains(string(b), `"succeeded"`) {
				t.Fatalf("results: %d %s", st, b)
			}
			p.wantCharged("anth", funds, lineCost(2, 7))
		})
	}
}

// until polls cond with a generous deadline.
func until(t *testing.T, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(60 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("condition not met in time")
		}
	}
}

// TestBatchRefusals: a bad line is a 400 naming it and nothing is stored, upstream or in the
// ledger; a batch whose bound the balance does not cover is refused with the numbers and
// holds nothing.
func TestBatchRefusals(t *testing.T) {
	t.Parallel()
	p := startBatchProxy(t, false)
	key := p.batchOrg("acme", 1_000)
	bad := `{"custom_id":"b","method":"POST","url":"/v1/chat/completions","body":{"model":"bm","max_output_tokens":5,"messages":[{"role":"user","content":"x"}]}}`
	st, b := p.upload(key, line("a", "one", 5), bad)
	if st != http.StatusBadRequest || !strings.Contains(string(b), "Line 2") || !strings.Contains(string(b), "max_output_tokens") {
		t.Fatalf("bad line: %d %s", st, b)
	}
	// A bad first line (a stream), before anything went upstream.
	st, b = p.upload(key, strings.Replace(line("a", "one", 5), `"max_tokens":5`, `"max_tokens":5,"stream":true`, 1))
	if st != http.StatusBadRequest || !strings.Contains(string(b), "Line 1") || !strings.Contains(string(b), "stream") {
		t.Fatalf("bad first line: %d %s", st, b)
	}
	rec := httptest.NewRecorder()
	p.fake.ServeHTTP(rec, httptest.NewRequest("GET", "/v1/files", nil))
	if strings.Contains(rec.Body.String(), `"id"`) {
		t.Fatalf("the upstream kept a refused upload: %s", rec.Body.String())
	}
	if st, _, b := p.do("GET", "/v1/files", key, nil); st != http.StatusOK || strings.Contains(string(b), `"id"`) {
		t.Fatalf("files after a refusal: %d %s", st, b)
	}

	// 40 lines of max_tokens 100: each bound ≥ 200, together past the balance of 1,000.
	var lines []string
	for i := range 40 {
		lines = append(lines, line(fmt.Sprint("l", i), "hi", 100))
	}
	st, b = p.upload(key, lines...)
	var f struct{ ID string }
	if err := json.Unmarshal(b, &f); st != http.StatusOK || err != nil {
		t.Fatalf("upload: %d %s", st, b)
	}
	st, _, b = p.do("POST", "/v1/batches", key, map[string]any{"input_file_id": f.ID, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
	if st != http.StatusTooManyRequests || !strings.Contains(string(b), "insufficient_quota") || !strings.Contains(string(b), "40 lines") ||
		!strings.Contains(string(b), "1000 is available") {
		t.Fatalf("unaffordable batch: %d %s", st, b)
	}
	p.wantChargedNothing("acme", 1_000)
}

func (p *batchProxy) wantChargedNothing(org string, funds int64) {
	p.t.Helper()
	if b := p.balance(org); b.Available != funds || b.Held != 0 || b.LedgerBalance != funds {
		p.t.Fatalf("%s: %+v, want %d untouched", org, b, funds)
	}
}

// TestBatchRoutesScopedToOrg: every file and batch route answers another org's key 404, and
// the lists show only the org's own.
func TestBatchRoutesScopedToOrg(t *testing.T) {
	t.Parallel()
	p := startBatchProxy(t, false)
	owner := p.batchOrg("owner", 100_000)
	other := p.batchOrg("other", 100_000)
	st, b := p.upload(owner, line("a", "one", 5))
	var f struct{ ID string }
	if err := json.Unmarshal(b, &f); st != http.StatusOK || err != nil {
		t.Fatalf("upload: %d %s", st, b)
	}
	id := p.createBatch(owner, line("a", "one", 5))
	st, _, b = p.do("POST", "/v1/messages/batches", owner,
		`{"requests":[{"custom_id":"a","params":{"model":"bm","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}}]}`)
	var mb struct{ ID string }
	if err := json.Unmarshal(b, &mb); st != http.StatusOK || err != nil {
		t.Fatalf("message batch: %d %s", st, b)
	}
	p.settledJob(job.OpenAIBatch, id)
	p.settledJob(job.AnthropicBatch, mb.ID)
	for _, r := range []struct{ method, path, body string }{
		{"GET", "/v1/files/" + f.ID, ""},
		{"GET", "/v1/files/" + f.ID + "/content", ""},
		{"POST", "/v1/batches", `{"input_file_id":"` + f.ID + `","endpoint":"/v1/chat/completions","completion_window":"24h"}`},
		{"GET", "/v1/batches/" + id, ""},
		{"POST", "/v1/batches/" + id + "/cancel", ""},
		{"GET", "/v1/messages/batches/" + mb.ID, ""},
		{"GET", "/v1/messages/batches/" + mb.ID + "/results", ""},
		{"POST", "/v1/messages/batches/" + mb.ID + "/cancel", ""},
		{"DELETE", "/v1/messages/batches/" + mb.ID, ""},
		{"DELETE", "/v1/files/" + f.ID, ""},
	} {
		var body any
		if r.body != "" {
			body = r.body
		}
		if st, _, b := p.do(r.method, r.path, other, body); st != http.StatusNotFound {
			t.Errorf("%s %s by another org: %d %s, want 404", r.method, r.path, st, b)
		}
		if st, _, b := p.do(r.method, r.path, owner, body); st == http.StatusNotFound {
			t.Errorf("%s %s by its org: %d %s", r.method, r.path, st, b)
		}
	}
	for _, path := range []string{"/v1/files", "/v1/batches", "/v1/messages/batches"} {
		if st, _, b := p.do("GET", path, other, nil); st != http.StatusOK || strings.Contains(string(b), `"id"`) {
			t.Errorf("GET %s by another org: %d %s", path, st, b)
		}
	}
	if st, _, b := p.do("GET", "/v1/batches", owner, nil); st != http.StatusOK || !strings.Contains(string(b), id) {
		t.Errorf("GET /v1/batches by its org: %d %s", st, b)
	}
}

// TestOpenAINodeSDKBatch: the official openai npm package (sdktest/batch.mjs) uploads a batch
// file, creates the batch, polls it to its end and reads its output: the org is charged exactly
// the usage of the lines the SDK read in the output file, at the batch price, once; the line
// that failed costs nothing; another org's key gets 404 on the batch, the file, the output and
// the cancel.
func TestOpenAINodeSDKBatch(t *testing.T) {
	t.Parallel()
	node := needNodeSDK(t, "openai")
	p := startBatchProxy(t, true)
	const funds = 100_000
	key := p.batchOrg("sdk-batch", funds)
	other := p.batchOrg("sdk-other", funds)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out := runSDK(ctx, t, node, "batch.mjs", []string{"ESCROW_BASE_URL=" + p.base, "ESCROW_KEY=" + key, "ESCROW_OTHER_KEY=" + other, "ESCROW_MODEL=bm"}, nil)
	var res struct {
		Batch  string `json:"batch"`
		Status string `json:"status"`
		Counts struct {
			Total, Completed, Failed int
		} `json:"counts"`
		Output []struct {
			CustomID string `json:"custom_id"`
			Usage    struct {
				Prompt     int64 `json:"prompt_tokens"`
				Completion int64 `json:"completion_tokens"`
			} `json:"usage"`
		} `json:"output"`
		Errors   []string       `json:"errors"`
		Listed   []string       `json:"listed"`
		OtherSaw map[string]int `json:"otherSaw"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &res); err != nil {
		t.Fatalf("node output %s: %v", out, err)
	}
	if res.Status != "completed" || res.Counts.Total != 3 || res.Counts.Completed != 2 || len(res.Output) != 2 ||
		len(res.Errors) != 1 || res.Errors[0] != "second" || len(res.Listed) != 1 || res.Listed[0] != res.Batch {
		t.Fatalf("SDK results: %s", out)
	}
	var billed int64
	for _, l := range res.Output {
		if l.Usage.Prompt <= 0 || l.Usage.Completion <= 0 {
			t.Fatalf("line %s without usage: %s", l.CustomID, out)
		}
		billed += lineCost(l.Usage.Prompt, l.Usage.Completion)
	}
	for what, st := range res.OtherSaw {
		if st != http.StatusNotFound {
			t.Errorf("another org's %s: %d, want 404", what, st)
		}
	}
	if j := p.settledJob(job.OpenAIBatch, res.Batch); j.Cost != billed {
		t.Fatalf("job: %+v, want cost %d", j, billed)
	}
	p.wantCharged("sdk-batch", funds, billed)
	p.wantCharged("sdk-other", funds, 0)
}
