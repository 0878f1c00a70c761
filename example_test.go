package escrow_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/alicebob/miniredis/v2"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// escrow.New in front of an OpenAI-compatible handler: a funded org with a daily limit on its
// key, one request held, served and charged, and the balance read back after Stop has drained
// the recorder and settled the charge. With a real deployment, pass a Redis client and a
// *pgxpool.Pool (nil here: the in-memory ledger, which pairs only with an embedded Redis).
func Example() {
	ctx := context.Background()
	mr, _ := miniredis.Run() // stands in for Redis
	defer mr.Close()
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()

	esc, err := escrow.New(ctx, rdb, nil, &escrow.Config{AdminToken: "adm-example"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := esc.Start(ctx); err != nil {
		fmt.Println(err)
		return
	}

	e := echo.New()
	e.Use(esc.Middleware())
	_ = esc.MountAdmin(e.Group("/admin/v1"))
	e.POST("/v1/chat/completions", func(c echo.Context) error { // stands in for the upstream
		return c.JSONBlob(http.StatusOK, []byte(`{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":10,"completion_tokens":5}}`))
	})

	ops := esc.Ops() // what the admin API serves, as Go calls
	_ = ops.PutModel(ctx, ledger.Model{Name: "gpt-test", Prices: pricing.Prices{pricing.Input: 1_000_000, pricing.CachedInput: 1_000_000, pricing.Output: 2_000_000},
		MaxInputTokens: 10_000, MaxOutputTokens: 1000})
	_ = esc.Ledger().CreateOrg(ctx, "acme")                   // org and key: one ledger call each, no hot-balance step
	_, _, _ = ops.Credit(ctx, "acme", 1_000_000, "payment-1") // in the hot balance when it returns
	k, secret, _ := esc.Ledger().CreateKey(ctx, "acme")
	_, _ = ops.CreateLimit(ctx, "acme", balance.Scope{Kind: balance.ScopeKey, ID: k.ID}, balance.Day, 500_000)

	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-test","messages":[{"role":"user","content":"hello"}],"max_tokens":50}`))
	req.Header.Set("Authorization", "Bearer "+secret)
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, req)
	fmt.Println("status", rec.Code, "cost", rec.Header().Get("X-Escrow-Cost"))

	_ = esc.Stop(ctx) // the recorder's last batch, then the worker's last pass: settled
	b, _ := ops.Balance(ctx, "acme")
	fmt.Println("ledger", b.LedgerBalance, "available", b.Available, "held", b.Held)
	limits, _ := ops.ListLimits(ctx, "acme")
	fmt.Println("key's daily limit used", limits[0].Used, "of", limits[0].Cap)
	// Output:
	// status 200 cost 20
	// ledger 999980 available 999980 held 0
	// key's daily limit used 20 of 500000
}
