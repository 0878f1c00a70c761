package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/internal/testutil"
)

// TestPostgresOutageJournal: with Postgres stopped, a warm org is still served (its usage goes
// to the local journal, and /metrics and /readyz say so), a cold org gets 503, and once the
// journal nears its cap new requests get 503 service_unavailable with Retry-After while nothing
// is served unbilled. When Postgres is back the journal is replayed and every served request is
// charged once.
func TestPostgresOutageJournal(t *testing.T) {
	t.Parallel()
	pg := testutil.StartPostgresServer(t)
	env := testutil.RealRedis(t)
	p := startTestProxy(t, false, func(c *Config) {
		c.RedisURL, c.DatabaseURL, c.Prefix = env.URL, pg.URL(), env.Prefix
		c.JournalDir, c.JournalMaxBytes = t.TempDir(), 6000 // room for about 15 events
		c.ReplayInterval = 100 * time.Millisecond
	})
	key := p.setup("acme", 100_000, 65)
	p.admin("POST", "/orgs", map[string]string{"id": "cold"}, http.StatusCreated, nil)
	var k struct{ Key string }
	p.admin("POST", "/orgs/cold/keys", nil, http.StatusCreated, &k)
	coldKey := k.Key
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("warm up")); st != http.StatusOK {
		t.Fatalf("warm-up: %d %s", st, b)
	}

	pg.Stop()
	if st, _, b := p.do("POST", "/v1/chat/completions", coldKey, chat("hello")); st != http.StatusServiceUnavailable {
		t.Fatalf("cold org while Postgres is down: %d %s, want 503", st, b)
	}
	served := 1 // the warm-up
	var refusal http.Header
	var body []byte
	for i := 0; i < 40; i++ {
		st, h, b := p.do("POST", "/v1/chat/completions", key, chat("hello"))
		if st == http.StatusOK {
			served++
			if i == 0 {
				// Usage is in the journal, and the proxy says so.
				_, _, m := p.do("GET", "/metrics", "", nil)
				if !strings.Contains(string(m), "escrow_journal_events 1") {
					t.Fatalf("metrics after one journaled request:\n%s", grepLines(string(m), "escrow_journal"))
				}
				_, _, r := p.do("GET", "/readyz", "", nil)
				if !strings.Contains(string(r), "journaling") || !strings.Contains(string(r), "in use: 1 events") {
					t.Fatalf("readyz: %s", r)
				}
			}
			continue
		}
		if st != http.StatusServiceUnavailable {
			t.Fatalf("request %d: %d %s", i, st, b)
		}
		refusal, body = h, b
		break
	}
	if refusal == nil || served < 10 {
		t.Fatalf("served %d while journaling, then %v", served, refusal)
	}
	var e struct {
		Error struct{ Type, Code string }
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != "service_unavailable" || refusal.Get("Retry-After") == "" {
		t.Fatalf("near-full refusal: %s (Retry-After %q)", body, refusal.Get("Retry-After"))
	}
	if st := p.app.recorder.Stats(); st.JournalEvents != int64(served-1) || !p.app.recorder.Degraded() {
		t.Fatalf("journal: %+v, degraded %v; want %d events", st, p.app.recorder.Degraded(), served-1)
	}

	pg.Start()
	deadline := time.Now().Add(time.Minute)
	for p.app.recorder.Journaling() || p.app.recorder.Degraded() {
		if time.Now().After(deadline) {
			t.Fatalf("journal never replayed: %+v", p.app.recorder.Stats())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st, _, b := p.do("POST", "/v1/chat/completions", key, chat("hello")); st != http.StatusOK {
		t.Fatalf("after the outage: %d %s", st, b)
	}
	served++
	want := int64(100_000 - 20*served)
	if b := p.settled("acme"); b.LedgerBalance != want || b.Available != want {
		t.Fatalf("after replay: %+v, want %d (%d requests served)", b, want, served)
	}
	if st := p.app.recorder.Stats(); st.Replays < 1 || st.Replayed != int64(served-2) {
		t.Fatalf("stats: %+v", st)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
