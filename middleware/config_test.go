package middleware

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	l := memledger.New()
	for _, c := range []Config{
		{Ledger: l},
		{Store: memHolds{}},
		{Store: memHolds{}, Ledger: l, DefaultHold: -1},
		{Store: memHolds{}, Ledger: l, RecordTimeout: -time.Second},
	} {
		if _, err := c.ToMiddleware(); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v", c, err)
		}
	}
	if _, err := (Config{Store: memHolds{}, Ledger: l}).ToMiddleware(); err != nil {
		t.Fatalf("defaults refused: %v", err)
	}
	defer func() {
		if recover() == nil {
			t.Error("New did not panic on a bad config")
		}
	}()
	New(Config{})
}

// scriptedHolds answers Reserve with a fixed result and counts releases.
type scriptedHolds struct {
	memHolds
	res      balance.Reservation
	err      error
	released atomic.Int32
}

func (s *scriptedHolds) Reserve(context.Context, balance.ReserveRequest) (balance.Reservation, error) {
	return s.res, s.err
}
func (s *scriptedHolds) Release(context.Context, string, string) (bool, error) {
	s.released.Add(1)
	return true, nil
}

type flakyDirectory struct {
	*memledger.Ledger
	down atomic.Bool
}

func (f *flakyDirectory) LookupKey(ctx context.Context, s string) (ledger.APIKey, error) {
	if f.down.Load() {
		return ledger.APIKey{}, ledger.ErrLedgerUnavailable
	}
	return f.Ledger.LookupKey(ctx, s)
}

func TestReserveAnswers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l := memledger.New()
	must(t, l.CreateOrg(ctx, "o1"))
	_, key, _ := l.CreateKey(ctx, "o1")
	must(t, l.PutModel(ctx, ledger.Model{Name: testModel, Prices: testPrices, MaxOutputTokens: 100}))
	dir := &flakyDirectory{Ledger: l}
	tests := []struct {
		name     string
		h        *scriptedHolds
		status   int
		released int32
	}{
		{"duplicate proceeds", &scriptedHolds{res: balance.Reservation{Balance: 5, Duplicate: true}}, 200, 0},
		{"gone is a 503", &scriptedHolds{err: balance.ErrGone}, 503, 0},
		{"cold is a 503", &scriptedHolds{err: balance.ErrCold}, 503, 0},
		{"redis error: 503 and a background release", &scriptedHolds{err: errors.New("i/o timeout")}, 503, 1},
		{"bad amount is a 500", &scriptedHolds{err: balance.ErrInvalidAmount}, 500, 0},
	}
	for _, tt := range tests {
		e := echo.New()
		e.Use(New(Config{Store: tt.h, Ledger: dir, Logger: quiet, KeyCacheTTL: time.Millisecond}))
		e.POST(EndpointChat, trivialHandler)
		req := httptest.NewRequest(http.MethodPost, EndpointChat, strings.NewReader(jsonBody(testModel, "")))
		req.Header.Set("Authorization", "Bearer "+key)
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, req)
		if rec.Code != tt.status {
			t.Errorf("%s: status %d: %s", tt.name, rec.Code, rec.Body)
			continue
		}
		if tt.status == 503 && rec.Header().Get("Retry-After") == "" {
			t.Errorf("%s: no Retry-After", tt.name)
		}
		deadline := time.Now().Add(hangLimit)
		for tt.h.released.Load() < tt.released && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if got := tt.h.released.Load(); got != tt.released {
			t.Errorf("%s: %d releases, want %d", tt.name, got, tt.released)
		}
	}

	// The key cache answers stale while the ledger is down, and refreshes after.
	h := &scriptedHolds{}
	e := echo.New()
	e.Use(New(Config{Store: h, Ledger: dir, Logger: quiet, KeyCacheTTL: time.Millisecond}))
	e.POST(EndpointChat, trivialHandler)
	do := func() int {
		req := httptest.NewRequest(http.MethodPost, EndpointChat, strings.NewReader(jsonBody(testModel, "")))
		req.Header.Set("Authorization", "Bearer "+key)
		rec := httptest.NewRecorder()
		e.ServeHTTP(rec, req)
		_, _ = io.Copy(io.Discard, rec.Body)
		return rec.Code
	}
	if c := do(); c != 200 {
		t.Fatalf("warm-up %d", c)
	}
	dir.down.Store(true)
	time.Sleep(5 * time.Millisecond)
	if c := do(); c != 200 {
		t.Fatalf("ledger down, cached key: %d", c)
	}
	req := httptest.NewRequest(http.MethodPost, EndpointChat, strings.NewReader(jsonBody(testModel, "")))
	req.Header.Set("Authorization", "Bearer sk-never-seen")
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, req)
	if rec.Code != 503 {
		t.Fatalf("ledger down, unknown key: %d (want 503, not 401)", rec.Code)
	}
}
