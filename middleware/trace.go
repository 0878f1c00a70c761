package middleware

import (
	"context"
	"net/http"

	"github.com/labstack/echo/v4"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Traces (OpenTelemetry): one span per request the middleware serves, "escrow.request", with a
// child for each step — "escrow.reserve" (the hold in Redis), "escrow.upstream" (the handler:
// the call to the model, whose request carries the W3C traceparent), "escrow.finish" (usage
// read, cost, receipt) and, under it, "escrow.record" (the usage event's record and the hold's
// finish). Attributes name the org, the model, the hold, amounts and statuses — never a key, a
// prompt or a body. Without Config.TracerProvider the tracer is a no-op: nothing is allocated
// or exported.

// TracerName is the instrumentation scope of the middleware's spans.
const TracerName = "github.com/llmescrow/escrow/middleware"

// Span names.
const (
	SpanRequest  = "escrow.request"
	SpanReserve  = "escrow.reserve"
	SpanUpstream = "escrow.upstream"
	SpanFinish   = "escrow.finish"
	SpanRecord   = "escrow.record"
)

// Span attribute keys.
const (
	AttrOrg        = attribute.Key("escrow.org")
	AttrModel      = attribute.Key("escrow.model")
	AttrHold       = attribute.Key("escrow.hold_id")
	AttrHoldAmount = attribute.Key("escrow.hold_amount")
	AttrCost       = attribute.Key("escrow.cost")
	AttrOutcome    = attribute.Key("escrow.outcome")
	AttrCode       = attribute.Key("escrow.error_code")
	AttrStatus     = attribute.Key("http.response.status_code")
)

var traceContext = propagation.TraceContext{}

// newTracer is the middleware's tracer; nil without a provider (then traced serves the request
// as it is: no context, span or header look-up is added to the request path).
func newTracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return nil
	}
	if _, ok := tp.(noop.TracerProvider); ok {
		return nil
	}
	return tp.Tracer(TracerName)
}

// traced serves the request inside its span (a child of a traceparent the client sent) and
// adds what the outcome says to it.
func (m *middleware) traced(c echo.Context, next echo.HandlerFunc) error {
	if m.tracer == nil {
		return m.serve(c, next)
	}
	req := c.Request()
	ctx := traceContext.Extract(req.Context(), propagation.HeaderCarrier(req.Header))
	ctx, span := m.tracer.Start(ctx, SpanRequest, trace.WithSpanKind(trace.SpanKindServer))
	if !span.IsRecording() {
		return m.serve(c, next)
	}
	defer span.End()
	c.SetRequest(req.WithContext(ctx))
	err := m.serve(c, next)
	st := c.Response().Status
	span.SetAttributes(AttrStatus.Int(st))
	if st >= http.StatusInternalServerError {
		span.SetStatus(codes.Error, http.StatusText(st))
	}
	return err
}

// observe adds the outcome to the request's span (at its report).
func observe(o Outcome) {
	span := o.span
	if span == nil || !span.IsRecording() {
		return
	}
	attrs := []attribute.KeyValue{AttrOrg.String(o.Org), AttrModel.String(o.Model), AttrOutcome.String(string(o.Kind)), AttrCost.Int64(o.Cost)}
	if o.HoldID != "" {
		attrs = append(attrs, AttrHold.String(o.HoldID))
	}
	if o.Code != "" {
		attrs = append(attrs, AttrCode.String(o.Code))
	}
	span.SetAttributes(attrs...)
}

// startStep starts a step's span under ctx's; it is a no-op span when ctx has no recording one.
// Callers add the step's attributes under span.IsRecording(), so an untraced request builds
// (and allocates) none.
func (m *middleware) startStep(ctx context.Context, name string) (context.Context, trace.Span) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, trace.SpanFromContext(ctx)
	}
	return m.tracer.Start(ctx, name)
}

// startFinish starts the finish span under the request's span (in ctx), in a context of its own
// (Background: the record outlives the client's request); Background and a no-op span when the
// request is not traced.
func (m *middleware) startFinish(ctx context.Context, holdID string) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() {
		return context.Background(), parent
	}
	return m.tracer.Start(trace.ContextWithSpan(context.Background(), parent), SpanFinish, trace.WithAttributes(AttrHold.String(holdID)))
}

// endStep ends a step's span, marking it failed with err (its text: escrow's errors name no
// secret).
func endStep(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// injectTrace puts the upstream span's traceparent on the request to the upstream.
func injectTrace(ctx context.Context, h http.Header) {
	if trace.SpanFromContext(ctx).SpanContext().IsValid() {
		traceContext.Inject(ctx, propagation.HeaderCarrier(h))
	}
}
