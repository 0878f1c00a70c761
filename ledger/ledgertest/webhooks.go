package ledgertest

import (
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// webhookTests run on every ledger: each must implement ledger.Webhooks (a ledger that
// does not fails them, never skips them).
var webhookTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"WebhookEndpoints", testWebhookEndpoints},
	{"WebhookLowBalanceThreshold", testWebhookThreshold},
	{"WebhookOutboxEvents", testWebhookEvents},
	{"WebhookOutboxRollsBackWithChange", testWebhookRollback},
	{"WebhookDeliveryLifecycle", testWebhookDeliveryLifecycle},
	{"WebhookDeliveryLeaseExpires", testWebhookLease},
	{"WebhookClaimConcurrent", testWebhookClaimConcurrent},
	{"WebhookClaimPerEndpoint", testWebhookClaimPerEndpoint},
}

func hooks(t *testing.T, l ledger.Ledger) ledger.Webhooks {
	t.Helper()
	h, ok := l.(ledger.Webhooks)
	if !ok {
		t.Fatalf("%T does not implement accounting.Webhooks", l)
	}
	return h
}

func testWebhookEndpoints(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	for _, bad := range []string{"", "ftp://x/y", "/relative", "http://", "not a url"} {
		_, _, err := h.CreateWebhook(c, bad, []ledger.EventType{ledger.EventKeyRevoked})
		wantErr(t, err, ledger.ErrInvalidWebhook, "CreateWebhook "+bad)
	}
	_, _, err := h.CreateWebhook(c, "https://example.com/h", nil)
	wantErr(t, err, ledger.ErrInvalidWebhook, "CreateWebhook without events")
	_, _, err = h.CreateWebhook(c, "https://example.com/h", []ledger.EventType{"limit.exceeded"})
	wantErr(t, err, ledger.ErrInvalidWebhook, "CreateWebhook with an unknown event")

	w1, s1, err := h.CreateWebhook(c, "https://example.com/a", []ledger.EventType{ledger.EventKeyRevoked, ledger.EventBalanceLow, ledger.EventKeyRevoked})
	noErr(t, err)
	w2, s2, err := h.CreateWebhook(c, "http://127.0.0.1:9/b?x=1", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	if !strings.HasPrefix(s1, ledger.SecretPrefix) || len(s1) < 40 || s1 == s2 || w1.ID == w2.ID || w1.CreatedAt.IsZero() {
		t.Fatalf("webhooks %+v %+v with secrets of length %d, %d", w1, w2, len(s1), len(s2))
	}
	if want := []ledger.EventType{ledger.EventBalanceLow, ledger.EventKeyRevoked}; !slices.Equal(w1.Events, want) {
		t.Fatalf("events %v, want %v (sorted, no duplicate)", w1.Events, want)
	}
	ws := must(h.ListWebhooks(c))
	if len(ws) != 2 || ws[0].ID != w1.ID || ws[1].ID != w2.ID || ws[1].URL != w2.URL || !slices.Equal(ws[0].Events, w1.Events) {
		t.Fatalf("ListWebhooks = %+v", ws)
	}
	b, _ := json.Marshal(ws)
	if strings.Contains(string(b), s1) || strings.Contains(string(b), s2) {
		t.Fatalf("a listed webhook shows its secret: %s", b)
	}
	wantErr(t, h.DeleteWebhook(c, "wh_nope"), ledger.ErrUnknownWebhook, "DeleteWebhook of an unknown id")
	noErr(t, h.DeleteWebhook(c, w1.ID))
	wantErr(t, h.DeleteWebhook(c, w1.ID), ledger.ErrUnknownWebhook, "DeleteWebhook twice")
	if ws := must(h.ListWebhooks(c)); len(ws) != 1 || ws[0].ID != w2.ID {
		t.Fatalf("after delete: %+v", ws)
	}
	_, err = h.ListDeliveries(c, w1.ID, ledger.ListQuery{})
	wantErr(t, err, ledger.ErrUnknownWebhook, "ListDeliveries of a deleted webhook")
	p := must(h.ListDeliveries(c, w2.ID, ledger.ListQuery{}))
	if len(p.Data) != 0 || p.Next != "" {
		t.Fatalf("deliveries of a new webhook: %+v", p)
	}
}

func testWebhookThreshold(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	v := int64(500)
	wantErr(t, h.SetLowBalanceThreshold(c, "nobody", &v), ledger.ErrUnknownOrg, "threshold of a missing org")
	_, err := h.LowBalanceThreshold(c, "nobody")
	wantErr(t, err, ledger.ErrUnknownOrg, "threshold of a missing org")
	noErr(t, l.CreateOrg(c, "o"))
	if got := must(h.LowBalanceThreshold(c, "o")); got != nil {
		t.Fatalf("new org's threshold = %d, want none", *got)
	}
	noErr(t, h.SetLowBalanceThreshold(c, "o", &v))
	if got := must(h.LowBalanceThreshold(c, "o")); got == nil || *got != 500 {
		t.Fatalf("threshold = %v, want 500", got)
	}
	big := int64(1e15)
	wantErr(t, h.SetLowBalanceThreshold(c, "o", &big), ledger.ErrInvalidAmount, "threshold beyond 10^14")
	noErr(t, h.SetLowBalanceThreshold(c, "o", nil))
	if got := must(h.LowBalanceThreshold(c, "o")); got != nil {
		t.Fatalf("cleared threshold = %d", *got)
	}
}

// sentEvent is a claimed delivery's body, decoded.
type sentEvent struct {
	ID        string         `json:"id"`
	Type      string         `json:"type"`
	Org       string         `json:"org"`
	CreatedAt time.Time      `json:"created_at"`
	Data      map[string]any `json:"data"`
}

// claimAll claims every due delivery (long lease) and decodes their bodies by webhook.
func claimAll(t *testing.T, h ledger.Webhooks) map[string][]sentEvent {
	t.Helper()
	ds := must(h.ClaimDeliveries(ctx(t), 1000, time.Hour, ledger.EndpointLimit{}))
	out := map[string][]sentEvent{}
	for _, d := range ds {
		var e sentEvent
		dec := json.NewDecoder(strings.NewReader(string(d.Body)))
		dec.UseNumber()
		if err := dec.Decode(&e); err != nil {
			t.Fatalf("delivery %d body %q: %v", d.ID, d.Body, err)
		}
		if e.ID != d.EventID || e.Type != string(d.EventType) || e.Org != d.Org || e.CreatedAt.IsZero() || d.Secret == "" || d.URL == "" {
			t.Fatalf("delivery %+v has body %s", d, d.Body)
		}
		out[d.WebhookID] = append(out[d.WebhookID], e)
	}
	for _, es := range out {
		slices.SortStableFunc(es, func(a, b sentEvent) int { return a.CreatedAt.Compare(b.CreatedAt) })
	}
	return out
}

// brief is an event as "type org k=v …" (data keys sorted), for comparing.
func brief(e sentEvent) string {
	var keys []string
	for k := range e.Data {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	s := e.Type + " " + e.Org
	for _, k := range keys {
		s += " " + k + "=" + jsonText(e.Data[k])
	}
	return s
}

func jsonText(v any) string {
	b, _ := json.Marshal(v)
	return strings.Trim(string(b), `"`)
}

func briefs(es []sentEvent) []string {
	var out []string
	for _, e := range es {
		out = append(out, brief(e))
	}
	return out
}

// testWebhookEvents: every trigger writes its event with the change, once, to the endpoints that
// subscribe to its type.
func testWebhookEvents(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	noErr(t, l.CreateOrg(c, "quiet")) // no threshold: never balance.low
	// Before any endpoint exists nothing is written.
	must2(l.Credit(c, "o", 10, "before"))
	all, _, err := h.CreateWebhook(c, "https://example.com/all", ledger.EventTypes)
	noErr(t, err)
	credits, _, err := h.CreateWebhook(c, "https://example.com/credits", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	thr := int64(1_000)
	noErr(t, h.SetLowBalanceThreshold(c, "o", &thr))

	must2(l.Credit(c, "o", 4_990, "pay-1")) // balance 5000
	must2(l.Credit(c, "o", 4_990, "pay-1")) // the same credit again: no event
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("o", 3_000, 0)}))
	must(l.AccountPending(c, 100)) // 2000: still above
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("o", 700, 1), event("o", 800, 2), event("quiet", 5, 3)}))
	must(l.AccountPending(c, 100)) // 500: crossed, once for the batch
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("o", 100, 4)}))
	must(l.AccountPending(c, 100))          // 400: still below, no event
	must2(l.Credit(c, "o", 600, "pay-2"))   // 1000: at the threshold is not below
	must2(l.Adjust(c, "o", -1, "fix-1"))    // 999: crossed again
	must2(l.Adjust(c, "o", 2_000, "fix-2")) // 2999
	noErr(t, l.RecordUsage(c, []ledger.UsageEvent{event("o", 2_500, 5)}))
	must(l.Snapshot(c, "o")) // the seed's accounting: 499, crossed again
	k, _ := must2(l.CreateKey(c, "o"))
	noErr(t, l.RevokeKey(c, k.ID))
	noErr(t, l.RevokeKey(c, k.ID)) // revoking twice: one event

	got := claimAll(t, h)
	wantAll := []string{
		"credit.received o amount=4990 balance=5000 reference=pay-1 seq=2",
		"balance.low o balance=500 threshold=1000",
		"credit.received o amount=600 balance=1000 reference=pay-2 seq=7",
		"balance.low o balance=999 threshold=1000",
		"balance.low o balance=499 threshold=1000",
		"key.revoked o key_id=" + k.ID,
	}
	if b := briefs(got[all.ID]); !slices.Equal(b, wantAll) {
		t.Fatalf("events to the all-events webhook:\n%s\nwant\n%s", strings.Join(b, "\n"), strings.Join(wantAll, "\n"))
	}
	if b := briefs(got[credits.ID]); !slices.Equal(b, []string{wantAll[0], wantAll[2]}) {
		t.Fatalf("events to the credits webhook: %q", b)
	}
	// One event, one id, whichever endpoints receive it.
	if got[all.ID][0].ID != got[credits.ID][0].ID || got[all.ID][0].ID == got[all.ID][2].ID {
		t.Fatalf("event ids: %s %s %s", got[all.ID][0].ID, got[credits.ID][0].ID, got[all.ID][2].ID)
	}
	if len(got) != 2 {
		t.Fatalf("deliveries to %d webhooks", len(got))
	}
	checkLedger(t, l, "o")
}

