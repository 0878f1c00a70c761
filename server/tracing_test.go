package server

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/llmescrow/escrow/middleware"
)

// otlpReceiver is an in-process OTLP/HTTP trace receiver: it keeps every span posted to
// /v1/traces.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []*tracepb.Span
	got   chan struct{}
}

func (r *otlpReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	var ex coltrace.ExportTraceServiceRequest
	if req.URL.Path != "/v1/traces" || proto.Unmarshal(body, &ex) != nil {
		http.Error(w, "bad export", http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	for _, rs := range ex.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			r.spans = append(r.spans, ss.Spans...)
		}
	}
	r.mu.Unlock()
	select {
	case r.got <- struct{}{}:
	default:
	}
	b, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(b)
}

// TestTracesReachOTLP: with OTEL_EXPORTER_OTLP_ENDPOINT set, a billed request's trace reaches
// an OTLP receiver with its five spans — the request, and under it reserve, upstream, finish,
// and record under finish — in one trace, with the org, model, hold and cost, and nothing of
// the API key, the prompt or the upstream's answer in any attribute or name.
func TestTracesReachOTLP(t *testing.T) {
	rcv := &otlpReceiver{got: make(chan struct{}, 1)}
	srv := httptest.NewServer(rcv)
	defer srv.Close()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", srv.URL)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "10")

	p := startTestProxy(t, false)
	key := p.setup("traced", 1_000_000, 1000)
	const prompt = "the-secret-prompt-4711"
	st, h, b := p.do("POST", "/v1/chat/completions", key, chat(prompt))
	if st != http.StatusOK {
		t.Fatalf("request: %d %s", st, b)
	}
	holdID := h.Get("x-escrow-hold-id")

	want := []string{middleware.SpanRequest, middleware.SpanReserve, middleware.SpanUpstream, middleware.SpanFinish, middleware.SpanRecord}
	byName := map[string]*tracepb.Span{}
	deadline := time.After(30 * time.Second)
	for len(byName) < len(want) {
		select {
		case <-rcv.got:
		case <-deadline:
			t.Fatalf("spans received: %v, want %v", byName, want)
		}
		rcv.mu.Lock()
		for _, s := range rcv.spans {
			byName[s.Name] = s
		}
		rcv.mu.Unlock()
	}
	root := byName[middleware.SpanRequest]
	if len(root.ParentSpanId) != 0 {
		t.Fatalf("the request span has a parent: %x", root.ParentSpanId)
	}
	parent := map[string]string{middleware.SpanReserve: middleware.SpanRequest, middleware.SpanUpstream: middleware.SpanRequest,
		middleware.SpanFinish: middleware.SpanRequest, middleware.SpanRecord: middleware.SpanFinish}
	for child, par := range parent {
		c := byName[child]
		if string(c.TraceId) != string(root.TraceId) || string(c.ParentSpanId) != string(byName[par].SpanId) {
			t.Fatalf("span %s: trace %x parent %x, want trace %x parent %s", child, c.TraceId, c.ParentSpanId, root.TraceId, par)
		}
	}
	attrs := map[string]string{}
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	for _, s := range rcv.spans {
		text := s.Name + " " + s.Status.GetMessage()
		for _, a := range s.Attributes {
			v := a.Value.String()
			text += " " + a.Key + "=" + v
			if s.Name == middleware.SpanRequest {
				attrs[a.Key] = v
			}
		}
		for _, secret := range []string{key, strings.TrimPrefix(key, "sk-"), prompt, "Bearer"} {
			if strings.Contains(text, secret) {
				t.Fatalf("span %s holds a secret (%q): %s", s.Name, secret, text)
			}
		}
	}
	for k, v := range map[string]string{"escrow.org": "traced", "escrow.model": "m", "escrow.hold_id": holdID} {
		if !strings.Contains(attrs[k], v) {
			t.Fatalf("request span attribute %s = %q, want %q (all: %v)", k, attrs[k], v, attrs)
		}
	}
	if !strings.Contains(attrs["escrow.cost"], "int_value") {
		t.Fatalf("request span has no cost: %v", attrs)
	}
}
