package middleware

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"go.opentelemetry.io/otel/trace"
)

var (
	errHangupBound = errors.New("middleware: client hung up and the upstream went on past the bound")
	errHoldLost    = errors.New("middleware: the hold could not be extended before its expiry")
	errNoUsage     = errors.New("middleware: the response carried no usage")
	errStreamError = errors.New("middleware: the upstream ended the stream with an error event")
	errUnreadable  = errors.New("middleware: the response could not be read")
	errNoResponse  = errors.New("middleware: the handler wrote no response")
)

// proxy runs the handler on a context detached from the client's, with the hold kept alive by
// the store, the client's key stripped, and the response captured; then it settles the outcome.
func (cl *call) proxy(c echo.Context, next echo.HandlerFunc, body []byte, o Outcome) error {
	m := cl.m
	req := c.Request()
	cl.setOwnRateHeaders(c.Response().Header())
	r := cl.req
	injected := false
	if r.Stream && !r.IncludeUsage && r.Spec.InjectUsage {
		b, err := injectIncludeUsage(body)
		if err != nil {
			cl.releaseHold()
			return m.refuse(c, o, errInternal("The request could not be prepared."))
		}
		body, injected = b, true
	}
	req.Header.Del("Authorization") // the client's key never goes upstream
	req.Header.Del("X-Api-Key")
	costInStream := wantsCost(req.Header)
	req.Header.Del(HeaderIncludeCost) // escrow's own
	req.Header.Set("Accept-Encoding", "identity")
	setBody(req, body)
	req.Body = &sentBody{ReadCloser: req.Body, sent: &cl.sent}

	clientCtx := req.Context()
	upCtx, upCancel := context.WithCancelCause(context.WithoutCancel(clientCtx))
	defer upCancel(nil)
	c.SetRequest(req.WithContext(upCtx))

	orig := c.Response().Writer
	cw := &captureWriter{
		w:           orig,
		headers:     cl.setHeaders,
		maxJSON:     m.cfg.MaxResponseBytes,
		hangupBytes: m.cfg.HangupBytes,
		hangupAfter: m.cfg.HangupTimeout,
		onBound:     func() { upCancel(errHangupBound) },
		costSSE:     costInStream,
	}
	cw.sse = &sseFilter{inject: injected, responses: r.Spec.Stream == endpoint.StreamResponses, maxEvent: m.cfg.MaxResponseBytes, emit: cw.out}
	cw.scan.anthropic = r.Spec.Stream == endpoint.StreamMessages
	cw.sse.anthropic = cw.scan.anthropic
	c.Response().Writer = cw
	cl.setHeaders(orig.Header())
	stopWatch := context.AfterFunc(clientCtx, cw.markGone)
	lease := cl.keepAlive(upCancel)

	var nextErr error
	var panicked any
	upSpanCtx, upSpan := m.startStep(upCtx, SpanUpstream)
	if upSpan.IsRecording() {
		upSpan.SetAttributes(AttrModel.String(r.Model))
		injectTrace(upSpanCtx, req.Header)
		c.SetRequest(req.WithContext(upSpanCtx))
	}
	func() {
		defer func() { panicked = recover() }()
		nextErr = next(c)
	}()
	if upSpan.IsRecording() {
		upSpan.SetAttributes(AttrStatus.Int(cw.status))
	}
	endStep(upSpan, nextErr)
	lease.Stop()
	stopWatch()
	cw.stop()
	c.Response().Writer = orig
	c.SetRequest(req)

	var fspan trace.Span
	cl.traceCtx, fspan = m.startFinish(clientCtx, cl.holdID)
	abort := cl.finish(cw, nextErr, panicked, context.Cause(upCtx), o)
	fspan.End()
	if panicked != nil {
		panic(panicked)
	}
	if abort {
		panic(http.ErrAbortHandler)
	}
	return nextErr
}

