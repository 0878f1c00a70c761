package fakeupstream

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"time"
)

// The fake Files and Batch APIs (OpenAI /v1/files and /v1/batches, Anthropic
// /v1/messages/batches). A batch runs its lines one after another in the background, each
// after Options.BatchLineDelay, through the same handlers as the live endpoints, so a line's
// usage is exactly what the same body sent live would bill. Markers in a line's text steer the
// batch:
//
//	[batch_invalid]  OpenAI: the input file fails validation; the batch ends "failed" with its
//	                 errors and runs nothing (Anthropic refuses the create with a 400)
//	[batch_pause]    the batch stops before this line until it is cancelled (so a test can
//	                 cancel it with the lines before done); the line and the rest never run
//	[batch_expire]   the batch expires on reaching this line: the lines before it are done,
//	                 this one and the rest are expired (OpenAI: in the error file with code
//	                 batch_expired; Anthropic: result type "expired")
//	[fail]           the line itself fails (500): OpenAI writes it to the error file,
//	                 Anthropic answers it "errored"; it bills nothing
//
// Files: POST /v1/files (multipart, fields "file" and "purpose"), GET /v1/files,
// GET /v1/files/{id}, GET /v1/files/{id}/content, DELETE /v1/files/{id}. Batches:
// POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.
// Anthropic: POST /v1/messages/batches, GET /v1/messages/batches, GET /{id}, GET /{id}/results,
// POST /{id}/cancel, DELETE /{id}.

// FileObject is OpenAI's file object.
type FileObject struct {
	ID        string `json:"id"`
	Object    string `json:"object"`
	Bytes     int    `json:"bytes"`
	CreatedAt int64  `json:"created_at"`
	Filename  string `json:"filename"`
	Purpose   string `json:"purpose"`
	Status    string `json:"status"`
}

// BatchCounts are a batch's request counts.
type BatchCounts struct {
	Total     int `json:"total"`
	Completed int `json:"completed"`
	Failed    int `json:"failed"`
}

// BatchError is one error of a failed batch.
type BatchError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
	Line    *int   `json:"line"`
}

// Batch is OpenAI's batch object.
type Batch struct {
	ID               string            `json:"id"`
	Object           string            `json:"object"`
	Endpoint         string            `json:"endpoint"`
	Errors           *batchErrors      `json:"errors"`
	InputFileID      string            `json:"input_file_id"`
	CompletionWindow string            `json:"completion_window"`
	Status           string            `json:"status"`
	OutputFileID     *string           `json:"output_file_id"`
	ErrorFileID      *string           `json:"error_file_id"`
	CreatedAt        int64             `json:"created_at"`
	InProgressAt     *int64            `json:"in_progress_at"`
	ExpiresAt        int64             `json:"expires_at"`
	FinalizingAt     *int64            `json:"finalizing_at"`
	CompletedAt      *int64            `json:"completed_at"`
	FailedAt         *int64            `json:"failed_at"`
	ExpiredAt        *int64            `json:"expired_at"`
	CancellingAt     *int64            `json:"cancelling_at"`
	CancelledAt      *int64            `json:"cancelled_at"`
	RequestCounts    BatchCounts       `json:"request_counts"`
	Metadata         map[string]string `json:"metadata"`
}

type batchErrors struct {
	Object string       `json:"object"`
	Data   []BatchError `json:"data"`
}

// MessageBatchCounts are an Anthropic message batch's request counts.
type MessageBatchCounts struct {
	Processing int `json:"processing"`
	Succeeded  int `json:"succeeded"`
	Errored    int `json:"errored"`
	Canceled   int `json:"canceled"`
	Expired    int `json:"expired"`
}

// MessageBatch is Anthropic's message batch object.
type MessageBatch struct {
	ID                string             `json:"id"`
	Type              string             `json:"type"`
	ProcessingStatus  string             `json:"processing_status"`
	RequestCounts     MessageBatchCounts `json:"request_counts"`
	EndedAt           *string            `json:"ended_at"`
	CreatedAt         string             `json:"created_at"`
	ExpiresAt         string             `json:"expires_at"`
	ArchivedAt        *string            `json:"archived_at"`
	CancelInitiatedAt *string            `json:"cancel_initiated_at"`
	ResultsURL        *string            `json:"results_url"`
}

