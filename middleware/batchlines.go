package middleware

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// Batch lines (DESIGN.md "Async work"): every line of a batch — a line of an OpenAI batch input
// file, a request of an Anthropic message batch — is checked by its endpoint's spec with the
// same edge rules as a live request and bounded at the batch price (pricing.Prices.Batch):
// the hold a batch takes is the sum of its lines' bounds. Lines are never fitted. Each line
// leaves carrying the cap its bound priced (capBody), as a live request does.

// batchLine is one checked line.
type batchLine struct {
	model  string
	prices pricing.Prices // the model's batch prices
	bound  int64          // the line's hold at the batch price
	input  int64          // its input bound (≤ bound): what it costs at least once run
	body   []byte         // the body to send, carrying the cap the bound priced
}

// batchSum is what the lines of one batch add up to.
type batchSum struct {
	endpoint string
	model    string
	lines    int
	bound    int64
	estimate int64
	maxLine  int64
	bytes    int64
	models   map[string]pricing.Prices // each model's batch prices
	ids      map[string]struct{}       // custom ids seen
}

// add counts one checked line, with its custom id; an error for a repeated id or a sum past
// the money range.
func (s *batchSum) add(customID string, l batchLine) error {
	if s.ids == nil {
		s.ids, s.models = map[string]struct{}{}, map[string]pricing.Prices{}
	}
	if _, dup := s.ids[customID]; dup {
		return fmt.Errorf("the custom_id %q is used twice (each line needs its own)", customID)
	}
	if s.bound > balance.MaxAmount-l.bound {
		return fmt.Errorf("the batch's bounds add up past %d micro-units; split it", int64(balance.MaxAmount))
	}
	s.ids[customID] = struct{}{}
	s.models[l.model] = l.prices
	s.lines++
	s.bound += l.bound
	s.estimate += l.input
	s.maxLine = max(s.maxLine, l.bound)
	if s.model == "" {
		s.model = l.model
	}
	return nil
}

// checkBatchLine checks one line's body for spec's endpoint and bounds it at the batch price.
func (m *middleware) checkBatchLine(ctx context.Context, spec *endpoint.Spec, body []byte) (batchLine, *Error) {
	r, e := parseRequest(spec.Path, body)
	if e != nil {
		return batchLine{}, e
	}
	switch {
	case r.Stream:
		return batchLine{}, errInvalid("stream", "A batch line cannot stream: remove 'stream'.")
	case r.Background:
		return batchLine{}, errInvalid("background", "A batch line cannot run in the background.")
	case r.Proof != nil || r.Spec.Free:
		return batchLine{}, errInvalid("url", "This endpoint cannot be used in a batch.")
	}
	for _, f := range r.Features {
		if !m.allow[f] && classFeatures[f] == nil {
			return batchLine{}, errFeature(f)
		}
	}
	if e := m.endUser(http.Header{}, &r); e != nil {
		return batchLine{}, e
	}
	model, _, e := m.priceModel(ctx, body, &r)
	if e != nil {
		return batchLine{}, e
	}
	model.Prices = model.Prices.Batch()
	learned, err := m.cfg.Store.ModelMax(ctx, model.Name)
	if err != nil {
		learned = 0
	}
	amount, err := m.cfg.HoldFunc(ctx, HoldInput{Request: r, Model: model, LearnedMax: learned, Fallback: m.cfg.DefaultHold})
	if err != nil || amount <= 0 || amount > balance.MaxAmount {
		m.cfg.Logger.Error("escrow: bad batch line bound", "model", r.Model, "amount", amount, "err", err)
		return batchLine{}, errInternal("The bound of a batch line could not be computed.")
	}
	if c := outputCapOf(model, r); c > 0 {
		body = m.capBody(body, r, c)
	}
	input, _ := requestBound(model, r, 0)
	return batchLine{model: model.Name, prices: model.Prices, bound: amount, input: min(max(input, 0), amount), body: body}, nil
}

