package server

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/internal/fakeupstream"
)

// TestServesAfterStartContextEnds: the context given to Start ending (a SIGTERM in cmd/escrow)
// stops none of the background parts; the requests served until Stop are still recorded and
// settled, never refused because the recorder closed under them.
func TestServesAfterStartContextEnds(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	cfg.Addr, cfg.AdminToken, cfg.DemoBalance = "127.0.0.1:0", testAdmin, 0
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	mini := miniredis.NewMiniRedis()
	if err := mini.StartAddr("127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: mini.Addr()})
	t.Cleanup(func() { _ = rdb.Close(); mini.Close() })
	a, err := New(context.Background(), cfg, WithEmbeddedRedis(rdb),
		WithUpstream(fakeupstream.New(fakeupstream.Options{KeepRequests: -1}), "sk-fake-upstream"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := a.Stop(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	if err := a.Start(ctx); err != nil {
		t.Fatal(err)
	}
	p := &testProxy{t: t, app: a, base: "http://" + a.Addr()}
	key := p.setup("acme", 10_000, 65)
	cancel()
	time.Sleep(50 * time.Millisecond) // what ctx's end would set off has had time to run
	for i := range 3 {
		if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hello world")); st != http.StatusOK {
			t.Fatalf("request %d after Start's context ended: %d %s", i, st, b)
		}
	}
	if b := p.settled("acme"); b.LedgerBalance != 10_000-3*20 {
		t.Fatalf("after settle: %+v, want %d", b, 10_000-3*20)
	}
}
