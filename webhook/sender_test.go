package webhook_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/webhook"
)

// ledgers runs fn on the memory ledger and on a real Postgres ledger.
func ledgers(t *testing.T, fn func(t *testing.T, l ledger.Ledger)) {
	t.Run("Memory", func(t *testing.T) {
		t.Parallel()
		l := memledger.New()
		t.Cleanup(l.Close)
		fn(t, l)
	})
	t.Run("Postgres", func(t *testing.T) {
		t.Parallel()
		env := testutil.Postgres(t)
		if _, err := migrations.Up(context.Background(), env.Pool); err != nil {
			t.Fatal(err)
		}
		l := mustPostgres(t, env.Pool)
		fn(t, l)
	})
}

// mustPostgres is a Postgres ledger on pool (migrated), closed with the test.
func mustPostgres(t *testing.T, pool *pgxpool.Pool) *pgledger.Ledger {
	t.Helper()
	l, err := pgledger.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	return l
}

// received is one request the receiver got.
type received struct {
	eventID, eventType, signature string
	attempt                       int
	body                          []byte
	at                            time.Time
	answered                      int // 0: hung
}

// receiver is a real HTTP endpoint. Per event id, the answer to its n-th request is
// script(n): a status, or 0 to hang until the client gives up.
type receiver struct {
	*httptest.Server
	mu     sync.Mutex
	got    []received
	script func(n int) int
}

func newReceiver(t *testing.T, script func(n int) int) *receiver {
	r := &receiver{script: script}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		id := req.Header.Get(webhook.HeaderEventID)
		att, _ := strconv.Atoi(req.Header.Get(webhook.HeaderAttempt))
		r.mu.Lock()
		n := 1
		for _, g := range r.got {
			if g.eventID == id {
				n++
			}
		}
		status := r.script(n)
		r.got = append(r.got, received{eventID: id, eventType: req.Header.Get(webhook.HeaderEventType),
			signature: req.Header.Get(webhook.HeaderSignature), attempt: att, body: body, at: time.Now(), answered: status})
		r.mu.Unlock()
		if status == 0 {
			<-req.Context().Done() // hang: the sender's timeout ends it
			return
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(r.Close)
	return r
}

func (r *receiver) requests() []received {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// verify checks a signature the way a receiver would, without the package's Verify: the
// header is t=<unix>,v1=<hex HMAC-SHA256(secret, t + "." + body)>.
func verify(t *testing.T, secret string, g received) {
	t.Helper()
	parts := strings.Split(g.signature, ",")
	if len(parts) != 2 || !strings.HasPrefix(parts[0], "t=") || !strings.HasPrefix(parts[1], "v1=") {
		t.Fatalf("signature header %q", g.signature)
	}
	ts := strings.TrimPrefix(parts[0], "t=")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || time.Since(time.Unix(sec, 0)).Abs() > time.Minute {
		t.Fatalf("signature timestamp %q", ts)
	}
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(ts + "." + string(g.body)))
	if want := hex.EncodeToString(m.Sum(nil)); strings.TrimPrefix(parts[1], "v1=") != want {
		t.Fatalf("event %s: signature %q, want v1=%s", g.eventID, g.signature, want)
	}
	m = hmac.New(sha256.New, []byte(secret+"x"))
	m.Write([]byte(ts + "." + string(g.body)))
	if hex.EncodeToString(m.Sum(nil)) == strings.TrimPrefix(parts[1], "v1=") {
		t.Fatal("another secret gives the same signature")
	}
}

// fastConfig retries fast. Its Timeout (and the lease after it) is far above any answer of a
// loopback receiver on a loaded machine: an answer must not race it. The tests of a hung
// receiver set a short Timeout of their own.
func fastConfig() *webhook.Config {
	return &webhook.Config{
		Timeout: 10 * time.Second, MaxAttempts: 5,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 80 * time.Millisecond, PollInterval: 10 * time.Millisecond,
		AllowPrivate: true, // the receivers are httptest servers on loopback
	}
}

func startSender(t *testing.T, l ledger.Ledger, cfg *webhook.Config) *webhook.Sender {
	t.Helper()
	s, err := webhook.NewSender(l.(ledger.Webhooks), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		if err := s.Stop(ctx); err != nil {
			t.Error(err)
		}
	})
	return s
}

