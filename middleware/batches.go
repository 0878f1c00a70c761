package middleware

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"

	"github.com/llmescrow/escrow/async"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger/batchfile"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/pricing"
)

// The batch APIs (DESIGN.md "Async work"; issue 33): OpenAI's /v1/files and /v1/batches,
// Anthropic's /v1/messages/batches.
//
//   - POST /v1/files (purpose "batch") is read as it streams: every line is checked and bounded
//     at the batch price (batchlines.go) and sent on carrying its cap; a bad line stops the
//     upload (the upstream gets a cut body and stores nothing) and is answered 400 naming it.
//     The file is recorded for the org with its lines' total bound before the client learns
//     its id.
//   - POST /v1/batches holds that bound (no fit: refused with the numbers when it does not
//     fit), creates the batch upstream, and records it as a job (async.Poller.Begin) before the
//     client learns its id; the job core pins the hold while the batch runs. POST
//     /v1/messages/batches does the same with its requests inline.
//   - A poller (Batches.Jobs) asks the upstream where each batch stands; once it ended it reads
//     the output and error files (Anthropic: the results) and bills every line that ran as its
//     own usage event (custom_id kept) at the batch prices recorded with the job; lines that
//     did not run cost nothing; the rest of the hold comes back when the job settles.
//   - Every file and batch route answers only the org that created it: another org's id is
//     unknown (404), whatever the shared upstream key could read.

// Batches turns the batch APIs on (Config.Batches): all three fields are needed; without them
// the batch routes are unknown paths (404).
type Batches struct {
	// Jobs is the job core (*async.Poller): batches are recorded with Begin and polled by the
	// kinds' Upstreams the middleware registers with Handle.
	Jobs BatchJobs
	// Files records the batch files of each org (the ledger).
	Files batchfile.Store
	// Upstream sends a request of escrow's own (a batch's status, its result files, a list)
	// to the upstream that serves model, with the upstream's key; req's URL holds only the
	// path and query.
	Upstream func(ctx context.Context, model string, req *http.Request) (*http.Response, error)
}

// BatchJobs is what the batch routes need of the job core (*async.Poller implements it).
type BatchJobs interface {
	Begin(ctx context.Context, j job.Job) (job.Job, error)
	Handle(kind job.Kind, u async.Upstream)
	Jobs() job.Store
	Kick()
}

func (b Batches) on() bool { return b.Jobs != nil && b.Files != nil && b.Upstream != nil }

// batchData is a batch job's own state (job.Job.Data).
type batchData struct {
	InputFileID string                    `json:"input_file_id,omitempty"`
	Lines       int                       `json:"lines"`
	MaxLine     int64                     `json:"max_line"` // charged for a line that ran but whose usage cannot be read
	Models      map[string]pricing.Prices `json:"models,omitempty"`
}

// maxControlBody bounds the bodies of batch routes other than uploads (a create's JSON).
const maxControlBody = 1 << 20

// maxCaptured bounds an upstream answer escrow reads before passing it on (objects, lists).
const maxCaptured = 8 << 20

// registerBatchPollers hands the job core the upstreams of the batch kinds.
func (m *middleware) registerBatchPollers() {
	b := m.cfg.Batches
	if !b.on() {
		return
	}
	b.Jobs.Handle(job.OpenAIBatch, async.UpstreamFunc(m.pollOpenAIBatch))
	b.Jobs.Handle(job.AnthropicBatch, async.UpstreamFunc(m.pollMsgBatch))
}

// serveBatch answers one request of the batch APIs.
func (m *middleware) serveBatch(c echo.Context, next echo.HandlerFunc, id Identity, rt endpoint.BatchRoute, o Outcome) error {
	req := c.Request()
	req.Header.Del("Authorization")
	req.Header.Del("X-Api-Key")
	var e *Error
	switch rt.Op {
	case endpoint.FileUpload:
		e = m.uploadBatchFile(c, next, id, &o)
	case endpoint.FileList:
		e = m.listFiles(c, id)
	case endpoint.FileGet, endpoint.FileContent, endpoint.FileDelete:
		e = m.fileRoute(c, next, id, rt)
	case endpoint.BatchCreate, endpoint.MsgBatchCreate:
		e = m.createBatch(c, next, id, rt, &o)
	case endpoint.BatchList, endpoint.MsgBatchList:
		e = m.listBatches(c, id, rt)
	default:
		e = m.batchRoute(c, next, id, rt)
	}
	if e != nil {
		if rt.Provider == endpoint.Anthropic && !e.Anthropic {
			e = e.forAnthropic()
		}
		return m.refuse(c, o, e)
	}
	o.Kind, o.Status = OutcomePassed, c.Response().Status
	if (rt.Op == endpoint.BatchCreate || rt.Op == endpoint.MsgBatchCreate) && o.Status == http.StatusOK {
		o.Kind = OutcomeJob // the hold is the batch job's now
	}
	m.report(o)
	return nil
}