// testWebhookRollback: a change that fails writes no event.
func testWebhookRollback(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "a"))
	noErr(t, l.CreateOrg(c, "b"))
	_, _, err := h.CreateWebhook(c, "https://example.com/all", ledger.EventTypes)
	noErr(t, err)
	thr := int64(100)
	noErr(t, h.SetLowBalanceThreshold(c, "b", &thr))
	must2(l.Credit(c, "a", 50, "ref-a"))
	must2(l.Credit(c, "b", 200, "ref-b"))
	_, _, err = l.Credit(c, "b", 50, "ref-a") // a reference of another org
	wantErr(t, err, ledger.ErrReferenceConflict, "Credit with another org's reference")
	_, _, err = l.Adjust(c, "b", -150-1e14, "too-much")
	if err == nil {
		t.Fatal("an adjustment beyond the balance bound was written")
	}
	got := claimAll(t, h)
	var b []string
	for _, es := range got {
		b = append(b, briefs(es)...)
	}
	slices.Sort(b)
	want := []string{"credit.received a amount=50 balance=50 reference=ref-a seq=1", "credit.received b amount=200 balance=200 reference=ref-b seq=1"}
	if !slices.Equal(b, want) {
		t.Fatalf("events %q, want %q", b, want)
	}
}

// deliveriesOf returns every delivery of a webhook, newest first, through the paged list.
func deliveriesOf(t *testing.T, h ledger.Webhooks, id string) []ledger.Delivery {
	t.Helper()
	all, _ := pages(t, func(cursor string) (ledger.Page[ledger.Delivery], error) {
		return h.ListDeliveries(ctx(t), id, ledger.ListQuery{Cursor: cursor, Limit: 2})
	})
	return all
}