// lineError names the line a refusal is about; nothing of the batch is stored.
func lineError(n int, customID string, e *Error) *Error {
	out := *e
	if out.Status < 500 {
		out.Status = http.StatusBadRequest
	}
	name := fmt.Sprintf("Line %d", n)
	if customID != "" {
		name += fmt.Sprintf(" (custom_id %q)", customID)
	}
	out.Message = name + ": " + e.Message
	return &out
}

// errUploadStopped: the upload's copy to the upstream stopped (the upstream answered or left);
// the upstream's own answer is passed on.
var errUploadStopped = &Error{Status: http.StatusBadGateway, Type: TypeServer, Code: "upstream_error", Message: "The upstream stopped reading the upload."}

// readBatchFile reads an OpenAI batch input file as it streams: every line is checked and
// bounded (checkBatchLine) and written to w carrying its cap; first is called with the model of
// the first line before that line is written. A bad line stops the read with a 400 naming it.
func (m *middleware) readBatchFile(ctx context.Context, r io.Reader, w io.Writer, first func(model string)) (batchSum, *Error) {
	var sum batchSum
	br := bufio.NewReaderSize(r, 64<<10)
	maxLine := m.cfg.MaxRequestBytes + 64<<10 // a line's envelope around a body of the live limit
	for n := 1; ; n++ {
		raw, err := readLine(br, maxLine)
		sum.bytes += int64(len(raw))
		if errors.Is(err, errLineTooLong) {
			return sum, lineError(n, "", &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: "file",
				Message: fmt.Sprintf("the line is longer than %d bytes.", maxLine)})
		}
		if err != nil && !errors.Is(err, io.EOF) {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				return sum, &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: CodeRequestTooLarge, Param: "file",
					Message: fmt.Sprintf("The batch file is larger than %d bytes.", endpoint.MaxBatchFileBytes)}
			}
			return sum, errInvalid("file", "The upload could not be read: "+err.Error())
		}
		if len(bytes.TrimSpace(raw)) > 0 {
			if e := m.fileLine(ctx, n, raw, w, &sum, first); e != nil {
				return sum, e
			}
		}
		if err != nil { // io.EOF
			break
		}
	}
	if sum.lines == 0 {
		return sum, errInvalid("file", "The batch file has no request lines.")
	}
	return sum, nil
}

// fileLine checks one line of a batch input file and writes it out.
func (m *middleware) fileLine(ctx context.Context, n int, raw []byte, w io.Writer, sum *batchSum, first func(string)) *Error {
	bad := func(param, msg string) *Error { return lineError(n, "", errInvalid(param, msg)) }
	if !gjson.ValidBytes(raw) || !gjson.ParseBytes(raw).IsObject() {
		return bad("file", "the line is not one JSON object.")
	}
	var l struct {
		CustomID *string         `json:"custom_id"`
		Method   string          `json:"method"`
		URL      string          `json:"url"`
		Body     json.RawMessage `json:"body"`
	}
	if err := json.Unmarshal(raw, &l); err != nil {
		return bad("file", "the line does not have the shape {custom_id, method, url, body}: "+err.Error())
	}
	switch {
	case l.CustomID == nil || *l.CustomID == "" || len(*l.CustomID) > 512:
		return bad("custom_id", "'custom_id' must be a string of 1 to 512 characters.")
	case l.Method != http.MethodPost:
		return lineError(n, *l.CustomID, errInvalid("method", "'method' must be POST."))
	}
	spec := endpoint.Lookup(l.URL)
	if spec == nil || !spec.Batch || spec.Provider != endpoint.OpenAI {
		return lineError(n, *l.CustomID, errInvalid("url", fmt.Sprintf("'url' %q is not an endpoint a batch can call.", l.URL)))
	}
	if sum.endpoint != "" && l.URL != sum.endpoint {
		return lineError(n, *l.CustomID, errInvalid("url", fmt.Sprintf("every line of a batch file must call the same endpoint (the first calls %s).", sum.endpoint)))
	}
	line, e := m.checkBatchLine(ctx, spec, l.Body)
	if e != nil {
		return lineError(n, *l.CustomID, e)
	}
	if sum.model != "" && line.model != sum.model {
		return lineError(n, *l.CustomID, errInvalid("model", fmt.Sprintf("every line of a batch file must use the same model (the first uses %s).", sum.model)))
	}
	if err := sum.add(*l.CustomID, line); err != nil {
		return lineError(n, *l.CustomID, errInvalid("custom_id", err.Error()))
	}
	if sum.lines > endpoint.MaxBatchLines {
		return lineError(n, *l.CustomID, errInvalid("file", fmt.Sprintf("a batch holds at most %d lines.", endpoint.MaxBatchLines)))
	}
	if sum.endpoint == "" {
		sum.endpoint = l.URL
		first(line.model)
	}
	out, err := json.Marshal(struct {
		CustomID string          `json:"custom_id"`
		Method   string          `json:"method"`
		URL      string          `json:"url"`
		Body     json.RawMessage `json:"body"`
	}{*l.CustomID, l.Method, l.URL, line.body})
	if err != nil {
		return errInternal("A batch line could not be written.")
	}
	if _, err := w.Write(append(out, '\n')); err != nil {
		return errUploadStopped
	}
	return nil
}