type storedFile struct {
	FileObject
	content []byte
}

// batchRun is one batch of either provider while and after it runs.
type batchRun struct {
	anthropic bool
	path      string // the endpoint every line goes to
	lines     []batchLine
	cancel    chan struct{} // closed by a cancel
	cancelled bool
	done      chan struct{} // closed when the batch is terminal

	openai  Batch
	message MessageBatch
	results []byte // Anthropic: the results JSONL
	deleted bool
}

type batchLine struct {
	customID string
	method   string
	url      string
	body     []byte
}

type batchState struct {
	mu      sync.Mutex
	files   map[string]*storedFile
	batches map[string]*batchRun
}

func (s *Server) batchState() *batchState {
	s.batchOnce.Do(func() {
		s.batch = &batchState{files: map[string]*storedFile{}, batches: map[string]*batchRun{}}
	})
	return s.batch
}

// BatchDone returns a channel closed when the batch (either provider's id) is terminal; nil
// for an unknown id.
func (s *Server) BatchDone(id string) <-chan struct{} {
	st := s.batchState()
	st.mu.Lock()
	defer st.mu.Unlock()
	if b := st.batches[id]; b != nil {
		return b.done
	}
	return nil
}

// isBatchPath reports whether the files and batches fake answers path.
func isBatchPath(p string) bool {
	return p == "/v1/files" || strings.HasPrefix(p, "/v1/files/") ||
		p == "/v1/batches" || strings.HasPrefix(p, "/v1/batches/") ||
		p == "/v1/messages/batches" || strings.HasPrefix(p, "/v1/messages/batches/")
}

