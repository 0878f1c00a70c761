package middleware

import (
	"context"
	"net/http"
	"strings"

	"github.com/tidwall/gjson"

	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger/job"
	"github.com/llmescrow/escrow/pricing"
)

// Jobs records background work (DESIGN.md "Async work"); *async.Poller implements it.
type Jobs interface {
	// Begin records the job and hands its hold to it (pinned, kept by the job's lease holder)
	// before the client learns its id. An error: the job may not be recorded.
	Begin(ctx context.Context, j job.Job) (job.Job, error)
}

// backgroundRefusal refuses a background request escrow cannot hold until it ends: without a
// Jobs, on an endpoint other than Responses, or streamed (a streamed create hands the client
// the id in its first event, before the job could be recorded; a client streams a background
// response with GET …?stream=true instead).
func (m *middleware) backgroundRefusal(r Request) *Error {
	switch {
	case !r.Background:
		return nil
	case m.cfg.Jobs == nil || r.Spec == nil || r.Spec.Path != endpoint.Responses.Path:
		return errInvalid("background", "Background responses are billed after the request ends and are not supported here.")
	case r.Stream:
		return errInvalid("stream", "A background response cannot be streamed as it is created here; create it, then stream it with GET /v1/responses/{id}?stream=true.")
	}
	return nil
}

// beginJob records the job of a background response whose creation the upstream accepted,
// before the client gets the answer, and sends the answer. It returns false when the answer
// names no response it could record (or the ledger refused it): the request is then billed as
// any other 2xx without usage, at its hold, so work the upstream does is never free.
func (cl *call) beginJob(cw *captureWriter, o *Outcome) bool {
	m := cl.m
	if cw.mode != modeJSON || cw.streaming {
		return false
	}
	id, status, _, _ := ResponseState(cw.buf)
	if id == "" || status == "" {
		m.cfg.Logger.Warn("escrow: a background response's answer names no response; billed at its hold", "hold_id", cl.holdID, "org", cl.id.Org)
		return false
	}
	estimate, err := cl.model.BoundFor(int64(cl.req.Size), 0, billable(cl.req))
	if err != nil {
		estimate = cl.holdAmount
	}
	j := job.Job{ID: cl.holdID, Kind: job.BackgroundResponse, Org: cl.id.Org, KeyID: cl.id.KeyID,
		Project: cl.reserved.Project, EndUser: cl.req.EndUser, Model: cl.req.Model, Endpoint: cl.req.Spec.Path,
		UpstreamID: id, Hold: cl.holdAmount, ReservedAt: cl.reserved.ReservedAt,
		Estimate: min(estimate, cl.holdAmount), Prices: cl.model.Prices}
	ctx, cancel := context.WithTimeout(cl.traceCtx, m.cfg.RecordTimeout)
	_, err = m.cfg.Jobs.Begin(ctx, j)
	cancel()
	if err != nil {
		m.cfg.Logger.Error("escrow: background job not recorded; billed at its hold", "hold_id", cl.holdID, "org", cl.id.Org, "upstream_id", id, "err", err)
		return false
	}
	o.Kind, o.Status = OutcomeJob, http.StatusOK
	cw.commit(costReceipt{})
	return true
}

// ResponseState reads a Responses API object (a JSON body): its id, its status (queued,
// in_progress, completed, incomplete, failed, cancelled) and its usage when it has one. The
// one reading of a response object for the job core: the poll, the client's GET and the
// create's answer all go through it.
func ResponseState(body []byte) (id, status string, usage pricing.Usage, ok bool) {
	if !gjson.ValidBytes(body) {
		return "", "", pricing.Usage{}, false
	}
	root := gjson.ParseBytes(body)
	var f [3]gjson.Result
	lastMembers(root, []string{"id", "status", "usage"}, f[:])
	if f[0].Type == gjson.String {
		id = f[0].String()
	}
	if f[1].Type == gjson.String {
		status = strings.ToLower(f[1].String())
	}
	usage, ok = usageOf(f[2])
	return id, status, usage, ok
}

// JobStatus maps a Responses API status to a job status ("" for one it does not know).
func JobStatus(status string) job.Status {
	switch status {
	case "queued":
		return job.Pending
	case "in_progress":
		return job.Running
	case "completed":
		return job.Completed
	case "incomplete":
		return job.Incomplete
	case "failed":
		return job.Failed
	case "cancelled":
		return job.Cancelled
	}
	return ""
}
