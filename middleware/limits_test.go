package middleware

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// limitLedger is the memory ledger plus limits (a balance.LimitLedger), set by the test: the
// ledgers keep no limits yet. SnapshotSince returns the limits, and for each limit in used the
// ledger's spend of its window that contains since.
type limitLedger struct {
	*memledger.Ledger
	mu     sync.Mutex
	limits balance.Limits
	used   map[string]int64 // limit id → the spend of its current window when seeded
}

func (l *limitLedger) SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error) {
	snap, err := l.Ledger.Snapshot(ctx, org)
	if err != nil {
		return snap, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	ls := &balance.LimitSnapshot{Limits: l.limits}
	for _, x := range l.limits.Limits {
		if u := l.used[x.ID]; u > 0 {
			ls.Used = append(ls.Used, balance.WindowUsed{LimitID: x.ID, Start: x.Window.StartMS(since), Used: u})
		}
	}
	snap.Limits = ls
	return snap, nil
}

// set replaces the limits (with a higher version) and pushes them, as an admin change does.
func (l *limitLedger) set(t *testing.T, st *balance.Store, org string, change func(*balance.Limits)) {
	t.Helper()
	l.mu.Lock()
	lim := l.limits
	lim.Limits = append([]balance.Limit(nil), lim.Limits...)
	lim.Frozen = append([]balance.Scope(nil), lim.Frozen...)
	change(&lim)
	lim.Version = l.limits.Version + 1
	l.limits = lim
	l.mu.Unlock()
	if _, err := st.PushLimits(context.Background(), org, lim); err != nil {
		t.Fatal(err)
	}
}

// limitClock is the Redis clock the limit tests run at (balance.Config.ClockOffset), so that
// window resets are known: Saturday 2030-06-15, noon UTC.
var limitClock = time.Date(2030, 6, 15, 12, 0, 0, 0, time.UTC)

type limitEnv struct {
	*testEnv
	ll    *limitLedger
	keyID string
}

// newLimitEnv is newEnv whose store's ledger keeps limits (and the used amounts of their
// current windows) as given, a fixed hold of hold, and the Redis clock at limitClock when
// shifted is set.
func newLimitEnv(t *testing.T, mini, shifted bool, hold int64, limits balance.Limits, used map[string]int64, more ...func(*Config)) *limitEnv {
	t.Helper()
	ll := &limitLedger{limits: limits, used: used}
	e := newEnv(t, envOpt{mini: mini,
		storeCfg: func(c *balance.Config) {
			ll.Ledger = c.Ledger.(*memledger.Ledger)
			c.Ledger = ll
			c.MaxInFlight = 4000
			if shifted {
				c.ClockOffset = time.Until(limitClock)
			}
		},
		cfg: func(c *Config) {
			c.HoldFunc = func(context.Context, HoldInput) (int64, error) { return hold, nil }
			for _, f := range more {
				f(c)
			}
		},
	})
	k, err := e.ledger.LookupKey(context.Background(), e.key)
	must(t, err)
	return &limitEnv{testEnv: e, ll: ll, keyID: k.ID}
}

// eachRedis runs fn on miniredis and on the real Redis (when configured).
func eachRedis(t *testing.T, fn func(t *testing.T, mini bool)) {
	t.Run("miniredis", func(t *testing.T) { t.Parallel(); fn(t, true) })
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		testutil.RealRedis(t) // skips, or fails under ESCROW_REQUIRE_SERVICES=1, without one
		fn(t, false)
	})
}

// send posts a chat request with the env's key and returns status, headers and body.
func (e *limitEnv) send() (int, http.Header, string) {
	e.t.Helper()
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	must(e.t, err)
	return resp.StatusCode, resp.Header, string(b)
}

// counters returns the org's counters by limit id (each limit has one current window here).
func (e *limitEnv) counters() map[string]int64 {
	e.t.Helper()
	c, err := e.store.Counters(context.Background(), e.org)
	must(e.t, err)
	out := map[string]int64{}
	for k, v := range c {
		out[k.LimitID] += v
	}
	return out
}