// serveBatch answers the files and batch routes.
func (s *Server) serveBatch(w http.ResponseWriter, r *http.Request) {
	anth := strings.HasPrefix(r.URL.Path, "/v1/messages/batches")
	if s.opts.APIKey != "" && r.Header.Get("Authorization") != "Bearer "+s.opts.APIKey && r.Header.Get("X-Api-Key") != s.opts.APIKey {
		if anth {
			writeAnthropicError(w, http.StatusUnauthorized, "authentication_error", "invalid x-api-key")
		} else {
			writeError(w, http.StatusUnauthorized, "invalid_request_error", "invalid_api_key", "Incorrect API key provided.")
		}
		return
	}
	var rest string
	var base string
	switch {
	case anth:
		base = "/v1/messages/batches"
	case strings.HasPrefix(r.URL.Path, "/v1/files"):
		base = "/v1/files"
	default:
		base = "/v1/batches"
	}
	rest = strings.TrimPrefix(strings.TrimPrefix(r.URL.Path, base), "/")
	id, sub, _ := strings.Cut(rest, "/")
	route := r.Method + " " + base
	if id != "" {
		route += "/{id}"
	}
	if sub != "" {
		route += "/" + sub
	}
	st := s.batchState()
	switch route {
	case "POST /v1/files":
		s.uploadFile(w, r)
	case "GET /v1/files":
		st.mu.Lock()
		list := make([]FileObject, 0, len(st.files))
		for _, f := range st.files {
			list = append(list, f.FileObject)
		}
		st.mu.Unlock()
		sort.Slice(list, func(i, j int) bool { return list[i].ID < list[j].ID })
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": list, "has_more": false})
	case "GET /v1/files/{id}", "GET /v1/files/{id}/content", "DELETE /v1/files/{id}":
		st.mu.Lock()
		f := st.files[id]
		if f != nil && r.Method == http.MethodDelete {
			delete(st.files, id)
		}
		st.mu.Unlock()
		switch {
		case f == nil:
			writeError(w, http.StatusNotFound, "invalid_request_error", "", "No such File object: "+id)
		case r.Method == http.MethodDelete:
			writeJSON(w, http.StatusOK, map[string]any{"id": id, "object": "file", "deleted": true})
		case sub == "content":
			w.Header().Set("Content-Type", "application/octet-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(f.content)
		default:
			writeJSON(w, http.StatusOK, f.FileObject)
		}
	case "POST /v1/batches":
		s.createBatch(w, r)
	case "GET /v1/batches":
		st.mu.Lock()
		var list []Batch
		for _, b := range st.batches {
			if !b.anthropic {
				list = append(list, b.openai)
			}
		}
		st.mu.Unlock()
		sort.Slice(list, func(i, j int) bool { return list[i].ID > list[j].ID })
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": list, "has_more": false})
	case "GET /v1/batches/{id}", "POST /v1/batches/{id}/cancel":
		st.mu.Lock()
		b := st.batches[id]
		if b != nil && b.anthropic {
			b = nil
		}
		if b != nil && sub == "cancel" {
			b.cancelLocked()
		}
		var out Batch
		if b != nil {
			out = b.openai
		}
		st.mu.Unlock()
		if b == nil {
			writeError(w, http.StatusNotFound, "invalid_request_error", "", "No batch found with id '"+id+"'.")
			return
		}
		writeJSON(w, http.StatusOK, out)
	case "POST /v1/messages/batches":
		s.createMessageBatch(w, r)
	case "GET /v1/messages/batches":
		st.mu.Lock()
		var list []MessageBatch
		for _, b := range st.batches {
			if b.anthropic && !b.deleted {
				list = append(list, b.message)
			}
		}
		st.mu.Unlock()
		sort.Slice(list, func(i, j int) bool { return list[i].ID > list[j].ID })
		writeJSON(w, http.StatusOK, map[string]any{"data": list, "has_more": false, "first_id": nil, "last_id": nil})
	case "GET /v1/messages/batches/{id}", "GET /v1/messages/batches/{id}/results",
		"POST /v1/messages/batches/{id}/cancel", "DELETE /v1/messages/batches/{id}":
		st.mu.Lock()
		b := st.batches[id]
		if b != nil && (!b.anthropic || b.deleted) {
			b = nil
		}
		var out MessageBatch
		var results []byte
		ended := false
		if b != nil {
			switch {
			case sub == "cancel":
				b.cancelLocked()
			case r.Method == http.MethodDelete && b.message.ProcessingStatus == "ended":
				b.deleted = true
			}
			out, results, ended = b.message, b.results, b.message.ProcessingStatus == "ended"
		}
		st.mu.Unlock()
		switch {
		case b == nil:
			writeAnthropicError(w, http.StatusNotFound, "not_found_error", "No message batch found with id "+id)
		case r.Method == http.MethodDelete && !ended:
			writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "Batch "+id+" is still in progress; cancel it first.")
		case r.Method == http.MethodDelete:
			writeJSON(w, http.StatusOK, map[string]string{"id": id, "type": "message_batch_deleted"})
		case sub == "results" && !ended:
			writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "Batch "+id+" has not ended; its results are not available yet.")
		case sub == "results":
			w.Header().Set("Content-Type", "application/binary")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(results)
		default:
			writeJSON(w, http.StatusOK, out)
		}
	default:
		if anth {
			writeAnthropicError(w, http.StatusNotFound, "not_found_error", "Not found: "+r.Method+" "+r.URL.Path)
			return
		}
		writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_url", fmt.Sprintf("Invalid URL (%s %s)", r.Method, r.URL.Path))
	}
}

// cancelLocked asks a running batch to stop (st.mu held).
func (b *batchRun) cancelLocked() {
	if b.cancelled {
		return
	}
	select {
	case <-b.done:
		return // already terminal
	default:
	}
	b.cancelled = true
	close(b.cancel)
	now := time.Now()
	if b.anthropic {
		t := now.UTC().Format(time.RFC3339)
		b.message.CancelInitiatedAt = &t
		b.message.ProcessingStatus = "canceling"
		return
	}
	ts := now.Unix()
	b.openai.CancellingAt, b.openai.Status = &ts, "cancelling"
}

// maxFileBytes is the largest upload the fake takes (OpenAI's batch input limit).
const maxFileBytes = 200 << 20