// notFound is the answer for an id the org does not own (or nobody does).
func notFound(rt endpoint.BatchRoute, what, id string) *Error {
	return &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Code: CodeNotFound, Param: "id",
		Message: fmt.Sprintf("No %s found with id '%s'.", what, id)}
}

// route picks the upstream of model for the request (Config.Route).
func (m *middleware) route(c echo.Context, model string) *Error {
	if m.cfg.Route == nil || model == "" {
		return nil
	}
	if _, err := m.cfg.Route(c, model); err != nil {
		return m.routeError(err)
	}
	return nil
}

// captured is an upstream answer read whole (at most maxCaptured bytes).
type captured struct {
	status int
	header http.Header
	body   bytes.Buffer
}

func (w *captured) Header() http.Header { return w.header }
func (w *captured) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}
func (w *captured) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if w.body.Len()+len(b) > maxCaptured {
		return 0, errors.New("escrow: upstream answer too large")
	}
	return w.body.Write(b)
}
func (w *captured) Flush() {}

func (w *captured) ok() bool { return w.status >= 200 && w.status < 300 }

// capture runs next (the upstream call) into a buffer instead of the client's response.
func capture(c echo.Context, next echo.HandlerFunc) (*captured, error) {
	orig := c.Response()
	cw := &captured{header: http.Header{}}
	c.SetResponse(echo.NewResponse(cw, c.Echo()))
	err := next(c)
	c.SetResponse(orig)
	if cw.status == 0 {
		cw.status = http.StatusBadGateway
	}
	return cw, err
}

// pass writes a captured answer to the client.
func pass(c echo.Context, cw *captured) error {
	h := c.Response().Header()
	for k, v := range cw.header {
		if k != "Content-Length" {
			h[k] = v
		}
	}
	h.Set("Content-Length", strconv.Itoa(cw.body.Len()))
	c.Response().WriteHeader(cw.status)
	_, err := c.Response().Write(cw.body.Bytes())
	return err
}

// uploadGate holds what is written before open in memory, then writes through: the multipart
// headers before the first line must not block on a pipe nobody reads yet.
type uploadGate struct {
	w    io.Writer
	buf  bytes.Buffer
	open bool
}

func (g *uploadGate) Write(b []byte) (int, error) {
	if !g.open {
		return g.buf.Write(b)
	}
	return g.w.Write(b)
}

func (g *uploadGate) openUp() error {
	g.open = true
	_, err := g.w.Write(g.buf.Bytes())
	g.buf = bytes.Buffer{}
	return err
}

// uploadResult is what the upload's copy found.
type uploadResult struct {
	sum      batchSum
	filename string
	e        *Error
}

