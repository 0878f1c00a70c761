package server

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// TestServesAfterStartContextEnds: the context given to Start ending (a SIGTERM in cmd/escrow)
// stops none of the background parts; the requests served until Stop are still recorded and
// settled, never refused because the recorder closed under them.
func TestServesAfterStartContextEnds(t *testing.T) {
	t.Parallel()
	a := newTestApp(t, false, nil)
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