// setHeaders sets the request id (= hold id) on the response. (The cost and the balance after
// it come at commit: see HeaderCost.)
func (cl *call) setHeaders(h http.Header) {
	if up := h.Get("x-request-id"); up != "" && up != cl.holdID {
		h.Set("x-upstream-request-id", up)
	}
	h.Set("x-request-id", cl.holdID)
	h.Set("x-escrow-hold-id", cl.holdID)
	h.Del(HeaderCost) // escrow's own: never the handler's
	h.Del(HeaderBalance)
	cl.oneRateLimitSet(h)
}

// setOwnRateHeaders sets escrow's x-ratelimit-* headers of the hold on h, before the handler
// runs, and keeps them in cl.rate for oneRateLimitSet: built once per request.
func (cl *call) setOwnRateHeaders(h http.Header) {
	cl.rate = http.Header{}
	setRateHeaders(cl.rate, cl.reserved, time.Now())
	for k, v := range cl.rate {
		h[k] = slices.Clone(v)
	}
}

// oneRateLimitSet leaves the client one set of x-ratelimit-* headers, escrow's (the key's
// requests and tokens limits, when it has any): the upstream's — the operator's own quota with
// the provider, no business of the customer's — are dropped, or kept as x-upstream-ratelimit-*
// with Config.RenameUpstreamRateLimit. Escrow's own were set before the handler ran
// (setOwnRateHeaders, kept in cl.rate), so they come first in each header's values; what
// follows them is the upstream's.
func (cl *call) oneRateLimitSet(h http.Header) {
	own := cl.rate
	for k, vals := range h {
		rest, ok := strings.CutPrefix(k, "X-Ratelimit-")
		if !ok {
			continue
		}
		up := vals[min(len(own[k]), len(vals)):]
		delete(h, k)
		if cl.m.cfg.RenameUpstreamRateLimit && len(up) > 0 {
			h["X-Upstream-Ratelimit-"+rest] = up
		}
	}
	for k, v := range own {
		h[k] = slices.Clone(v)
	}
}

func (cl *call) releaseHold() {
	if !cl.failOpen {
		cl.m.release(cl.id.Org, cl.holdID)
	}
}

// finish settles the outcome after the handler returned and reports it. It returns true when
// the connection must be aborted.
func (cl *call) finish(cw *captureWriter, nextErr error, panicked any, cause error, o Outcome) (abort bool) {
	m := cl.m
	defer func() { m.report(o) }()
	o.Status = cw.status
	if cl.unanswered(cw) {
		// The client hung up and the upstream had not answered when the read-on bound ended:
		// the call was cut, but the upstream got it (estimated below); the client saw nothing.
		o.Status = 0
	} else if !cw.wroteHeader || cw.status < 200 || cw.status > 299 {
		// The upstream failed before any response byte (or answered with an error): no charge.
		cl.releaseHold()
		o.Kind = OutcomeReleased
		o.Err = cmpErr(nextErr, panicErr(panicked), errNoResponse)
		if !cw.wroteHeader {
			o.Status = 0
		}
		return false
	}
	cw.end()
	if cl.req.Background && cl.beginJob(cw, &o) {
		return false
	}
	usage, estimated, truncated, why := cl.readUsage(cw, nextErr, panicked, cause)
	usage, cost, estimated := cl.charge(cw, usage, estimated, truncated)
	ev := ledger.UsageEvent{
		// The limit attribution is what the reserve answered (a fail-open request has no reserve
		// time: it is attributed to its record time). A key id the limits layer cannot name is
		// kept for reports; the ledger leaves it out of the entry's attribution, as the reserve
		// left it out of the hold's.
		ID: cl.holdID, Org: cl.id.Org, KeyID: cl.id.KeyID, Project: cl.reserved.Project, ReservedAt: cl.reserved.ReservedAt, EndUser: cl.req.EndUser,
		Model: cl.req.Model, Endpoint: cl.req.Spec.Path,
		Usage: usage, Cost: cost, HoldAmount: cl.holdAmount, Estimated: estimated, CreatedAt: time.Now(),
		Choices: times(max(cl.req.N, 1), max(cl.req.Prompts, 1)), // the worker learns the model's max cost of one choice (of one prompt) from it
	}
	o.Usage, o.Cost, o.Err = usage, cost, why
	rctx, cancel := context.WithTimeout(cl.traceCtx, m.cfg.RecordTimeout)
	rctx, span := m.startStep(rctx, SpanRecord)
	if span.IsRecording() {
		span.SetAttributes(AttrOrg.String(ev.Org), AttrHold.String(ev.ID), AttrCost.Int64(cost))
	}
	rcpt, err := m.record(rctx, ev)
	endStep(span, err)
	cancel()
	if err != nil && cw.served && !recordRefused(err) {
		// Served ⇒ billed: content reached the client, so the event is never voided and its hold
		// never released; it is kept and recorded again until the ledger has it (recordLater),
		// and the client gets its end.
		o.Kind, o.Err = OutcomeRecordLater, err
		cl.recordLater(ev, err)
		cw.commit(costReceipt{cost: cost})
		return false
	}
	if err != nil {
		if done, abort := cl.recordFailed(cw, ev, err, &o); done {
			return abort
		}
	}
	o.Kind = OutcomeRecorded
	if estimated {
		o.Kind = OutcomeEstimated
	}
	// A late-found record (err != nil) is charged, but its finish is unknown: no balance.
	cw.commit(costReceipt{cost: cost, balance: rcpt.Balance, haveBal: err == nil && rcpt.HaveBalance})
	return false
}