// uploadBatchFile streams a batch input upload to the upstream, line by line checked.
func (m *middleware) uploadBatchFile(c echo.Context, next echo.HandlerFunc, id Identity, o *Outcome) *Error {
	req := c.Request()
	mt, params, err := mime.ParseMediaType(req.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return errInvalid("file", "Upload the file as multipart/form-data with the fields 'file' and 'purpose'.")
	}
	ctx := req.Context()
	mr := multipart.NewReader(http.MaxBytesReader(c.Response(), req.Body, endpoint.MaxBatchFileBytes+1<<20), params["boundary"])
	pr, pw := io.Pipe()
	g := &uploadGate{w: pw}
	mw := multipart.NewWriter(g)
	first := make(chan string, 1)
	done := make(chan uploadResult, 1)
	go func() {
		res := m.copyUpload(ctx, mr, mw, g, first)
		if res.e == nil {
			if err := mw.Close(); err != nil {
				res.e = errUploadStopped
			}
		}
		if res.e != nil {
			pw.CloseWithError(errors.New("escrow: upload refused"))
		} else {
			_ = pw.Close()
		}
		done <- res
	}()
	model, ok := <-first
	if !ok {
		res := <-done
		return res.e
	}
	if e := m.route(c, model); e != nil {
		_ = pr.CloseWithError(errors.New("escrow: not routed"))
		<-done
		return e
	}
	o.Model = model
	req.Body, req.ContentLength = pr, -1
	req.Header.Del("Content-Length")
	req.Header.Set("Content-Type", mw.FormDataContentType())
	cw, _ := capture(c, next)
	_ = pr.CloseWithError(errors.New("escrow: upstream answered"))
	res := <-done
	fileID := gjson.GetBytes(cw.body.Bytes(), "id").String()
	if res.e != nil && res.e != errUploadStopped {
		if cw.ok() && fileID != "" { // an upstream that kept a cut upload: it must not stay
			m.deleteUpstreamFile(model, fileID)
		}
		return res.e
	}
	if !cw.ok() {
		return passErr(c, cw)
	}
	if fileID == "" {
		return &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: "upstream_error", Message: "The upstream's answer names no file id."}
	}
	s := res.sum
	f := batchfile.File{ID: fileID, Org: id.Org, KeyID: id.KeyID, Purpose: batchfile.PurposeBatch, Filename: res.filename,
		Bytes: s.bytes, Endpoint: s.endpoint, Model: s.model, Lines: s.lines, Bound: s.bound, Estimate: s.estimate,
		MaxLine: s.maxLine, Prices: s.models[s.model]}
	if err := m.cfg.Batches.Files.RecordFile(ctx, f); err != nil {
		m.cfg.Logger.Error("escrow: record batch file", "file", fileID, "org", id.Org, "err", err)
		m.deleteUpstreamFile(model, fileID)
		return errUnavailable("The billing service could not record the file; please retry.", m.cfg.RetryAfter)
	}
	_ = pass(c, cw)
	return nil
}

// passErr passes an upstream's refusal on (a nil *Error: the answer is written).
func passErr(c echo.Context, cw *captured) *Error {
	_ = pass(c, cw)
	return nil
}

// copyUpload copies the multipart upload's parts to mw, reading the file part line by line;
// first gets the model of the first line (closed without one when the copy fails before).
func (m *middleware) copyUpload(ctx context.Context, mr *multipart.Reader, mw *multipart.Writer, g *uploadGate, first chan<- string) (res uploadResult) {
	sent := false
	defer func() {
		if !sent {
			close(first)
		}
	}()
	purpose, haveFile := "", false
	for {
		p, err := mr.NextPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				res.e = &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: CodeRequestTooLarge, Param: "file",
					Message: fmt.Sprintf("The batch file is larger than %d bytes.", endpoint.MaxBatchFileBytes)}
				return res
			}
			res.e = errInvalid("file", "The upload could not be read: "+err.Error())
			return res
		}
		switch name := p.FormName(); name {
		case "file":
			if haveFile {
				res.e = errInvalid("file", "Send one file per upload.")
				return res
			}
			haveFile, res.filename = true, p.FileName()
			h := textproto.MIMEHeader{}
			h.Set("Content-Disposition", mime.FormatMediaType("form-data", map[string]string{"name": "file", "filename": p.FileName()}))
			h.Set("Content-Type", "application/jsonl")
			w, err := mw.CreatePart(h)
			if err != nil {
				res.e = errUploadStopped
				return res
			}
			flushed := true
			res.sum, res.e = m.readBatchFile(ctx, p, w, func(model string) {
				first <- model // the upstream call starts: what was held back can flow now
				sent = true
				flushed = g.openUp() == nil
			})
			if res.e == nil && !flushed {
				res.e = errUploadStopped
			}
			if res.e == nil && !sent {
				res.e = errUploadStopped
			}
			if res.e != nil {
				return res
			}
		default:
			v, err := io.ReadAll(io.LimitReader(p, 4<<10+1))
			if err != nil || len(v) > 4<<10 {
				res.e = errInvalid(name, "The field '"+name+"' is too long.")
				return res
			}
			if name == "purpose" {
				purpose = string(v)
				if purpose != batchfile.PurposeBatch {
					res.e = errInvalid("purpose", "Only files with purpose 'batch' can be uploaded here.")
					return res
				}
			}
			if mw.WriteField(name, string(v)) != nil {
				res.e = errUploadStopped
				return res
			}
		}
	}
	switch {
	case !haveFile:
		res.e = errMissing("file", "'file' is a required property.")
	case purpose == "":
		res.e = errMissing("purpose", "'purpose' is a required property.")
	}
	return res
}