func testWebhookDeliveryLifecycle(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	w, secret, err := h.CreateWebhook(c, "https://example.com/w", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	for i := range 5 {
		must2(l.Credit(c, "o", int64(i+1), "pay-"+string(rune('a'+i))))
	}
	ds := deliveriesOf(t, h, w.ID)
	if len(ds) != 5 {
		t.Fatalf("%d deliveries listed, want 5", len(ds))
	}
	for i, d := range ds {
		if d.Status != ledger.DeliveryPending || d.Attempts != 0 || d.NextAttemptAt == nil || d.WebhookID != w.ID ||
			d.EventType != ledger.EventCreditReceived || d.Org != "o" || (i > 0 && d.ID >= ds[i-1].ID) {
			t.Fatalf("delivery %d: %+v", i, d)
		}
	}
	claims := must(h.ClaimDeliveries(c, 2, time.Hour, ledger.EndpointLimit{}))
	if len(claims) != 2 || claims[0].ID != ds[4].ID || claims[1].ID != ds[3].ID || claims[0].Attempts != 1 || claims[0].Secret != secret || claims[0].URL != w.URL {
		t.Fatalf("first claims (oldest first) %+v", claims)
	}
	rest := must(h.ClaimDeliveries(c, 10, time.Hour, ledger.EndpointLimit{}))
	if len(rest) != 3 {
		t.Fatalf("second claim got %d, want the 3 others", len(rest))
	}
	if again := must(h.ClaimDeliveries(c, 10, time.Hour, ledger.EndpointLimit{})); len(again) != 0 {
		t.Fatalf("claimed deliveries claimed again within their lease: %+v", again)
	}
	d0, d1, d2 := claims[0], claims[1], rest[0]
	wantErr(t, h.FinishDelivery(c, d0.ID, 2, ledger.Outcome{Status: ledger.DeliveryDelivered}), ledger.ErrDeliveryChanged, "finish of another attempt")
	wantErr(t, h.FinishDelivery(c, 1<<40, 1, ledger.Outcome{Status: ledger.DeliveryDelivered}), ledger.ErrDeliveryChanged, "finish of an unknown delivery")
	noErr(t, h.FinishDelivery(c, d0.ID, 1, ledger.Outcome{Status: ledger.DeliveryDelivered, HTTPStatus: 204}))
	wantErr(t, h.FinishDelivery(c, d0.ID, 1, ledger.Outcome{Status: ledger.DeliveryFailed}), ledger.ErrDeliveryChanged, "finish twice")
	noErr(t, h.FinishDelivery(c, d1.ID, 1, ledger.Outcome{Status: ledger.DeliveryPending, RetryAfter: 0, HTTPStatus: 500, Error: "HTTP 500"}))
	noErr(t, h.FinishDelivery(c, d2.ID, 1, ledger.Outcome{Status: ledger.DeliveryFailed, Error: strings.Repeat("x", 2000)}))
	retry := must(h.ClaimDeliveries(c, 10, time.Hour, ledger.EndpointLimit{}))
	if len(retry) != 1 || retry[0].ID != d1.ID || retry[0].Attempts != 2 || string(retry[0].Body) != string(d1.Body) || retry[0].EventID != d1.EventID {
		t.Fatalf("retry claim %+v; want delivery %d again, attempt 2, the same body", retry, d1.ID)
	}
	noErr(t, h.FinishDelivery(c, d1.ID, 2, ledger.Outcome{Status: ledger.DeliveryPending, RetryAfter: time.Hour, Error: "timeout"}))
	byID := map[int64]ledger.Delivery{}
	for _, d := range deliveriesOf(t, h, w.ID) {
		byID[d.ID] = d
	}
	if d := byID[d0.ID]; d.Status != ledger.DeliveryDelivered || d.DeliveredAt == nil || d.NextAttemptAt != nil || d.Attempts != 1 || d.LastStatus != 204 || d.LastError != "" {
		t.Fatalf("delivered: %+v", d)
	}
	if d := byID[d1.ID]; d.Status != ledger.DeliveryPending || d.Attempts != 2 || d.LastError != "timeout" || d.NextAttemptAt == nil ||
		d.NextAttemptAt.Before(time.Now().Add(50*time.Minute)) || d.DeliveredAt != nil {
		t.Fatalf("retrying: %+v", d)
	}
	if d := byID[d2.ID]; d.Status != ledger.DeliveryFailed || d.NextAttemptAt != nil || len(d.LastError) == 0 || len(d.LastError) > 1000 {
		t.Fatalf("failed: %+v (error of %d bytes)", d, len(d.LastError))
	}
	// Deleting the webhook drops its deliveries: nothing more is claimed for it.
	noErr(t, h.DeleteWebhook(c, w.ID))
	wantErr(t, h.FinishDelivery(c, rest[1].ID, 1, ledger.Outcome{Status: ledger.DeliveryDelivered}), ledger.ErrDeliveryChanged, "finish after delete")
}

func testWebhookLease(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	_, _, err := h.CreateWebhook(c, "https://example.com/w", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	must2(l.Credit(c, "o", 1, "p"))
	first := must(h.ClaimDeliveries(c, 10, 50*time.Millisecond, ledger.EndpointLimit{}))
	if len(first) != 1 {
		t.Fatalf("claimed %d", len(first))
	}
	// The worker holding the claim died: after the lease another one gets the next attempt.
	var second []ledger.Delivery
	deadline := time.Now().Add(waitLimit)
	for len(second) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		second = must(h.ClaimDeliveries(c, 10, time.Hour, ledger.EndpointLimit{}))
	}
	if len(second) != 1 || second[0].ID != first[0].ID || second[0].Attempts != 2 || second[0].EventID != first[0].EventID {
		t.Fatalf("after the lease: %+v", second)
	}
	// The late outcome of the first attempt is refused; the second's is kept.
	wantErr(t, h.FinishDelivery(c, first[0].ID, 1, ledger.Outcome{Status: ledger.DeliveryFailed}), ledger.ErrDeliveryChanged, "finish after the lease")
	noErr(t, h.FinishDelivery(c, first[0].ID, 2, ledger.Outcome{Status: ledger.DeliveryDelivered, HTTPStatus: 200}))
}

func testWebhookClaimConcurrent(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	for range 3 {
		_, _, err := h.CreateWebhook(c, "https://example.com/w", []ledger.EventType{ledger.EventCreditReceived})
		noErr(t, err)
	}
	const credits = 40
	for i := range credits {
		must2(l.Credit(c, "o", 1, "p"+strings.Repeat("x", i)))
	}
	var mu sync.Mutex
	seen := map[int64]int{}
	var wg sync.WaitGroup
	var errs []error
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				ds, err := h.ClaimDeliveries(c, 7, time.Hour, ledger.EndpointLimit{})
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				}
				for _, d := range ds {
					seen[d.ID]++
				}
				mu.Unlock()
				if err != nil || len(ds) == 0 {
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 3*credits {
		t.Fatalf("%d deliveries claimed, want %d", len(seen), 3*credits)
	}
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("delivery %d claimed %d times within its lease", id, n)
		}
	}
}