// readUsage is the usage the 2xx response reported. When it has none, estimated is true and
// why says what went wrong; truncated tells whether the response was cut off after its first
// byte (only part of it was read) rather than complete without a usage.
func (cl *call) readUsage(cw *captureWriter, nextErr error, panicked any, cause error) (u pricing.Usage, estimated, truncated bool, why error) {
	if cl.req.Proof != nil {
		return pricing.Usage{}, false, false, nil // billed from the request (proven.go)
	}
	usage, ok := cw.usage()
	switch {
	case ok:
	case cw.boundHit.Load() || errors.Is(cause, errHangupBound):
		why, truncated = errHangupBound, true
	case errors.Is(cause, errHoldLost):
		why, truncated = errHoldLost, true
	case nextErr != nil || panicked != nil:
		why, truncated = cmpErr(nextErr, panicErr(panicked)), true
	default:
		why = errNoUsage
		if cw.mode == modeSSE && cw.sse.upstreamError {
			why, truncated = errStreamError, true // the upstream failed after the first byte
		}
	}
	if err := cw.readable(); !ok && err != nil {
		why, truncated = err, false
	}
	return usage, !ok, truncated, why
}

// charge is what the request is charged: its usage priced; for a response cut off, an estimate
// of its usage; for a 2xx whose usage cannot be read, or that cannot be priced, the hold.
func (cl *call) charge(cw *captureWriter, usage pricing.Usage, estimated, truncated bool) (pricing.Usage, int64, bool) {
	if cl.req.Proof != nil {
		return cl.provenCharge(cw)
	}
	switch {
	case truncated:
		// Ended without readable usage after the upstream was called (a hang-up past the
		// read-on bound, a cut, an error event): the one estimate rule (estimate.go).
		usage, cost := cl.estimate(cw)
		return usage, cost, true
	case estimated:
		// A 2xx whose usage cannot be read: charged what the org agreed to risk, the hold
		// (a fail-open request has none on the balance, but the amount it would have held).
		return pricing.Usage{}, max(cl.agreed, 1), true
	}
	cost, err := cl.model.Cost(usage)
	if err != nil {
		// Absurd token counts: charge what was held (and log it) rather than nothing.
		cl.m.cfg.Logger.Error("escrow: usage could not be priced", "hold_id", cl.holdID, "usage", usage, "err", err)
		return usage, max(cl.agreed, 1), true
	}
	return usage, cost, estimated
}