// waitLimit bounds a wait for something that must happen: it only ends a test that would hang,
// so it is far above what a loaded machine (race detector, two cores, other packages compiling)
// takes. waitFor returns as soon as its condition holds.
const waitLimit = time.Minute

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func deliveries(t *testing.T, l ledger.Ledger, id string) []ledger.Delivery {
	t.Helper()
	p, err := l.(ledger.Webhooks).ListDeliveries(context.Background(), id, ledger.ListQuery{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	return p.Data
}

// makeEvents triggers one event of each type: a credit, a charge that crosses the org's
// low-balance threshold (through the accounting of usage, as the worker does), a revoked key.
func makeEvents(t *testing.T, l ledger.Ledger, org string) (keyID string) {
	t.Helper()
	ctx := context.Background()
	h := l.(ledger.Webhooks)
	if err := l.CreateOrg(ctx, org); err != nil {
		t.Fatal(err)
	}
	thr := int64(1_000)
	if err := h.SetLowBalanceThreshold(ctx, org, &thr); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Credit(ctx, org, 1_500, "pay-"+org); err != nil {
		t.Fatal(err)
	}
	ev := ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: org, Model: "m", Cost: 700, HoldAmount: 900}
	if err := l.RecordUsage(ctx, []ledger.UsageEvent{ev}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.AccountPending(ctx, 100); err != nil {
		t.Fatal(err)
	}
	k, _, err := l.CreateKey(ctx, org)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.RevokeKey(ctx, k.ID); err != nil {
		t.Fatal(err)
	}
	return k.ID
}

// TestDeliveryFailsHangsRecovers: every event reaches a receiver that first answers 500, then
// hangs past the timeout, then recovers: at least once, signed, with one event id on every try.
func TestDeliveryFailsHangsRecovers(t *testing.T) {
	t.Parallel()
	ledgers(t, func(t *testing.T, l ledger.Ledger) {
		r := newReceiver(t, func(n int) int {
			switch n {
			case 1:
				return http.StatusInternalServerError
			case 2:
				return 0 // hang
			default:
				return http.StatusNoContent
			}
		})
		w, secret, err := l.(ledger.Webhooks).CreateWebhook(context.Background(), r.URL+"/hook", ledger.EventTypes)
		if err != nil {
			t.Fatal(err)
		}
		keyID := makeEvents(t, l, "acme")
		// A backoff long enough (≥ 1 s after the second try) for the poll below to see each
		// delivery between its hung try and its retry, as the delivery's own record has it.
		cfg := fastConfig()
		cfg.Timeout = 300 * time.Millisecond // ends the hung try
		cfg.BackoffMin, cfg.BackoffMax = time.Second, 2*time.Second
		s := startSender(t, l, cfg)
		afterHang := map[string]ledger.Delivery{} // by event id: the record after the hung try, before the retry
		waitFor(t, "three deliveries delivered", func() bool {
			ds := deliveries(t, l, w.ID)
			for _, d := range ds {
				// The last record seen with two attempts: while the second try runs its record
				// still has the first try's outcome; after it, the hung try's, until the retry.
				if d.Status == ledger.DeliveryPending && d.Attempts == 2 && d.NextAttemptAt != nil {
					afterHang[d.EventID] = d
				}
			}
			return len(ds) == 3 && !slices.ContainsFunc(ds, func(d ledger.Delivery) bool { return d.Status != ledger.DeliveryDelivered })
		})
		for _, d := range deliveries(t, l, w.ID) {
			if d.Attempts != 3 || d.LastStatus != http.StatusNoContent || d.DeliveredAt == nil || d.NextAttemptAt != nil {
				t.Errorf("delivery %+v; want delivered at the third attempt", d)
			}
		}
		byEvent := map[string][]received{}
		for _, g := range r.requests() {
			verify(t, secret, g)
			byEvent[g.eventID] = append(byEvent[g.eventID], g)
		}
		types := map[string]map[string]any{}
		for id, gs := range byEvent {
			if len(gs) != 3 {
				t.Fatalf("event %s arrived %d times, want 3 (500, hang, 204)", id, len(gs))
			}
			for i, g := range gs {
				if string(g.body) != string(gs[0].body) || g.attempt != i+1 || g.eventType != gs[0].eventType {
					t.Fatalf("event %s try %d: attempt %d, type %s, body %s (first %s)", id, i+1, g.attempt, g.eventType, g.body, gs[0].body)
				}
			}
			// The hung try was cut by the sender's timeout, and its retry was scheduled at least
			// the backoff after it (the backoff of a second attempt is drawn from
			// [BackoffMin, 2·BackoffMin]; the try ended after it reached the receiver) and not sent
			// before that time. Both read from the delivery's own record, not from a clock gap.
			d, ok := afterHang[id]
			if !ok {
				t.Fatalf("event %s: never saw its delivery pending after the hung try", id)
			}
			if d.LastError != "no answer within 300ms" || d.LastStatus != 0 {
				t.Errorf("event %s: after the hung try the record says %q (HTTP %d); want the timeout", id, d.LastError, d.LastStatus)
			}
			if next := *d.NextAttemptAt; next.Before(gs[1].at.Add(cfg.BackoffMin).Truncate(time.Microsecond)) {
				t.Errorf("event %s: retry scheduled at %v, less than the backoff (%v) after the hung try reached the receiver at %v",
					id, next, cfg.BackoffMin, gs[1].at)
			} else if gs[2].at.Before(next.Truncate(time.Microsecond)) {
				t.Errorf("event %s: retry sent at %v, before its scheduled time %v", id, gs[2].at, next)
			}
			var body struct {
				ID, Type, Org string
				Data          map[string]any
			}
			if err := json.Unmarshal(gs[0].body, &body); err != nil || body.ID != id || body.Type != gs[0].eventType || body.Org != "acme" {
				t.Fatalf("body %s: %v", gs[0].body, err)
			}
			types[body.Type] = body.Data
		}
		want := map[string]map[string]any{
			"credit.received": {"amount": 1500.0, "reference": "pay-acme", "seq": 1.0, "balance": 1500.0},
			"balance.low":     {"balance": 800.0, "threshold": 1000.0},
			"key.revoked":     {"key_id": keyID},
		}
		if fmt.Sprint(types) != fmt.Sprint(want) {
			t.Fatalf("events %v, want %v", types, want)
		}
		st := s.Stats()
		if st.Delivered != 3 || st.Retries != 6 || st.Attempts != 9 || st.Failed != 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestDeliveryGivesUp: after MaxAttempts the delivery is failed, with its last error, and no
// further request is sent.
func TestDeliveryGivesUp(t *testing.T) {
	t.Parallel()
	ledgers(t, func(t *testing.T, l ledger.Ledger) {
		r := newReceiver(t, func(int) int { return http.StatusBadGateway })
		w, _, err := l.(ledger.Webhooks).CreateWebhook(context.Background(), r.URL, []ledger.EventType{ledger.EventCreditReceived})
		if err != nil {
			t.Fatal(err)
		}
		if err := l.CreateOrg(context.Background(), "o"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(context.Background(), "o", 5, "p"); err != nil {
			t.Fatal(err)
		}
		cfg := fastConfig()
		cfg.MaxAttempts = 3
		s := startSender(t, l, cfg)
		waitFor(t, "the delivery to fail", func() bool {
			ds := deliveries(t, l, w.ID)
			return len(ds) == 1 && ds[0].Status == ledger.DeliveryFailed
		})
		d := deliveries(t, l, w.ID)[0]
		if d.Attempts != 3 || d.LastError != "HTTP 502" || d.LastStatus != 502 || d.NextAttemptAt != nil || d.DeliveredAt != nil {
			t.Fatalf("failed delivery %+v", d)
		}
		time.Sleep(200 * time.Millisecond) // longer than any backoff: nothing more is sent
		if n := len(r.requests()); n != 3 {
			t.Fatalf("%d requests, want 3", n)
		}
		if st := s.Stats(); st.Failed != 1 || st.Retries != 2 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestTwoSendersOneLedger: several proxies on one Postgres never send the same attempt twice,
// and every event is delivered.
func TestTwoSendersOneLedger(t *testing.T) {
	t.Parallel()
	env := testutil.Postgres(t)
	if _, err := migrations.Up(context.Background(), env.Pool); err != nil {
		t.Fatal(err)
	}
	l := mustPostgres(t, env.Pool)
	r := newReceiver(t, func(n int) int {
		if n == 1 {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	})
	w, _, err := l.CreateWebhook(context.Background(), r.URL, []ledger.EventType{ledger.EventCreditReceived})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.CreateOrg(context.Background(), "o"); err != nil {
		t.Fatal(err)
	}
	const events = 60
	for i := range events {
		if _, _, err := l.Credit(context.Background(), "o", 1, fmt.Sprint("p", i)); err != nil {
			t.Fatal(err)
		}
	}
	cfg := fastConfig()
	cfg.Concurrency = 4
	startSender(t, l, cfg)
	startSender(t, mustPostgres(t, env.Pool), cfg) // another process's ledger on the same database
	waitFor(t, "every event delivered", func() bool {
		n := 0
		for _, d := range deliveries(t, l, w.ID) {
			if d.Status == ledger.DeliveryDelivered {
				n++
			}
		}
		return n == events
	})
	seen := map[string]bool{}
	for _, g := range r.requests() {
		k := fmt.Sprint(g.eventID, "#", g.attempt)
		if seen[k] {
			t.Fatalf("attempt %d of event %s sent twice", g.attempt, g.eventID)
		}
		seen[k] = true
	}
	if len(seen) != 2*events {
		t.Fatalf("%d requests, want %d (a 503, then a 200, per event)", len(seen), 2*events)
	}
}

func TestNewSenderRefusesLeaseBelowTimeout(t *testing.T) {
	t.Parallel()
	_, err := webhook.NewSender(memledger.New(), &webhook.Config{Timeout: time.Minute, Lease: time.Second})
	if err == nil {
		t.Fatal("a lease shorter than the timeout was accepted")
	}
	s, err := webhook.NewSender(memledger.New(), nil)
	if err != nil {
		t.Fatal(err)
	}
	c := s.Config()
	if c.Timeout != webhook.DefaultTimeout || c.Lease != webhook.DefaultTimeout+webhook.LeaseMargin || c.MaxAttempts != webhook.DefaultMaxAttempts {
		t.Fatalf("defaults %+v", c)
	}
}

func TestBackoffGrowsWithJitter(t *testing.T) {
	t.Parallel()
	s, err := webhook.NewSender(memledger.New(), &webhook.Config{BackoffMin: time.Second, BackoffMax: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for n, w := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 40: 10 * time.Second} {
		seen := map[time.Duration]bool{}
		for range 50 {
			d := s.Backoff(n)
			if d < w/2 || d > w {
				t.Fatalf("backoff after attempt %d = %v, want in [%v, %v]", n, d, w/2, w)
			}
			seen[d] = true
		}
		if len(seen) < 10 {
			t.Fatalf("backoff after attempt %d: only %d distinct waits in 50 (no jitter?)", n, len(seen))
		}
	}
}

// flakyStore is a ledger's webhook side whose outbox reads and outcome writes fail on demand,
// as in a ledger outage.
type flakyStore struct {
	ledger.Webhooks
	mu                        sync.Mutex
	claimDown                 bool
	finishFailures, finishTry int
	claimed                   []ledger.Delivery // every delivery claimed, as the claim returned it
	claimedAt                 []time.Time       // for each: when its claim was called
}

func (f *flakyStore) ClaimDeliveries(ctx context.Context, limit int, lease time.Duration, per ledger.EndpointLimit) ([]ledger.Delivery, error) {
	f.mu.Lock()
	down := f.claimDown
	f.mu.Unlock()
	if down {
		return nil, fmt.Errorf("claim: %w", ledger.ErrLedgerUnavailable)
	}
	at := time.Now()
	ds, err := f.Webhooks.ClaimDeliveries(ctx, limit, lease, per)
	f.mu.Lock()
	f.claimed = append(f.claimed, ds...)
	for range ds {
		f.claimedAt = append(f.claimedAt, at)
	}
	f.mu.Unlock()
	return ds, err
}

func (f *flakyStore) FinishDelivery(ctx context.Context, id int64, attempt int, o ledger.Outcome) error {
	f.mu.Lock()
	f.finishTry++
	fail := f.finishTry <= f.finishFailures
	f.mu.Unlock()
	if fail {
		return fmt.Errorf("finish: %w", ledger.ErrLedgerUnavailable)
	}
	return f.Webhooks.FinishDelivery(ctx, id, attempt, o)
}

// TestDeliveryRidesOutLedgerOutage: while the outbox cannot be read nothing is sent (and the
// failures are counted); an attempt whose outcome could not be recorded is sent again after its
// lease, with the same event id — at least once, never lost.
func TestDeliveryRidesOutLedgerOutage(t *testing.T) {
	t.Parallel()
	ledgers(t, func(t *testing.T, l ledger.Ledger) {
		r := newReceiver(t, func(int) int { return http.StatusOK })
		store := &flakyStore{Webhooks: l.(ledger.Webhooks), claimDown: true, finishFailures: 1}
		w, secret, err := store.CreateWebhook(context.Background(), r.URL, []ledger.EventType{ledger.EventCreditReceived})
		if err != nil {
			t.Fatal(err)
		}
		if err := l.CreateOrg(context.Background(), "o"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(context.Background(), "o", 5, "p"); err != nil {
			t.Fatal(err)
		}
		cfg := fastConfig()
		cfg.Timeout, cfg.Lease = 300*time.Millisecond, 500*time.Millisecond
		s, err := webhook.NewSender(store, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Stop(context.Background()) })
		waitFor(t, "claim errors", func() bool { return s.Stats().ClaimErrors >= 3 })
		if n := len(r.requests()); n != 0 {
			t.Fatalf("%d requests while the outbox was unreadable", n)
		}
		store.mu.Lock()
		store.claimDown = false
		store.mu.Unlock()
		waitFor(t, "the delivery", func() bool {
			ds := deliveries(t, l, w.ID)
			return len(ds) == 1 && ds[0].Status == ledger.DeliveryDelivered
		})
		got := r.requests()
		if len(got) != 2 || got[0].eventID != got[1].eventID || got[0].attempt != 1 || got[1].attempt != 2 || string(got[0].body) != string(got[1].body) {
			t.Fatalf("requests %+v; want the event twice (its first outcome was not recorded), same id and body", got)
		}
		// Sent again only once the first claim's lease was over (the claim's record has the
		// lease's end as its next attempt time), not after a gap measured here.
		store.mu.Lock()
		claimed, claimedAt := slices.Clone(store.claimed), slices.Clone(store.claimedAt)
		store.mu.Unlock()
		if len(claimed) != 2 || claimed[0].NextAttemptAt == nil {
			t.Fatalf("claims %+v; want two", claimed)
		}
		if end, least := *claimed[0].NextAttemptAt, claimedAt[0].Add(cfg.Lease).Truncate(time.Microsecond); end.Before(least) {
			t.Fatalf("the first claim's lease ends at %v, less than the %v lease after the claim (%v)", end, cfg.Lease, claimedAt[0])
		}
		if end := claimed[0].NextAttemptAt.Truncate(time.Microsecond); got[1].at.Before(end) {
			t.Fatalf("resent at %v, before the first claim's lease ended at %v", got[1].at, end)
		}
		for _, g := range got {
			verify(t, secret, g)
		}
		if d := deliveries(t, l, w.ID)[0]; d.Attempts != 2 {
			t.Fatalf("delivery %+v", d)
		}
	})
}