// TestLimitKeyDailyRefused: a key's daily cap passes the request that fits and refuses the next
// with the exact 429 budget_exceeded body and headers; nothing of the refused request is held,
// counted, recorded or sent upstream.
func TestLimitKeyDailyRefused(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, true, 20, balance.Limits{Version: 1}, map[string]int64{"lim_day": 49_970})
		// The first request's hold is finished when its usage is recorded, as the proxy's
		// recorder does: it no longer holds room (or the refusal would be budget_held).
		e.rec.fin = e.store
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "lim_day", Scope: balance.Scope{Kind: balance.ScopeKey, ID: e.keyID}, Window: balance.Day, Cap: 50_000}}
		})
		if st, _, body := e.send(); st != 200 {
			t.Fatalf("first request (49,970 + 20 ≤ 50,000): %d %s", st, body)
		}
		first := e.outcome()
		if c := e.counters()["lim_day"]; c != 49_991 {
			t.Fatalf("counter after the first hold, finished at its cost (21): %d, want 49991", c)
		}
		before := e.state()

		st, h, body := e.send()
		if st != http.StatusTooManyRequests {
			t.Fatalf("status %d %s", st, body)
		}
		want := `{"error":{"message":"Key ` + e.keyID + ` daily limit of 50000 reached: 49991 used, 20 needed; resets 2030-06-16T00:00:00Z.",` +
			`"type":"insufficient_quota","param":null,"code":"budget_exceeded",` +
			`"limit":{"id":"lim_day","scope":"key","scope_id":"` + e.keyID + `","window":"day","cap":50000,"used":49991,"resets_at":"2030-06-16T00:00:00Z"}}}`
		if body != want {
			t.Fatalf("body\n%s\nwant\n%s", body, want)
		}
		if typ, code, _ := openAIError(t, []byte(body)); typ != TypeInsufficientQuota || code != CodeBudgetExceeded {
			t.Fatalf("type %q code %q", typ, code)
		}
		if h.Get("x-should-retry") != "false" || h.Get(HeaderLimitReset) != "2030-06-16T00:00:00Z" ||
			h.Get("Retry-After") != "" || !strings.HasPrefix(h.Get("Content-Type"), "application/json") || h.Get("x-request-id") == "" {
			t.Fatalf("headers %v", h)
		}
		o := e.outcome()
		if o.Kind != OutcomeRefused || o.Status != 429 || o.Code != CodeBudgetExceeded || o.KeyID != e.keyID {
			t.Fatalf("outcome %+v", o)
		}
		// Nothing debited: the hot balance, the counter, the ledger and the upstream are as the
		// first request left them.
		if after := e.state(); after.Balance != before.Balance || after.Held != 21 || after.Holds != 1 {
			t.Fatalf("hot balance %+v, before %+v", after, before)
		}
		if c := e.counters()["lim_day"]; c != 49_991 {
			t.Fatalf("counter after the refusal: %d", c)
		}
		if evs := e.rec.events(); len(evs) != 1 || evs[0].ID != first.HoldID {
			t.Fatalf("events %+v", evs)
		}
		if n := len(e.upstreamRequests()); n != 1 {
			t.Fatalf("upstream called %d times", n)
		}
	})
}