// recordFailed answers a request whose record failed. done is false when the event was stored
// after all (the request completes as recorded); else abort tells whether the connection must
// be cut (the outcome is unknown) rather than answered with an error.
func (cl *call) recordFailed(cw *captureWriter, ev ledger.UsageEvent, err error, o *Outcome) (done, abort bool) {
	m := cl.m
	switch m.recordOutcome(ev, err) {
	case recordStored:
		// The event reached the ledger after all (the void found it): it is charged, so the
		// client gets its success.
		m.cfg.Logger.Warn("escrow: usage recorded late; the request completes", "hold_id", cl.holdID, "org", cl.id.Org, "err", err)
		return false, false
	case recordNotStored:
		// Certainly not billed (refused, or voided so that a late write is a no-op): the client
		// must not see a success, and the hold goes back.
		o.Kind, o.Err = OutcomeRecordFailed, err
		cl.releaseHold()
		e := errUnavailable("The usage of this request could not be recorded; it was not completed.", m.cfg.RetryAfter)
		e.Code = CodeBillingFailed
		if cl.req.Spec.Provider == endpoint.Anthropic {
			e = e.forAnthropic()
		}
		if cw.mode == modeJSON && !cw.streaming {
			o.Status = e.Status
		}
		return true, cw.fail(e)
	}
	// Nobody can tell yet whether the event will be stored: neither a success nor an error
	// would be true, so the connection is cut without either, the hold stays (a stored event
	// settles it), and the void is retried until the ledger answers.
	o.Kind, o.Err, o.Status = OutcomeRecordUnknown, err, 0
	m.voidLater(cl, ev)
	return true, true
}

// recordResult is what became of a usage event whose Record failed.
type recordResult int

const (
	recordUnknown   recordResult = iota // it may still be stored
	recordNotStored                     // it is not stored and never will be
	recordStored                        // it is stored: it is charged
)

// recordOutcome finds out, after a failed Record, whether ev is stored: refusals that happen
// before anything is queued are final; anything else (a timeout while queued or being written,
// a ledger error whose commit may have landed) is settled by voiding the id in the ledger, at
// most RecordTimeout more.
func (m *middleware) recordOutcome(ev ledger.UsageEvent, err error) recordResult {
	if recordRefused(err) || errors.Is(err, ledger.ErrNotRecorded) {
		return recordNotStored
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.VoidTimeout)
	defer cancel()
	return voidResult(m.cfg.Recorder.Void(ctx, ev))
}

// recordRefused reports whether a Record failed before anything was queued, for good: an event
// that can never be stored, or a recorder that no longer takes events.
func recordRefused(err error) bool {
	return errors.Is(err, pricing.ErrInvalidUsage) || errors.Is(err, ledger.ErrInvalidAmount) ||
		errors.Is(err, balance.ErrInvalidOrg) || errors.Is(err, accounting.ErrRecorderClosed)
}

// recordLater records ev again and again, in the background, until the ledger (or the journal)
// has it: its content was served, so it must be billed. Meanwhile its hold is kept alive (no
// reaper releases it: the org cannot spend it twice) and never released. Recording again is
// safe: events are idempotent by id, and nothing voids this one. Only a refusal that can never
// change ends it (an invalid event, or the recorder stopped: then the ledger is written
// directly, once per try, since the process may be shutting down), with the event logged
// whole at error level so it can be billed by hand.
func (cl *call) recordLater(ev ledger.UsageEvent, first error) {
	m := cl.m
	m.cfg.Logger.Warn("escrow: usage record failed after the content was served; kept and recorded again until stored",
		"hold_id", cl.holdID, "org", cl.id.Org, "cost", ev.Cost, "err", first)
	lease := cl.keepAlive(func(error) {}) // a lost lease only means the hold may expire; the record goes on
	go func() {
		defer lease.Stop()
		wait := 50 * time.Millisecond
		for attempt := 1; ; attempt++ {
			ctx, cancel := context.WithTimeout(context.Background(), m.cfg.RecordTimeout)
			_, err := m.record(ctx, ev)
			if errors.Is(err, accounting.ErrRecorderClosed) {
				err = m.cfg.Ledger.RecordUsage(ctx, []ledger.UsageEvent{ev})
			}
			cancel()
			switch {
			case err == nil:
				m.cfg.Logger.Info("escrow: usage of a served request recorded after retrying", "hold_id", cl.holdID, "org", cl.id.Org, "attempts", attempt)
				return
			case errors.Is(err, pricing.ErrInvalidUsage), errors.Is(err, ledger.ErrInvalidAmount), errors.Is(err, balance.ErrInvalidOrg):
				m.cfg.Logger.Error("escrow: usage of a served request can never be recorded; bill it by hand",
					"hold_id", cl.holdID, "event", ev, "err", err)
				return
			case attempt%10 == 0:
				m.cfg.Logger.Error("escrow: usage of a served request still not recorded; retrying", "hold_id", cl.holdID, "org", cl.id.Org, "attempts", attempt, "err", err)
			}
			time.Sleep(wait)
			wait = min(2*wait, 5*time.Second)
		}
	}()
}