func (s *Server) uploadFile(w http.ResponseWriter, r *http.Request) {
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Expected a multipart/form-data upload.")
		return
	}
	mr := multipart.NewReader(http.MaxBytesReader(w, r.Body, maxFileBytes+1<<20), params["boundary"])
	var purpose, filename string
	var content []byte
	haveFile := false
	for {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Could not read the upload: "+err.Error())
			return
		}
		b, err := io.ReadAll(io.LimitReader(p, maxFileBytes+1))
		if err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Could not read the upload: "+err.Error())
			return
		}
		switch p.FormName() {
		case "purpose":
			purpose = string(b)
		case "file":
			if len(b) > maxFileBytes {
				writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error", "", "File is larger than 200 MB.")
				return
			}
			content, filename, haveFile = b, p.FileName(), true
		}
	}
	if !haveFile {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "'file' is a required property")
		return
	}
	if purpose == "" {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "'purpose' is a required property")
		return
	}
	f := s.storeFile(filename, purpose, content)
	writeJSON(w, http.StatusOK, f.FileObject)
}

func (s *Server) storeFile(name, purpose string, content []byte) *storedFile {
	f := &storedFile{FileObject: FileObject{ID: s.nextID("file"), Object: "file", Bytes: len(content),
		CreatedAt: time.Now().Unix(), Filename: name, Purpose: purpose, Status: "processed"}, content: content}
	st := s.batchState()
	st.mu.Lock()
	st.files[f.ID] = f
	st.mu.Unlock()
	return f
}

// batchEndpoints are the endpoints a batch may name.
var batchEndpoints = map[string]bool{"/v1/chat/completions": true, "/v1/completions": true, "/v1/embeddings": true, "/v1/responses": true}

