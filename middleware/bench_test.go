package middleware

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// memHolds is a Holds without Redis: it isolates the middleware's own cost.
type memHolds struct{}

func (memHolds) Reserve(context.Context, balance.ReserveRequest) (balance.Reservation, error) {
	return balance.Reservation{Balance: 1}, nil
}
func (memHolds) Release(context.Context, string, string) (bool, error) { return true, nil }
func (memHolds) KeepAlive(string, string, func(error)) (*balance.Lease, error) {
	return nil, nil // a nil Lease stops as a no-op
}
func (memHolds) ModelMax(context.Context, string) (int64, error)  { return 0, nil }
func (memHolds) KeyRevoked(context.Context, string) (bool, error) { return false, nil }

// nopRecorder records nothing and cannot void.
type nopRecorder struct{}

func (nopRecorder) RecordReceipt(context.Context, ledger.UsageEvent) (accounting.Receipt, error) {
	return accounting.Receipt{}, nil
}
func (nopRecorder) Void(context.Context, ledger.UsageEvent) error { return errors.ErrUnsupported }

const benchResponse = `{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-test","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],"usage":` + chatUsageJSON + `}`

func trivialHandler(c echo.Context) error {
	_, _ = io.Copy(io.Discard, c.Request().Body)
	return c.Blob(http.StatusOK, "application/json", []byte(benchResponse))
}

// BenchmarkMiddleware compares a trivial OpenAI-shaped handler alone with the same handler behind
// the middleware (in process, no network): with an in-memory Holds and recorder (the
// middleware's own CPU), and with the real balance.Store (Redis round trips) and memory ledger.
// x_handler is ns/op divided by handler_alone's ns/op in the same run.
func BenchmarkMiddleware(b *testing.B) {
	body := jsonBody(testModel, `"max_completion_tokens":100`)
	var base float64
	run := func(b *testing.B, e *echo.Echo, key string, isBase bool) {
		b.ReportAllocs()
		for b.Loop() {
			req := httptest.NewRequest(http.MethodPost, EndpointChat, strings.NewReader(body))
			req.Header.Set("Authorization", "Bearer "+key)
			req.Header.Set("Content-Type", "application/json")
			rec := httptest.NewRecorder()
			e.ServeHTTP(rec, req)
			if rec.Code != 200 {
				b.Fatalf("status %d: %s", rec.Code, rec.Body)
			}
		}
		ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		if isBase {
			base = ns
		} else if base > 0 {
			b.ReportMetric(ns/base, "x_handler")
		}
	}
	l := memledger.New()
	ctx := context.Background()
	org := "benchorg"
	must2(b, l.CreateOrg(ctx, org))
	if _, _, err := l.Credit(ctx, org, balance.MaxAmount/2, "bench"); err != nil {
		b.Fatal(err)
	}
	_, key, err := l.CreateKey(ctx, org)
	must2(b, err)
	must2(b, l.PutModel(ctx, ledger.Model{Name: testModel, Prices: testPrices, MaxOutputTokens: 1000, DefaultHold: 5000}))

	b.Run("handler_alone", func(b *testing.B) {
		e := echo.New()
		e.POST(EndpointChat, trivialHandler)
		run(b, e, key, true)
	})
	b.Run("middleware_memory_holds", func(b *testing.B) {
		e := echo.New()
		e.Use(New(Config{Store: memHolds{}, Ledger: l, Recorder: nopRecorder{}, Logger: quiet}))
		e.POST(EndpointChat, trivialHandler)
		run(b, e, key, false)
	})
	b.Run("middleware_redis_store", func(b *testing.B) {
		env := testutil.Redis(b)
		st, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, MaxInFlight: 1 << 30, HoldTTL: time.Minute, Logger: quiet})
		must2(b, err)
		e := echo.New()
		e.Use(New(Config{Store: st, Ledger: l, Recorder: nopRecorder{}, Logger: quiet}))
		e.POST(EndpointChat, trivialHandler)
		run(b, e, key, false)
	})
}

func must2(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}