func voidResult(err error) recordResult {
	switch {
	case err == nil:
		return recordNotStored
	case errors.Is(err, ledger.ErrUsageRecorded):
		return recordStored
	case errors.Is(err, pricing.ErrInvalidUsage), errors.Is(err, ledger.ErrInvalidAmount), errors.Is(err, balance.ErrInvalidOrg):
		return recordNotStored // the ledger could never store it either
	}
	return recordUnknown // errors.ErrUnsupported (a Recorder that cannot void) included
}

// voidLater retries voiding ev in the background (until ReleaseRetryFor has passed) after a
// connection was cut with the outcome unknown: a successful void gives the hold back; an event
// found stored keeps it, for the settle that will come.
func (m *middleware) voidLater(cl *call, ev ledger.UsageEvent) {
	m.retryLater(func(int) (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), m.cfg.VoidTimeout)
		err := m.cfg.Recorder.Void(ctx, ev)
		cancel()
		if errors.Is(err, errors.ErrUnsupported) {
			m.cfg.Logger.Error("escrow: usage outcome unknown and the recorder cannot void; the hold stays for the reaper",
				"hold_id", cl.holdID, "org", cl.id.Org)
			return true, nil
		}
		switch voidResult(err) {
		case recordNotStored:
			m.cfg.Logger.Info("escrow: usage voided after an unknown outcome; hold released", "hold_id", cl.holdID, "org", cl.id.Org)
			cl.releaseHold()
			return true, nil
		case recordStored:
			m.cfg.Logger.Info("escrow: usage found recorded after an unknown outcome; it is charged", "hold_id", cl.holdID, "org", cl.id.Org)
			return true, nil
		}
		return false, err
	}, func(_ int, err error) {
		m.cfg.Logger.Error("escrow: usage outcome still unknown; giving up voiding (the hold stays for the reaper)",
			"hold_id", cl.holdID, "org", cl.id.Org, "err", err)
	})
}

func cmpErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func panicErr(p any) error {
	switch x := p.(type) {
	case nil:
		return nil
	case error:
		return x
	}
	return errors.New("middleware: handler panicked")
}

// keepAlive has the store keep the hold alive while the handler runs (no timer of its own: a
// request that ends early costs no extension). When the store cannot extend it in time, the
// upstream call is cancelled: the usage is then estimated, and no reaper acts on a live hold.
// nil (fail-open: no hold) stops as a no-op.
func (cl *call) keepAlive(cancel context.CancelCauseFunc) *balance.Lease {
	if cl.failOpen {
		return nil
	}
	m := cl.m
	l, err := m.cfg.Store.KeepAlive(cl.id.Org, cl.holdID, func(err error) {
		m.cfg.Logger.Error("escrow: hold not extended in time; cancelling the upstream call", "hold_id", cl.holdID, "org", cl.id.Org, "err", err)
		cancel(errHoldLost)
	})
	if err != nil {
		// Reserve took the same ids, so only a Holds of another kind gets here.
		m.cfg.Logger.Error("escrow: hold cannot be kept alive; it may expire while the request runs", "hold_id", cl.holdID, "org", cl.id.Org, "err", err)
	}
	return l
}