func (s *Server) createBatch(w http.ResponseWriter, r *http.Request) {
	var req struct {
		InputFileID      string            `json:"input_file_id"`
		Endpoint         string            `json:"endpoint"`
		CompletionWindow string            `json:"completion_window"`
		Metadata         map[string]string `json:"metadata"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "We could not parse the JSON body of your request.")
		return
	}
	if !batchEndpoints[req.Endpoint] {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Invalid 'endpoint': "+req.Endpoint)
		return
	}
	if req.CompletionWindow != "24h" {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "", "Invalid 'completion_window': only '24h' is supported.")
		return
	}
	st := s.batchState()
	st.mu.Lock()
	f := st.files[req.InputFileID]
	st.mu.Unlock()
	if f == nil {
		writeError(w, http.StatusNotFound, "invalid_request_error", "", "No such File object: "+req.InputFileID)
		return
	}
	now := time.Now()
	b := &batchRun{path: req.Endpoint, cancel: make(chan struct{}), done: make(chan struct{})}
	b.openai = Batch{ID: s.nextID("batch"), Object: "batch", Endpoint: req.Endpoint, InputFileID: req.InputFileID,
		CompletionWindow: req.CompletionWindow, Status: "validating", CreatedAt: now.Unix(),
		ExpiresAt: now.Add(24 * time.Hour).Unix(), Metadata: req.Metadata}
	var invalid []BatchError
	sc := bufio.NewScanner(bytes.NewReader(f.content))
	sc.Buffer(nil, maxFileBytes)
	for n := 1; sc.Scan(); n++ {
		if len(bytes.TrimSpace(sc.Bytes())) == 0 {
			continue
		}
		var line struct {
			CustomID string          `json:"custom_id"`
			Method   string          `json:"method"`
			URL      string          `json:"url"`
			Body     json.RawMessage `json:"body"`
		}
		ln := n
		switch {
		case json.Unmarshal(sc.Bytes(), &line) != nil:
			invalid = append(invalid, BatchError{Code: "invalid_json_line", Message: "This line is not parseable as valid JSON.", Line: &ln})
		case line.URL != req.Endpoint:
			invalid = append(invalid, BatchError{Code: "mismatched_endpoint", Message: "The URL provided for this request does not match the batch endpoint.", Line: &ln})
		case bytes.Contains(line.Body, []byte("[batch_invalid]")):
			invalid = append(invalid, BatchError{Code: "invalid_request", Message: "This line was refused by the fake's [batch_invalid] marker.", Line: &ln})
		}
		b.lines = append(b.lines, batchLine{customID: line.CustomID, method: line.Method, url: line.URL, body: line.Body})
	}
	b.openai.RequestCounts.Total = len(b.lines)
	if len(invalid) > 0 {
		b.openai.Status, b.openai.Errors = "failed", &batchErrors{Object: "list", Data: invalid}
		t := now.Unix()
		b.openai.FailedAt = &t
		b.openai.RequestCounts.Total = 0
		close(b.done)
	}
	st.mu.Lock()
	st.batches[b.openai.ID] = b
	out := b.openai
	st.mu.Unlock()
	if len(invalid) == 0 {
		go s.runBatch(b)
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) createMessageBatch(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Requests []struct {
			CustomID string          `json:"custom_id"`
			Params   json.RawMessage `json:"params"`
		} `json:"requests"`
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 256<<20))
	if err != nil || json.Unmarshal(body, &req) != nil {
		writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "Could not parse the request body.")
		return
	}
	if len(req.Requests) == 0 {
		writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", "requests: List should have at least 1 item")
		return
	}
	now := time.Now()
	b := &batchRun{anthropic: true, path: "/v1/messages", cancel: make(chan struct{}), done: make(chan struct{})}
	for i, q := range req.Requests {
		if bytes.Contains(q.Params, []byte("[batch_invalid]")) {
			writeAnthropicError(w, http.StatusBadRequest, "invalid_request_error", fmt.Sprintf("requests.%d.params: refused by the fake's [batch_invalid] marker", i))
			return
		}
		b.lines = append(b.lines, batchLine{customID: q.CustomID, method: http.MethodPost, url: "/v1/messages", body: q.Params})
	}
	b.message = MessageBatch{ID: s.nextID("msgbatch"), Type: "message_batch", ProcessingStatus: "in_progress",
		RequestCounts: MessageBatchCounts{Processing: len(b.lines)}, CreatedAt: now.UTC().Format(time.RFC3339),
		ExpiresAt: now.Add(24 * time.Hour).UTC().Format(time.RFC3339)}
	st := s.batchState()
	st.mu.Lock()
	st.batches[b.message.ID] = b
	out := b.message
	st.mu.Unlock()
	go s.runBatch(b)
	writeJSON(w, http.StatusOK, out)
}

// lineOutcome is how one line ended.
type lineOutcome uint8

const (
	lineDone lineOutcome = iota
	lineFailed
	lineExpired
	lineCancelled
)

// runBatch runs b's lines in order, then writes its results and makes it terminal.
func (s *Server) runBatch(b *batchRun) {
	st := s.batchState()
	if !b.anthropic {
		st.mu.Lock()
		t := time.Now().Unix()
		b.openai.Status, b.openai.InProgressAt = "in_progress", &t
		st.mu.Unlock()
	}
	var out, errs, results bytes.Buffer
	expired := false
	for _, ln := range b.lines {
		outcome := lineDone
		var status int
		var resp []byte
		switch {
		case expired:
			outcome = lineExpired
		case bytes.Contains(ln.body, []byte("[batch_expire]")):
			expired, outcome = true, lineExpired
		case bytes.Contains(ln.body, []byte("[batch_pause]")):
			<-b.cancel
			outcome = lineCancelled
		default:
			select {
			case <-b.cancel:
				outcome = lineCancelled
			case <-time.After(s.opts.BatchLineDelay):
				status, resp = s.runLine(ln.url, ln.body)
				if status != http.StatusOK {
					outcome = lineFailed
				}
			}
		}
		s.writeLine(b, ln, outcome, status, resp, &out, &errs, &results)
		st.mu.Lock()
		b.count(outcome)
		st.mu.Unlock()
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	now := time.Now()
	if b.anthropic {
		t := now.UTC().Format(time.RFC3339)
		b.message.ProcessingStatus, b.message.EndedAt, b.results = "ended", &t, results.Bytes()
		url := "/v1/messages/batches/" + b.message.ID + "/results"
		b.message.ResultsURL = &url
		close(b.done)
		return
	}
	ts := now.Unix()
	if out.Len() > 0 {
		f := &storedFile{FileObject: FileObject{ID: s.nextID("file"), Object: "file", Bytes: out.Len(), CreatedAt: ts,
			Filename: "batch_" + b.openai.ID + "_output.jsonl", Purpose: "batch_output", Status: "processed"}, content: out.Bytes()}
		st.files[f.ID] = f
		b.openai.OutputFileID = &f.ID
	}
	if errs.Len() > 0 {
		f := &storedFile{FileObject: FileObject{ID: s.nextID("file"), Object: "file", Bytes: errs.Len(), CreatedAt: ts,
			Filename: "batch_" + b.openai.ID + "_error.jsonl", Purpose: "batch_output", Status: "processed"}, content: errs.Bytes()}
		st.files[f.ID] = f
		b.openai.ErrorFileID = &f.ID
	}
	b.openai.FinalizingAt = &ts
	switch {
	case b.cancelled:
		b.openai.Status, b.openai.CancelledAt = "cancelled", &ts
	case expired:
		b.openai.Status, b.openai.ExpiredAt = "expired", &ts
	default:
		b.openai.Status, b.openai.CompletedAt = "completed", &ts
	}
	close(b.done)
}

// count adds one line's outcome to the batch's counts (batch state locked).
func (b *batchRun) count(o lineOutcome) {
	if b.anthropic {
		c := &b.message.RequestCounts
		c.Processing--
		switch o {
		case lineDone:
			c.Succeeded++
		case lineFailed:
			c.Errored++
		case lineExpired:
			c.Expired++
		case lineCancelled:
			c.Canceled++
		}
		return
	}
	switch o {
	case lineDone:
		b.openai.RequestCounts.Completed++
	case lineFailed, lineExpired:
		b.openai.RequestCounts.Failed++
	}
}

// runLine answers one line's body as the live endpoint would.
func (s *Server) runLine(path string, body []byte) (int, []byte) {
	req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if s.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+s.opts.APIKey)
	}
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, req)
	return rec.Code, rec.Body.Bytes()
}

// writeLine writes one line's result: OpenAI's output or error file line, Anthropic's result.
func (s *Server) writeLine(b *batchRun, ln batchLine, o lineOutcome, status int, resp []byte, out, errs, results *bytes.Buffer) {
	type obj = map[string]any
	if b.anthropic {
		var result obj
		switch o {
		case lineDone:
			result = obj{"type": "succeeded", "message": json.RawMessage(resp)}
		case lineFailed:
			var e obj
			_ = json.Unmarshal(resp, &e)
			result = obj{"type": "errored", "error": e}
		case lineExpired:
			result = obj{"type": "expired"}
		case lineCancelled:
			result = obj{"type": "canceled"}
		}
		appendJSONLine(results, obj{"custom_id": ln.customID, "result": result})
		return
	}
	id := s.nextID("batch_req")
	switch o {
	case lineDone:
		appendJSONLine(out, obj{"id": id, "custom_id": ln.customID, "response": obj{"status_code": status,
			"request_id": s.nextID("req"), "body": json.RawMessage(resp)}, "error": nil})
	case lineFailed:
		appendJSONLine(errs, obj{"id": id, "custom_id": ln.customID, "response": obj{"status_code": status,
			"request_id": s.nextID("req"), "body": json.RawMessage(resp)}, "error": nil})
	case lineExpired:
		appendJSONLine(errs, obj{"id": id, "custom_id": ln.customID, "response": nil,
			"error": obj{"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}})
	case lineCancelled:
		appendJSONLine(errs, obj{"id": id, "custom_id": ln.customID, "response": nil,
			"error": obj{"code": "batch_cancelled", "message": "This request was not executed because the batch was cancelled."}})
	}
}

func appendJSONLine(buf *bytes.Buffer, v any) {
	b, _ := json.Marshal(v)
	buf.Write(b)
	buf.WriteByte('\n')
}
