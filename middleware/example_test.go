package middleware_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/alicebob/miniredis/v2"
	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/middleware"
	"github.com/llmescrow/escrow/pricing"
	"github.com/redis/go-redis/v9"
)

// The middleware in front of an OpenAI-compatible handler: the request is held, served, and its
// usage recorded in the ledger.
func Example() {
	ctx := context.Background()
	mr, _ := miniredis.Run()
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	l := memledger.New()
	_ = l.CreateOrg(ctx, "acme")
	_, _, _ = l.Credit(ctx, "acme", 1_000_000, "payment-1")
	_, secret, _ := l.CreateKey(ctx, "acme")
	_ = l.PutModel(ctx, ledger.Model{Name: "gpt-test", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.Output: 2_000_000}, MaxOutputTokens: 1000, DefaultHold: 5000})
	store, err := balance.New(ctx, rdb, &balance.Config{Ledger: l})
	if err != nil {
		fmt.Println(err)
		return
	}

	e := echo.New()
	e.Use(middleware.New(middleware.Config{Store: store, Ledger: l}))
	e.POST("/v1/chat/completions", func(c echo.Context) error { // stands in for the upstream
		return c.JSONBlob(http.StatusOK, []byte(`{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":5}}`))
	})

	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-test","messages":[{"role":"user","content":"hello"}],"max_tokens":50}`))
	req.Header.Set("Authorization", "Bearer "+secret)
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, req)
	body, _ := io.ReadAll(rec.Body)
	fmt.Println(rec.Code, len(body) > 0)

	id := rec.Header().Get("x-request-id")
	recorded, _ := l.UnsettledUsage(ctx, "acme", []string{id})
	fmt.Println("usage recorded:", recorded[id])

	// No key: an OpenAI-shaped 401.
	req = httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(`{}`))
	rec = httptest.NewRecorder()
	e.ServeHTTP(rec, req)
	fmt.Println(rec.Code, strings.TrimSpace(rec.Body.String())[:40])
	// Output:
	// 200 true
	// usage recorded: true
	// 401 {"error":{"message":"You didn't provide
}