// upstreamDo sends one request of escrow's own to model's upstream and reads the answer whole
// (at most limit bytes).
func (m *middleware) upstreamDo(ctx context.Context, model, method, path string, body []byte, limit int64) (int, []byte, error) {
	res, err := m.upstreamOpen(ctx, model, method, path, body)
	if err != nil {
		return 0, nil, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(io.LimitReader(res.Body, limit+1))
	if err != nil {
		return 0, nil, err
	}
	if int64(len(b)) > limit {
		return 0, nil, fmt.Errorf("escrow: upstream answer to %s %s is larger than %d bytes", method, path, limit)
	}
	return res.StatusCode, b, nil
}

func (m *middleware) upstreamOpen(ctx context.Context, model, method, path string, body []byte) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if strings.HasPrefix(path, "/v1/messages") {
		req.Header.Set("anthropic-version", "2023-06-01")
	}
	return m.cfg.Batches.Upstream(ctx, model, req)
}

// deleteUpstreamFile deletes a file escrow cannot account for, in the background.
func (m *middleware) deleteUpstreamFile(model, fileID string) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if st, _, err := m.upstreamDo(ctx, model, http.MethodDelete, "/v1/files/"+fileID, nil, maxControlBody); err != nil || st >= 300 {
			m.cfg.Logger.Warn("escrow: delete an unaccounted batch file upstream", "file", fileID, "status", st, "err", err)
		}
	}()
}