// TestLimitScopes: project and org caps (every window; lifetime has no reset) refuse with the
// limit they name; the key's project comes from the limits' key → project map.
func TestLimitScopes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		limit   func(key string) balance.Limit
		msg     string
		scopeID string // "" = null
		reset   string // "" = null, no header
	}{
		{"project-month", func(string) balance.Limit {
			return balance.Limit{ID: "p1", Scope: balance.Scope{Kind: balance.ScopeProject, ID: "staging"}, Window: balance.Month, Cap: 500}
		}, "Project staging monthly limit of 500 reached: 490 used, 20 needed; resets 2030-07-01T00:00:00Z.", "staging", "2030-07-01T00:00:00Z"},
		{"org-week", func(string) balance.Limit {
			return balance.Limit{ID: "o1", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Week, Cap: 500}
		}, "Organization weekly limit of 500 reached: 490 used, 20 needed; resets 2030-06-17T00:00:00Z.", "", "2030-06-17T00:00:00Z"},
		{"org-hour", func(string) balance.Limit {
			return balance.Limit{ID: "o2", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Hour, Cap: 500}
		}, "Organization hourly limit of 500 reached: 490 used, 20 needed; resets 2030-06-15T13:00:00Z.", "", "2030-06-15T13:00:00Z"},
		{"org-lifetime", func(string) balance.Limit {
			return balance.Limit{ID: "o3", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Lifetime, Cap: 500}
		}, "Organization lifetime limit of 500 reached: 490 used, 20 needed; it does not reset.", "", ""},
		{"key-lifetime", func(key string) balance.Limit {
			return balance.Limit{ID: "k1", Scope: balance.Scope{Kind: balance.ScopeKey, ID: key}, Window: balance.Lifetime, Cap: 500}
		}, "Key %KEY lifetime limit of 500 reached: 490 used, 20 needed; it does not reset.", "%KEY", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eachRedis(t, func(t *testing.T, mini bool) {
				e := newLimitEnv(t, mini, true, 20, balance.Limits{Version: 1}, nil)
				lim := tc.limit(e.keyID)
				e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
					l.Limits = []balance.Limit{lim,
						// A roomy limit of another project and of another key: not in scope.
						{ID: "other-p", Scope: balance.Scope{Kind: balance.ScopeProject, ID: "prod"}, Window: balance.Day, Cap: 1},
						{ID: "other-k", Scope: balance.Scope{Kind: balance.ScopeKey, ID: "key_other"}, Window: balance.Day, Cap: 1}}
					l.Projects = map[string]string{e.keyID: "staging", "key_other": "prod"}
				})
				e.ll.mu.Lock()
				e.ll.used = map[string]int64{lim.ID: 490}
				e.ll.mu.Unlock()
				must(t, e.store.Invalidate(context.Background(), e.org)) // reseed with the used amount
				st, h, body := e.send()
				if st != http.StatusTooManyRequests {
					t.Fatalf("status %d %s", st, body)
				}
				var got struct {
					Error struct {
						Message, Type, Code string
						Limit               map[string]any
					}
				}
				must(t, json.Unmarshal([]byte(body), &got))
				msg := strings.ReplaceAll(tc.msg, "%KEY", e.keyID)
				scopeID := strings.ReplaceAll(tc.scopeID, "%KEY", e.keyID)
				g := got.Error
				if g.Message != msg || g.Type != TypeInsufficientQuota || g.Code != CodeBudgetExceeded {
					t.Fatalf("error %+v, want message %q", g, msg)
				}
				wantLimit := map[string]any{"id": lim.ID, "scope": string(lim.Scope.Kind), "scope_id": nilIfEmpty(scopeID),
					"window": string(lim.Window), "cap": float64(500), "used": float64(490), "resets_at": nilIfEmpty(tc.reset)}
				if len(g.Limit) != len(wantLimit) {
					t.Fatalf("limit %v, want %v", g.Limit, wantLimit)
				}
				for k, v := range wantLimit {
					if g.Limit[k] != v {
						t.Fatalf("limit.%s = %v, want %v (%v)", k, g.Limit[k], v, g.Limit)
					}
				}
				if h.Get(HeaderLimitReset) != tc.reset || h.Get("x-should-retry") != "false" {
					t.Fatalf("headers %v", h)
				}
				e.assertNothingDebited()
				if c := e.counters()[lim.ID]; c != 490 {
					t.Fatalf("counter %d after the refusal", c)
				}
				if n := len(e.upstreamRequests()); n != 0 {
					t.Fatalf("upstream called %d times", n)
				}
			})
		})
	}
}