// testWebhookClaimPerEndpoint: a claim takes no more of one endpoint's deliveries than its
// EndpointLimit leaves (Max less the endpoint's busy attempts), oldest due first, and fills the
// rest of its limit from the other endpoints.
func testWebhookClaimPerEndpoint(t *testing.T, l ledger.Ledger) {
	c, h := ctx(t), hooks(t, l)
	noErr(t, l.CreateOrg(c, "o"))
	slow, _, err := h.CreateWebhook(c, "https://slow.example.com/w", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	fast, _, err := h.CreateWebhook(c, "https://fast.example.com/w", []ledger.EventType{ledger.EventCreditReceived})
	noErr(t, err)
	for i := range 6 {
		must2(l.Credit(c, "o", 1, "p"+strings.Repeat("x", i)))
	}
	count := func(ds []ledger.Delivery) map[string]int {
		n := map[string]int{}
		for _, d := range ds {
			n[d.WebhookID]++
		}
		return n
	}
	first := must(h.ClaimDeliveries(c, 8, time.Hour, ledger.EndpointLimit{Max: 2, Busy: map[string]int{slow.ID: 1}}))
	if n := count(first); n[slow.ID] != 1 || n[fast.ID] != 2 || len(first) != 3 {
		t.Fatalf("first claim %v (slow %s, fast %s); want 1 of slow (1 busy of 2) and 2 of fast", n, slow.ID, fast.ID)
	}
	all := deliveriesOf(t, h, slow.ID) // newest first
	for _, d := range first {
		if d.WebhookID == slow.ID && d.ID != all[len(all)-1].ID {
			t.Fatalf("claimed slow delivery %d, not the oldest due %d", d.ID, all[len(all)-1].ID)
		}
	}
	full := must(h.ClaimDeliveries(c, 8, time.Hour, ledger.EndpointLimit{Max: 2, Busy: map[string]int{slow.ID: 2, fast.ID: 5}}))
	if len(full) != 0 {
		t.Fatalf("claimed %v with both endpoints full", count(full))
	}
	rest := must(h.ClaimDeliveries(c, 3, time.Hour, ledger.EndpointLimit{}))
	if len(rest) != 3 {
		t.Fatalf("an unbounded claim of 3 got %d", len(rest))
	}
	if left := must(h.ClaimDeliveries(c, 100, time.Hour, ledger.EndpointLimit{Max: 100})); len(left) != 12-6 {
		t.Fatalf("the last claim got %d, want the %d left", len(left), 12-6)
	}
}