// errLineTooLong: a line past the limit.
var errLineTooLong = errors.New("line too long")

// readLine reads one line (without its newline) of at most limit bytes; io.EOF with the last
// line when the input ends.
func readLine(br *bufio.Reader, limit int64) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if int64(len(line)+len(chunk)) > limit+1 {
			return line, errLineTooLong
		}
		line = append(line, chunk...)
		switch {
		case err == nil:
			return bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r")), nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		default:
			return line, err
		}
	}
}

// readMsgBatch checks the requests of an Anthropic message batch create body and returns the
// body to send, every request's params carrying its cap.
func (m *middleware) readMsgBatch(ctx context.Context, body []byte) ([]byte, batchSum, *Error) {
	var sum batchSum
	if e := checkJSONObject(body); e != nil {
		return nil, sum, e
	}
	var in struct {
		Requests []struct {
			CustomID *string         `json:"custom_id"`
			Params   json.RawMessage `json:"params"`
		} `json:"requests"`
	}
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, sum, errInvalid("requests", "The body must be {\"requests\": [{\"custom_id\", \"params\"}, …]}: "+err.Error())
	}
	if len(in.Requests) == 0 || len(in.Requests) > endpoint.MaxBatchLines {
		return nil, sum, errInvalid("requests", fmt.Sprintf("'requests' must hold 1 to %d requests.", endpoint.MaxBatchLines))
	}
	type outReq struct {
		CustomID string          `json:"custom_id"`
		Params   json.RawMessage `json:"params"`
	}
	out := make([]outReq, 0, len(in.Requests))
	for i, q := range in.Requests {
		name := func(e *Error) *Error {
			x := *e
			if x.Status < 500 {
				x.Status = http.StatusBadRequest
			}
			x.Message = fmt.Sprintf("requests.%d: %s", i, e.Message)
			return &x
		}
		if q.CustomID == nil || !validMsgCustomID(*q.CustomID) {
			return nil, sum, name(errInvalid("custom_id", "custom_id must be 1 to 64 letters, digits, '-' or '_'."))
		}
		line, e := m.checkBatchLine(ctx, endpoint.Messages, q.Params)
		if e != nil {
			return nil, sum, name(e)
		}
		if err := sum.add(*q.CustomID, line); err != nil {
			return nil, sum, name(errInvalid("custom_id", err.Error()))
		}
		out = append(out, outReq{*q.CustomID, line.body})
	}
	sum.endpoint = endpoint.Messages.Path
	b, err := json.Marshal(struct {
		Requests []outReq `json:"requests"`
	}{out})
	if err != nil {
		return nil, sum, errInternal("The batch could not be written.")
	}
	sum.bytes = int64(len(b))
	return b, sum, nil
}

func validMsgCustomID(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	return strings.IndexFunc(s, func(r rune) bool {
		return !(r == '-' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
	}) < 0
}