func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// TestLimitFrozen: a freeze of the org, the key's project or the key refuses the very next
// request with 403 account_frozen / key_frozen, naming what is frozen; nothing is debited; an
// unfreeze lets the next one through.
func TestLimitFrozen(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		scope func(key string) balance.Scope
		code  string
		msg   string
	}{
		{"org", func(string) balance.Scope { return balance.Scope{Kind: balance.ScopeOrg} }, CodeAccountFrozen,
			"Your organization is frozen: its new requests are refused until it is unfrozen."},
		{"project", func(string) balance.Scope { return balance.Scope{Kind: balance.ScopeProject, ID: "staging"} }, CodeKeyFrozen,
			"The project staging of this API key is frozen: its keys' new requests are refused until it is unfrozen."},
		{"key", func(k string) balance.Scope { return balance.Scope{Kind: balance.ScopeKey, ID: k} }, CodeKeyFrozen,
			"This API key (%KEY) is frozen: its new requests are refused until it is unfrozen."},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			eachRedis(t, func(t *testing.T, mini bool) {
				e := newLimitEnv(t, mini, false, 20, balance.Limits{Version: 1}, nil)
				e.ll.set(t, e.store, e.org, func(l *balance.Limits) { l.Projects = map[string]string{e.keyID: "staging"} })
				if st, _, body := e.send(); st != 200 {
					t.Fatalf("before the freeze: %d %s", st, body)
				}
				e.outcome()
				before := e.state()
				e.ll.set(t, e.store, e.org, func(l *balance.Limits) { l.Frozen = []balance.Scope{tc.scope(e.keyID)} })
				st, h, body := e.send()
				if st != http.StatusForbidden {
					t.Fatalf("frozen: %d %s", st, body)
				}
				typ, code, _ := openAIError(t, []byte(body))
				var got struct{ Error struct{ Message string } }
				must(t, json.Unmarshal([]byte(body), &got))
				if code != tc.code || typ != TypeInvalidRequest || got.Error.Message != strings.ReplaceAll(tc.msg, "%KEY", e.keyID) {
					t.Fatalf("frozen: %s", body)
				}
				if h.Get("x-should-retry") != "false" || h.Get(HeaderLimitReset) != "" || strings.Contains(body, `"limit"`) {
					t.Fatalf("headers %v, body %s", h, body)
				}
				if o := e.outcome(); o.Kind != OutcomeRefused || o.Status != 403 || o.Code != tc.code {
					t.Fatalf("outcome %+v", o)
				}
				// Nothing debited: the push reseeded the hot balance from the ledger, which has
				// accounted the first request's cost (21) while its hold (20) waits for the settle.
				if before.Balance != testCredit-20 {
					t.Fatalf("before the freeze: %+v", before)
				}
				if after := e.state(); after.Balance != testCredit-21-20 || after.Held != 20 || after.Holds != 1 {
					t.Fatalf("hot balance %+v after the refusal", after)
				}
				if a := e.account(); a.Balance != testCredit-21 || a.Pending != 0 {
					t.Fatalf("ledger %+v", a)
				}
				if evs := e.rec.events(); len(evs) != 1 {
					t.Fatalf("events %+v", evs)
				}
				if n := len(e.upstreamRequests()); n != 1 {
					t.Fatalf("upstream called %d times", n)
				}
				e.ll.set(t, e.store, e.org, func(l *balance.Limits) { l.Frozen = nil })
				if st, _, body := e.send(); st != 200 {
					t.Fatalf("after the unfreeze: %d %s", st, body)
				}
				e.outcome()
			})
		})
	}
}