// listFiles answers GET /v1/files with the org's own files.
func (m *middleware) listFiles(c echo.Context, id Identity) *Error {
	limit, _ := strconv.Atoi(c.QueryParam("limit"))
	files, err := m.cfg.Batches.Files.Files(c.Request().Context(), id.Org, limit)
	if err != nil {
		return errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	data := make([]map[string]any, 0, len(files))
	for _, f := range files {
		data = append(data, fileObject(f))
	}
	out := map[string]any{"object": "list", "data": data, "has_more": false}
	if len(data) > 0 {
		out["first_id"], out["last_id"] = files[0].ID, files[len(files)-1].ID
	}
	_ = c.JSON(http.StatusOK, out)
	return nil
}

func fileObject(f batchfile.File) map[string]any {
	return map[string]any{"id": f.ID, "object": "file", "bytes": f.Bytes, "created_at": f.CreatedAt.Unix(),
		"filename": f.Filename, "purpose": f.Purpose, "status": "processed", "expires_at": nil, "status_details": nil}
}

// ownFile is the org's file with id, or the 404 another org gets.
func (m *middleware) ownFile(ctx context.Context, id Identity, rt endpoint.BatchRoute) (batchfile.File, *Error) {
	f, err := m.cfg.Batches.Files.File(ctx, rt.ID)
	switch {
	case errors.Is(err, batchfile.ErrUnknownFile) || err == nil && f.Org != id.Org:
		e := notFound(rt, "file", rt.ID)
		e.Message = "No such File object: " + rt.ID
		return f, e
	case err != nil:
		return f, errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	return f, nil
}

// fileRoute answers GET /v1/files/{id}, /content and DELETE for the file's own org.
func (m *middleware) fileRoute(c echo.Context, next echo.HandlerFunc, id Identity, rt endpoint.BatchRoute) *Error {
	ctx := c.Request().Context()
	f, e := m.ownFile(ctx, id, rt)
	if e != nil {
		return e
	}
	if e := m.route(c, f.Model); e != nil {
		return e
	}
	if rt.Op != endpoint.FileDelete {
		_ = next(c) // streamed through: an output file may be large
		return nil
	}
	cw, _ := capture(c, next)
	if cw.ok() {
		if err := m.cfg.Batches.Files.DeleteFile(ctx, f.ID); err != nil && !errors.Is(err, batchfile.ErrUnknownFile) {
			m.cfg.Logger.Warn("escrow: forget a deleted batch file", "file", f.ID, "err", err)
		}
	}
	return passErr(c, cw)
}

// kindOf is the job kind of a batch route.
func kindOf(rt endpoint.BatchRoute) job.Kind {
	if rt.Provider == endpoint.Anthropic {
		return job.AnthropicBatch
	}
	return job.OpenAIBatch
}

// ownBatch is the org's batch job with the route's upstream id, or the 404 another org gets.
func (m *middleware) ownBatch(ctx context.Context, id Identity, rt endpoint.BatchRoute) (job.Job, *Error) {
	j, err := m.cfg.Batches.Jobs.Jobs().JobByUpstream(ctx, kindOf(rt), rt.ID)
	switch {
	case errors.Is(err, job.ErrUnknownJob) || err == nil && j.Org != id.Org:
		what := "batch"
		if rt.Provider == endpoint.Anthropic {
			what = "message batch"
		}
		return j, notFound(rt, what, rt.ID)
	case err != nil:
		return j, errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	return j, nil
}

// batchRoute answers a batch's retrieve, cancel, results and delete for its own org.
func (m *middleware) batchRoute(c echo.Context, next echo.HandlerFunc, id Identity, rt endpoint.BatchRoute) *Error {
	ctx := c.Request().Context()
	j, e := m.ownBatch(ctx, id, rt)
	if e != nil {
		return e
	}
	if e := m.route(c, j.Model); e != nil {
		return e
	}
	if rt.Op == endpoint.MsgBatchResults {
		_ = next(c) // streamed through
		return nil
	}
	cw, _ := capture(c, next)
	if cw.ok() && j.Live() {
		m.sawBatch(ctx, j, cw.body.Bytes())
	}
	if cw.ok() && rt.Provider == endpoint.Anthropic {
		out := ownResultsURL(c, cw.body.Bytes())
		cw.body = *bytes.NewBuffer(out)
	}
	return passErr(c, cw)
}

// ownResultsURL points a message batch's results_url at escrow's own results route: the
// Anthropic SDKs fetch the results from it with the client's key, which must never go to the
// upstream (and the upstream's answer would not be scoped to the org).
func ownResultsURL(c echo.Context, body []byte) []byte {
	r := gjson.GetBytes(body, "results_url")
	id := gjson.GetBytes(body, "id").String()
	if r.Type != gjson.String || id == "" {
		return body
	}
	u := c.Scheme() + "://" + c.Request().Host + "/v1/messages/batches/" + id + "/results"
	if out, err := sjson.SetBytes(body, "results_url", u); err == nil {
		return out
	}
	return body
}

// sawBatch learns from a batch object a client read: its result files are the org's, and a
// batch that ended is settled at once (the poller's next pass).
func (m *middleware) sawBatch(ctx context.Context, j job.Job, obj []byte) {
	o := gjson.ParseBytes(obj)
	if j.Kind == job.OpenAIBatch {
		m.recordOutputs(ctx, j, o)
		if openAIStatus(o.Get("status").String()).Terminal() {
			m.cfg.Batches.Jobs.Kick()
		}
		return
	}
	if o.Get("processing_status").String() == "ended" {
		m.cfg.Batches.Jobs.Kick()
	}
}

// recordOutputs records a batch's output and error files for the batch's org.
func (m *middleware) recordOutputs(ctx context.Context, j job.Job, o gjson.Result) {
	for _, k := range []string{"output_file_id", "error_file_id"} {
		fid := o.Get(k).String()
		if fid == "" {
			continue
		}
		err := m.cfg.Batches.Files.RecordFile(ctx, batchfile.File{ID: fid, Org: j.Org, KeyID: j.KeyID, Purpose: batchfile.PurposeOutput,
			Filename: k, Model: j.Model, Endpoint: j.Endpoint, Batch: j.UpstreamID})
		if err != nil {
			m.cfg.Logger.Warn("escrow: record a batch's result file", "file", fid, "batch", j.UpstreamID, "err", err)
		}
	}
}

// createBatch holds a batch's bound, creates it upstream and records it as a job.
func (m *middleware) createBatch(c echo.Context, next echo.HandlerFunc, id Identity, rt endpoint.BatchRoute, o *Outcome) *Error {
	req := c.Request()
	ctx := req.Context()
	kind := kindOf(rt)
	limit := int64(maxControlBody)
	if kind == job.AnthropicBatch {
		limit = endpoint.MaxMsgBatchBytes
	}
	body, e := readBody(req, limit)
	if e != nil {
		return e
	}
	var sum batchSum
	var data batchData
	if kind == job.AnthropicBatch {
		if body, sum, e = m.readMsgBatch(ctx, body); e != nil {
			return e
		}
	} else {
		if e := checkJSONObject(body); e != nil {
			return e
		}
		in := gjson.ParseBytes(body)
		fileID := in.Get("input_file_id").String()
		f, e := m.ownFile(ctx, id, endpoint.BatchRoute{Op: endpoint.FileGet, ID: fileID})
		if e != nil || f.Purpose != batchfile.PurposeBatch {
			return &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Code: CodeNotFound, Param: "input_file_id",
				Message: "No such File object: " + fileID}
		}
		if ep := in.Get("endpoint").String(); ep != f.Endpoint {
			return errInvalid("endpoint", fmt.Sprintf("The batch's endpoint %q is not the one its file's lines call (%s).", ep, f.Endpoint))
		}
		sum = batchSum{endpoint: f.Endpoint, model: f.Model, lines: f.Lines, bound: f.Bound, estimate: f.Estimate, maxLine: f.MaxLine,
			models: map[string]pricing.Prices{f.Model: f.Prices}}
		data.InputFileID = f.ID
	}
	data.Lines, data.MaxLine, data.Models = sum.lines, sum.maxLine, sum.models
	o.Model = sum.model
	u, err := uuid.NewV7()
	if err != nil {
		return errInternal("No request id could be made.")
	}
	holdID := u.String()
	o.HoldID, o.HoldAmount = holdID, sum.bound
	res, e := m.reserveBatch(ctx, id, holdID, sum)
	if e != nil {
		return e
	}
	lease, _ := m.cfg.Store.KeepAlive(id.Org, holdID, nil) // until the job owns the hold
	defer lease.Stop()
	if e := m.route(c, sum.model); e != nil {
		m.release(id.Org, holdID)
		return e
	}
	setBody(req, body)
	cw, _ := capture(c, next)
	obj := gjson.ParseBytes(cw.body.Bytes())
	upID := obj.Get("id").String()
	if !cw.ok() || upID == "" {
		m.release(id.Org, holdID) // the upstream took nothing
		return passErr(c, cw)
	}
	raw, _ := json.Marshal(data)
	j := job.Job{ID: holdID, Kind: kind, Org: id.Org, KeyID: id.KeyID, Project: res.Project, Model: sum.model, Endpoint: sum.endpoint,
		UpstreamID: upID, Hold: sum.bound, ReservedAt: res.ReservedAt, Estimate: min(sum.estimate, sum.bound),
		Prices: sum.models[sum.model], Data: raw}
	if id.Exempt {
		j.Hold, j.Estimate = 0, 0
	}
	if _, err := m.cfg.Batches.Jobs.Begin(ctx, j); err != nil {
		m.cfg.Logger.Error("escrow: record a batch job; cancelling it upstream", "batch", upID, "org", id.Org, "err", err)
		m.cancelUpstream(kind, sum.model, upID)
		m.release(id.Org, holdID)
		return errUnavailable("The billing service could not record the batch; it was cancelled. Please retry.", m.cfg.RetryAfter)
	}
	c.Response().Header().Set("x-request-id", holdID)
	if kind == job.OpenAIBatch {
		m.recordOutputs(ctx, j, obj) // a batch refused at once may name its error file already
	}
	return passErr(c, cw)
}

// reserveBatch reserves a batch's bound: never fitted, refused with the numbers.
func (m *middleware) reserveBatch(ctx context.Context, id Identity, holdID string, sum batchSum) (balance.Reservation, *Error) {
	amount := sum.bound
	if id.Exempt {
		amount = 0
	}
	rctx, cancel := context.WithTimeout(ctx, m.cfg.ReserveTimeout)
	defer cancel()
	res, err := m.cfg.Store.Reserve(rctx, balance.ReserveRequest{Org: id.Org, HoldID: holdID, Amount: amount, KeyID: m.limitKey(id), Exempt: id.Exempt})
	if err == nil {
		return res, nil
	}
	var ins *balance.InsufficientError
	var lim *balance.LimitError
	switch {
	case errors.As(err, &ins):
		return res, &Error{Status: http.StatusTooManyRequests, Type: TypeInsufficientQuota, Code: CodeInsufficientQuota, NoRetry: true,
			Message: fmt.Sprintf("%s: this batch holds %d (the bounds of its %d lines at the batch price) and %d is available. A batch is never shortened to fit: add credit or split it.",
				quotaPrefix, sum.bound, sum.lines, ins.Balance)}
	case errors.As(err, &lim):
		return res, limitRefusal(lim)
	}
	if e := rateRefusal(err, time.Now()); e != nil {
		return res, e
	}
	e, unknown := m.reserveError(err, amount)
	if unknown {
		m.releaseLater(id.Org, holdID, err)
	}
	if e == nil { // fail-open: a batch never runs without its hold
		e = errUnavailable("The balance service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	return res, e
}

// cancelUpstream cancels a batch escrow could not record, in the background.
func (m *middleware) cancelUpstream(kind job.Kind, model, upID string) {
	path := "/v1/batches/" + upID + "/cancel"
	if kind == job.AnthropicBatch {
		path = "/v1/messages/batches/" + upID + "/cancel"
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if st, _, err := m.upstreamDo(ctx, model, http.MethodPost, path, nil, maxControlBody); err != nil || st >= 300 {
			m.cfg.Logger.Error("escrow: cancel an unrecorded batch upstream", "batch", upID, "status", st, "err", err)
		}
	}()
}

// listBatches answers a list of batches with the org's own, each as the upstream has it now.
func (m *middleware) listBatches(c echo.Context, id Identity, rt endpoint.BatchRoute) *Error {
	ctx := c.Request().Context()
	limit, _ := strconv.Atoi(c.QueryParam("limit"))
	if limit <= 0 || limit > 100 {
		limit = 20
	}
	jobs, err := m.cfg.Batches.Jobs.Jobs().Jobs(ctx, job.Query{Org: id.Org, Kind: kindOf(rt), Limit: limit})
	if err != nil {
		return errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	data := make([]json.RawMessage, 0, len(jobs))
	for _, j := range jobs {
		st, b, err := m.upstreamDo(ctx, j.Model, http.MethodGet, batchPath(j), nil, maxCaptured)
		if err != nil || st != http.StatusOK || !gjson.ValidBytes(b) {
			continue // gone upstream (deleted, expired from its listing)
		}
		if j.Kind == job.AnthropicBatch {
			b = ownResultsURL(c, b)
		}
		data = append(data, json.RawMessage(b))
	}
	out := map[string]any{"data": data, "has_more": false, "first_id": nil, "last_id": nil}
	if rt.Provider == endpoint.OpenAI {
		out["object"] = "list"
	}
	if len(jobs) > 0 {
		out["first_id"], out["last_id"] = jobs[0].UpstreamID, jobs[len(jobs)-1].UpstreamID
	}
	_ = c.JSON(http.StatusOK, out)
	return nil
}

func batchPath(j job.Job) string {
	if j.Kind == job.AnthropicBatch {
		return "/v1/messages/batches/" + j.UpstreamID
	}
	return "/v1/batches/" + j.UpstreamID
}

// openAIStatus maps an OpenAI batch status to a job status.
func openAIStatus(s string) job.Status {
	switch s {
	case "validating":
		return job.Pending
	case "completed":
		return job.Completed
	case "failed":
		return job.Failed
	case "expired":
		return job.Expired
	case "cancelled":
		return job.Cancelled
	}
	return job.Running // in_progress, finalizing, cancelling
}

// pollOpenAIBatch is the job core's poll of an OpenAI batch: once it ended, every line of its
// output file that ran is billed; failed, expired and cancelled lines cost nothing.
func (m *middleware) pollOpenAIBatch(ctx context.Context, j job.Job) (async.Observation, error) {
	st, b, err := m.upstreamDo(ctx, j.Model, http.MethodGet, batchPath(j), nil, maxCaptured)
	switch {
	case err != nil:
		return async.Observation{}, err
	case st == http.StatusNotFound:
		return async.Observation{Gone: true, Reason: "batch not found upstream"}, nil
	case st != http.StatusOK:
		return async.Observation{}, fmt.Errorf("escrow: poll batch %s: upstream status %d", j.UpstreamID, st)
	}
	o := gjson.ParseBytes(b)
	status := openAIStatus(o.Get("status").String())
	if !status.Terminal() {
		return async.Observation{Status: status}, nil
	}
	m.recordOutputs(ctx, j, o)
	var data batchData
	_ = json.Unmarshal(j.Data, &data)
	var lines []job.Line
	for _, k := range []string{"output_file_id", "error_file_id"} {
		if fid := o.Get(k).String(); fid != "" {
			if lines, err = m.billResultFile(ctx, j, data, "/v1/files/"+fid+"/content", lines); err != nil {
				return async.Observation{}, err
			}
		}
	}
	var ended time.Time
	for _, k := range []string{"completed_at", "failed_at", "expired_at", "cancelled_at"} {
		if t := o.Get(k).Int(); t > 0 {
			ended = time.Unix(t, 0)
		}
	}
	reason := o.Get("errors.data.0.code").String()
	return async.Observation{Status: status, Lines: lines, EndedAt: ended, Reason: reason}, nil
}

// pollMsgBatch is the job core's poll of an Anthropic message batch: once it ended, every
// succeeded request is billed; errored, canceled and expired ones cost nothing.
func (m *middleware) pollMsgBatch(ctx context.Context, j job.Job) (async.Observation, error) {
	st, b, err := m.upstreamDo(ctx, j.Model, http.MethodGet, batchPath(j), nil, maxCaptured)
	switch {
	case err != nil:
		return async.Observation{}, err
	case st == http.StatusNotFound:
		return async.Observation{Gone: true, Reason: "message batch not found upstream"}, nil
	case st != http.StatusOK:
		return async.Observation{}, fmt.Errorf("escrow: poll message batch %s: upstream status %d", j.UpstreamID, st)
	}
	o := gjson.ParseBytes(b)
	if o.Get("processing_status").String() != "ended" {
		return async.Observation{Status: job.Running}, nil
	}
	status := job.Completed
	switch {
	case o.Get("cancel_initiated_at").Type == gjson.String:
		status = job.Cancelled
	case o.Get("request_counts.expired").Int() > 0:
		status = job.Expired
	}
	var data batchData
	_ = json.Unmarshal(j.Data, &data)
	lines, err := m.billResultFile(ctx, j, data, batchPath(j)+"/results", nil)
	if err != nil {
		return async.Observation{}, err
	}
	var ended time.Time
	if t, err := time.Parse(time.RFC3339, o.Get("ended_at").String()); err == nil {
		ended = t
	}
	return async.Observation{Status: status, Lines: lines, EndedAt: ended}, nil
}

// maxResultLine bounds one line of a result file that escrow reads for its usage; a longer
// line that ran is charged the batch's largest line bound.
const maxResultLine = 64 << 20

// billResultFile reads a result file (OpenAI's output or error file, Anthropic's results) line
// by line and appends a billed line for each request that ran.
func (m *middleware) billResultFile(ctx context.Context, j job.Job, data batchData, path string, lines []job.Line) ([]job.Line, error) {
	res, err := m.upstreamOpen(ctx, j.Model, http.MethodGet, path, nil)
	if err != nil {
		return nil, err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("escrow: read %s: upstream status %d", path, res.StatusCode)
	}
	br := newLineReader(res.Body)
	for {
		raw, err := readLine(br, maxResultLine)
		if errors.Is(err, errLineTooLong) {
			// A line this long is a reply that ran (errors and expiries are short): charged
			// the most any line could cost; the rest of the line is skipped.
			lines = append(lines, job.Line{Model: j.Model, Endpoint: j.Endpoint, Cost: data.MaxLine, Estimated: true})
			if err = skipLine(br); err != nil && !errors.Is(err, io.EOF) {
				return nil, err
			}
			if errors.Is(err, io.EOF) {
				break
			}
			continue
		}
		if err != nil && !errors.Is(err, io.EOF) {
			return nil, err
		}
		if len(bytes.TrimSpace(raw)) > 0 {
			if l, ok := m.billLine(j, data, raw); ok {
				lines = append(lines, l)
			}
		}
		if err != nil {
			break
		}
	}
	return lines, nil
}

// billLine is the billed line of one result line, ok false for a request that did not run
// (or ran and failed: upstreams bill neither).
func (m *middleware) billLine(j job.Job, data batchData, raw []byte) (job.Line, bool) {
	o := gjson.ParseBytes(raw)
	l := job.Line{CustomID: o.Get("custom_id").String(), Model: j.Model, Endpoint: j.Endpoint}
	var u pricing.Usage
	ok := false
	if j.Kind == job.AnthropicBatch {
		r := o.Get("result")
		if r.Get("type").String() != "succeeded" {
			return l, false
		}
		if mm := r.Get("message.model").String(); mm != "" {
			l.Model = mm
		}
		if a, got := anthropicUsageOf(r.Get("message.usage")); got && a.complete() {
			u, ok = a.usage(), true
		}
	} else {
		st := o.Get("response.status_code").Int()
		if st < 200 || st > 299 {
			return l, false
		}
		u, ok = usageOf(o.Get("response.body.usage"))
	}
	prices := data.Models[l.Model]
	if prices == nil {
		prices, l.Model = j.Prices, firstOf(j.Model, l.Model) // a reply naming a model version: the job's prices
	}
	if ok {
		if cost, err := prices.Cost(u); err == nil {
			l.Usage, l.Cost = u, cost
			return l, true
		}
	}
	// It ran, but its usage cannot be read (or priced): charged the most a line could cost.
	l.Cost, l.Estimated = data.MaxLine, true
	return l, true
}

func firstOf(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func newLineReader(r io.Reader) *bufio.Reader { return bufio.NewReaderSize(r, 64<<10) }

// skipLine reads past the rest of a line.
func skipLine(br *bufio.Reader) error {
	for {
		_, err := br.ReadSlice('\n')
		if !errors.Is(err, bufio.ErrBufferFull) {
			return err
		}
	}
}
