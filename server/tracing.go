package server

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Traces (OpenTelemetry, middleware/trace.go) are exported over OTLP/HTTP when the SDK's
// standard variables ask for it: OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, OTEL_TRACES_EXPORTER unset or "otlp", OTEL_SDK_DISABLED
// not "true". The exporter reads the others itself (headers, timeout, compression, TLS), and
// the resource OTEL_SERVICE_NAME (default "escrow") and OTEL_RESOURCE_ATTRIBUTES. Otherwise
// nothing is set up: the middleware's tracer is a no-op.

// tracingWanted reports whether the OTEL_* variables ask for traces.
func tracingWanted() bool {
	if strings.EqualFold(os.Getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	if e := os.Getenv("OTEL_TRACES_EXPORTER"); e != "" && e != "otlp" {
		return false
	}
	return os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// newTracerProvider is the OTLP/HTTP tracer provider the OTEL_* variables describe, nil when
// they ask for none. Only the http/protobuf protocol is built in.
func newTracerProvider(ctx context.Context) (*sdktrace.TracerProvider, error) {
	if !tracingWanted() {
		return nil, nil
	}
	proto := os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if proto == "" {
		proto = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	if proto != "" && proto != "http/protobuf" {
		return nil, fmt.Errorf("tracing: OTEL_EXPORTER_OTLP_PROTOCOL %q: escrow exports over http/protobuf only", proto)
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	res := resource.Default()
	if os.Getenv("OTEL_SERVICE_NAME") == "" && !strings.Contains(os.Getenv("OTEL_RESOURCE_ATTRIBUTES"), "service.name=") {
		if r, err := resource.Merge(res, resource.NewSchemaless(semconv.ServiceName("escrow"))); err == nil {
			res = r
		}
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// tracerProvider is the server's provider as the middleware takes it (nil: none).
func (s *Server) tracerProvider() trace.TracerProvider {
	if s.tracing == nil {
		return nil
	}
	return s.tracing
}