// TestLimitUsageAttribution: the usage event carries the key id, the key's project and the
// reserve time (Redis clock, the counters' window); a fail-open request carries no reserve time
// and no project.
func TestLimitUsageAttribution(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		e := newLimitEnv(t, mini, false, 20, balance.Limits{Version: 1}, nil)
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "d", Scope: balance.Scope{Kind: balance.ScopeProject, ID: "staging"}, Window: balance.Day, Cap: 1_000}}
			l.Projects = map[string]string{e.keyID: "staging"}
		})
		t0 := time.Now()
		if st, _, body := e.send(); st != 200 {
			t.Fatalf("%d %s", st, body)
		}
		t1 := time.Now()
		o := e.outcome()
		evs := e.rec.events()
		if len(evs) != 1 {
			t.Fatalf("events %+v", evs)
		}
		ev := evs[0]
		if ev.ID != o.HoldID || ev.KeyID != e.keyID || ev.Project != "staging" || ev.HoldAmount != 20 {
			t.Fatalf("event %+v", ev)
		}
		// The Redis clock, in ms, on this machine: within the request's time (1 s of slack).
		if ev.ReservedAt.Before(t0.Add(-time.Second)) || ev.ReservedAt.After(t1.Add(time.Second)) || ev.ReservedAt.Nanosecond()%1e6 != 0 {
			t.Fatalf("reserved at %v, request between %v and %v", ev.ReservedAt, t0, t1)
		}
		c, err := e.store.Counters(context.Background(), e.org)
		must(t, err)
		if got := c[balance.Counter{LimitID: "d", Start: balance.Day.StartMS(ev.ReservedAt)}]; got != 20 {
			t.Fatalf("counters %v: the hold is not in the window of its reserve time", c)
		}
	})
}

// TestLimitFailOpenEvent: a fail-open request (no hold) records no reserve time and no
// project: it is attributed to its record time.
func TestLimitFailOpenEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOpt{withFault: true, cfg: func(c *Config) { c.FailOpen = true }})
	k, err := e.ledger.LookupKey(context.Background(), e.key)
	must(t, err)
	e.fault.Block()
	e.fault.Cut()
	resp := e.post(context.Background(), EndpointChat, e.key, jsonBody(testModel, ""))
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if o := e.outcome(); !o.FailOpen {
		t.Fatalf("outcome %+v", o)
	}
	evs := e.rec.events()
	if len(evs) != 1 || !evs[0].ReservedAt.IsZero() || evs[0].Project != "" || evs[0].KeyID != k.ID || evs[0].HoldAmount != 0 {
		t.Fatalf("events %+v", evs)
	}
}

// countingHandler counts the log records that contain a substring.
type countingHandler struct {
	slog.Handler
	sub string
	n   *atomic.Int64
}

func (h countingHandler) Handle(ctx context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.sub) {
		h.n.Add(1)
	}
	return nil
}

func (h countingHandler) Enabled(context.Context, slog.Level) bool { return true }

// TestLimitUnnameableKeyID: an authenticator whose key ids the limits layer cannot name (here
// "team:alice", with a colon) is served: its requests are reserved without a key id (the org's
// limits still apply), their usage events keep the key id (reports), and the first is logged
// once.
func TestLimitUnnameableKeyID(t *testing.T) {
	t.Parallel()
	eachRedis(t, func(t *testing.T, mini bool) {
		var warned atomic.Int64
		var org string
		e := newLimitEnv(t, mini, false, 20, balance.Limits{Version: 1}, nil, func(c *Config) {
			c.Logger = slog.New(countingHandler{Handler: slog.DiscardHandler, sub: "key id cannot be named", n: &warned})
			c.OrgFunc = func(echo.Context) (Identity, error) { return Identity{Org: org, KeyID: "team:alice"}, nil }
		})
		org = e.org
		e.rec.fin = e.store // finished as the proxy does: ended requests hold no room
		if err := balance.ValidateReserveKey("team:alice"); err == nil {
			t.Fatal("the test's key id is nameable")
		}
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "o", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Day, Cap: 50}}
		})
		for i := range 2 {
			if st, _, body := e.send(); st != 200 {
				t.Fatalf("request %d: %d %s", i, st, body)
			}
			if o := e.outcome(); o.KeyID != "team:alice" || o.Kind != OutcomeRecorded {
				t.Fatalf("outcome %+v", o)
			}
		}
		for _, ev := range e.rec.events() {
			if ev.KeyID != "team:alice" || ev.ReservedAt.IsZero() {
				t.Fatalf("event %+v", ev)
			}
		}
		// The org's cap still holds: 2×21 used (the holds finished at their cost), 20 more would be 62 > 50.
		st, _, body := e.send()
		if st != http.StatusTooManyRequests || !strings.Contains(body, `"code":"budget_exceeded"`) {
			t.Fatalf("third request: %d %s", st, body)
		}
		e.outcome()
		if n := warned.Load(); n != 1 {
			t.Fatalf("warned %d times, want once", n)
		}
	})
}

// TestLimitBurst: 2,000 concurrent requests of one key with a daily cap for exactly N of them
// (hold = cost = 21, the fake upstream's fixed usage) and a balance for far more, all in flight
// together: exactly N get 200 (and reach the upstream) and the rest 429 budget_held (the cap's
// room is held by the N in flight: retryable, with Retry-After); the ledger charges exactly
// N × 21.
//
// Not parallel with the package's other tests: 4,000 requests at once on two cores would push
// their reserves past the 1 s reserve timeout (this test raises its own).
func TestLimitBurst(t *testing.T) {
	eachRedis(t, func(t *testing.T, mini bool) {
		const n = 37
		total := int64(2000)
		if mini {
			// miniredis runs each script in Go, one at a time (≈ 25 ms under the race detector on
			// a loaded machine): 2,000 would outlast the reserve timeout. The same rule at 500.
			total = 500
		}
		unit := cost(t, chatUsage)
		if unit != 21 {
			t.Fatalf("the fake upstream's cost is %d, want 21", unit)
		}
		e := newLimitEnv(t, mini, false, unit, balance.Limits{Version: 1}, nil, func(c *Config) {
			c.OnOutcome = func(Outcome) {}
			c.ReserveTimeout = 30 * time.Second // 2,000 reserves queue for the client's pool
		})
		e.ll.set(t, e.store, e.org, func(l *balance.Limits) {
			l.Limits = []balance.Limit{{ID: "d", Scope: balance.Scope{Kind: balance.ScopeKey, ID: e.keyID}, Window: balance.Day, Cap: n * unit}}
		})
		// The upstream holds every request until each one is decided (held there or refused),
		// so that all are in flight together and no settle lands between the reserves (a
		// straggler's warm-up accounts recorded usage and its catch-up settles it; this test
		// ledger seeds no window spend, so a reseed then would undercount).
		var arrived atomic.Int64
		open := make(chan struct{})
		e.setUpstream(func(w http.ResponseWriter, r *http.Request, body []byte) {
			arrived.Add(1)
			<-open
			fakeOpenAI(w, r, body)
		})
		var start sync.WaitGroup
		start.Add(1)
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: int(total)}}
		defer client.CloseIdleConnections()
		var ok, refused, other atomic.Int64
		var firstOther atomic.Value
		var wg sync.WaitGroup
		for range total {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, err := http.NewRequest(http.MethodPost, e.srv.URL+EndpointChat, strings.NewReader(jsonBody(testModel, "")))
				if err != nil {
					other.Add(1)
					return
				}
				req.Header.Set("Authorization", "Bearer "+e.key)
				start.Wait()
				resp, err := client.Do(req)
				if err != nil {
					other.Add(1)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch {
				case resp.StatusCode == 200:
					ok.Add(1)
				case resp.StatusCode == 429 && strings.Contains(string(b), `"code":"budget_held"`) && resp.Header.Get("Retry-After") != "":
					// Refused while the n served were in flight, holding the whole cap: their
					// holds are room that may come back, so the refusal is retryable.
					refused.Add(1)
				default:
					firstOther.CompareAndSwap(nil, strconv.Itoa(resp.StatusCode)+" "+string(b))
					other.Add(1)
				}
			}()
		}
		start.Done()
		deadline := time.Now().Add(2 * time.Minute)
		for arrived.Load()+refused.Load()+other.Load() < total && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		close(open)
		wg.Wait()
		if ok.Load() != n || refused.Load() != total-n || other.Load() != 0 || arrived.Load() != n {
			t.Fatalf("%d ok, %d budget_held, %d other (first: %v), %d upstream calls; want %d and %d",
				ok.Load(), refused.Load(), other.Load(), firstOther.Load(), arrived.Load(), n, total-n)
		}
		if c := e.counters()["d"]; c != n*unit {
			t.Fatalf("counter %d, want %d", c, n*unit)
		}
		ctx := context.Background()
		if _, err := e.ledger.AccountPending(ctx, 10_000); err != nil {
			t.Fatal(err)
		}
		if a := e.account(); a.Balance != testCredit-n*unit || a.Pending != 0 {
			t.Fatalf("ledger %+v, want balance %d", a, testCredit-n*unit)
		}
		if st := e.state(); st.Balance != testCredit-n*unit || st.Holds != n {
			t.Fatalf("hot balance %+v", st)
		}
	})
}

// TestLimitLedgerKeyIDs: the key ids both ledgers make ("key_" + hex) are ones the limits layer
// can name, so the default authenticator always reserves under the key.
func TestLimitLedgerKeyIDs(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, pg bool) {
		e := newLedgerEnv(t, pg, nil)
		for range 20 {
			k, _, err := e.ledger.CreateKey(context.Background(), e.org)
			must(t, err)
			if err := balance.ValidateReserveKey(k.ID); err != nil || !strings.HasPrefix(k.ID, "key_") {
				t.Fatalf("ledger key id %q: %v", k.ID, err)
			}
		}
	})
}

// TestLimitUnnameableKeySettles: with the real recorder and worker, the usage of a key id the
// limits layer cannot name is accounted and settled, and the hot balance agrees with the ledger:
// the store refuses an entry naming such a key, so the ledger leaves it out of the attribution.
func TestLimitUnnameableKeySettles(t *testing.T) {
	t.Parallel()
	eachLedger(t, func(t *testing.T, pg bool) {
		var org string
		e := newLedgerEnv(t, pg, func(c *Config) {
			c.OrgFunc = func(echo.Context) (Identity, error) { return Identity{Org: org, KeyID: "team:alice"}, nil }
		})
		org = e.org
		for i := range 2 {
			st, body, err := e.do("", jsonBody(testModel, ""))
			must(t, err)
			if st != 200 {
				t.Fatalf("request %d: %d %s", i, st, body)
			}
			e.outcome()
		}
		e.settle(2*cost(t, chatUsage), 2)
		ep, err := e.ledger.Epoch(context.Background())
		must(t, err)
		_, err = e.store.Settle(context.Background(), e.org, ep, []balance.Entry{{Seq: 99, Delta: -1, KeyID: "team:alice"}})
		if !errors.Is(err, balance.ErrInvalidEntry) {
			t.Fatalf("settle of an entry naming key team:alice: %v, want ErrInvalidEntry", err)
		}
	})
}

// TestLimitRefusalAnthropic: on the Messages API's routes the limit refusal keeps its status,
// x-should-retry: false, the reset header and the limit object, in Anthropic's error shape
// (rate_limit_error); a freeze is a permission_error.
func TestLimitRefusalAnthropic(t *testing.T) {
	t.Parallel()
	le := &balance.LimitError{Limit: balance.Limit{ID: "l1", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Day, Cap: 100},
		Used: 90, Amount: 20, ResetsAt: time.Date(2030, 6, 16, 0, 0, 0, 0, time.UTC)}
	e := limitRefusal(le).forAnthropic()
	h := http.Header{}
	e.setHeaders(h)
	want := `{"type":"error","error":{"type":"rate_limit_error","message":"Organization daily limit of 100 reached: 90 used, 20 needed; resets 2030-06-16T00:00:00Z.",` +
		`"limit":{"id":"l1","scope":"org","scope_id":null,"window":"day","cap":100,"used":90,"resets_at":"2030-06-16T00:00:00Z"}}}`
	if e.Status != 429 || string(e.Body()) != want || h.Get("x-should-retry") != "false" || h.Get(HeaderLimitReset) != "2030-06-16T00:00:00Z" {
		t.Fatalf("%d %s %v", e.Status, e.Body(), h)
	}
	if f := frozenRefusal(balance.Scope{Kind: balance.ScopeKey, ID: "key_1"}).forAnthropic(); f.Status != 403 || f.Type != AnthropicPermission {
		t.Fatalf("frozen: %d %s", f.Status, f.Body())
	}
}
