package ledgertest

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
)

// topUpTests run on every ledger: each must implement topup.Store.
var topUpTests = []struct {
	name string
	fn   func(t *testing.T, l ledger.Ledger)
}{
	{"TopUpSettings", testTopUpSettings},
	{"TopUpAttempts", testTopUpAttempts},
	{"TopUpBeginConcurrent", testTopUpConcurrent},
	{"TopUpCaps", testTopUpCaps},
	{"CreditOrg", testCreditOrg},
}

func payments(t *testing.T, l ledger.Ledger) topup.Store {
	t.Helper()
	p, ok := l.(topup.Store)
	if !ok {
		t.Fatalf("%T does not implement topup.Store", l)
	}
	return p
}

func topUpOf(org string) topup.Settings {
	return topup.Settings{Org: org, Threshold: 1000, Amount: 500, Currency: "USD", Customer: "cus_" + org,
		PaymentMethod: "pm_card_visa", DailyCap: 1000, MonthlyCap: 2000}
}

func testTopUpSettings(t *testing.T, l ledger.Ledger) {
	c, p := ctx(t), payments(t, l)
	_, err := p.PutTopUp(c, topUpOf("nobody"))
	wantErr(t, err, ledger.ErrUnknownOrg, "PutTopUp of an unknown org")
	noErr(t, l.CreateOrg(c, "acme"))
	_, err = p.TopUp(c, "acme")
	wantErr(t, err, topup.ErrNoSettings, "TopUp before PutTopUp")
	for _, bad := range []func(*topup.Settings){
		func(s *topup.Settings) { s.Amount = 0 },
		func(s *topup.Settings) { s.Currency = "dollars" },
		func(s *topup.Settings) { s.Customer = "" },
		func(s *topup.Settings) { s.PaymentMethod = "pm card" },
		func(s *topup.Settings) { s.DailyCap = 499 },
		func(s *topup.Settings) { s.DailyCap, s.MonthlyCap = 3000, 2000 },
	} {
		s := topUpOf("acme")
		bad(&s)
		_, err := p.PutTopUp(c, s)
		wantErr(t, err, topup.ErrInvalid, "PutTopUp of bad settings")
	}
	s := must(p.PutTopUp(c, topUpOf("acme")))
	if s.Currency != "usd" || s.UpdatedAt.IsZero() || s.Stopped != "" {
		t.Fatalf("stored settings %+v", s)
	}
	got := must(p.TopUp(c, "acme"))
	if got.Threshold != 1000 || got.Customer != "cus_acme" || got.MonthlyCap != 2000 {
		t.Fatalf("read settings %+v", got)
	}
	if org := must(p.OrgOfCustomer(c, "cus_acme")); org != "acme" {
		t.Fatalf("OrgOfCustomer = %q", org)
	}
	_, err = p.OrgOfCustomer(c, "cus_other")
	wantErr(t, err, topup.ErrNoSettings, "OrgOfCustomer of an unknown customer")
	if orgs := must(p.TopUpOrgs(c)); len(orgs) != 1 || orgs[0] != "acme" {
		t.Fatalf("TopUpOrgs = %v", orgs)
	}
	noErr(t, p.DeleteTopUp(c, "acme"))
	wantErr(t, p.DeleteTopUp(c, "acme"), topup.ErrNoSettings, "DeleteTopUp twice")
	if orgs := must(p.TopUpOrgs(c)); len(orgs) != 0 {
		t.Fatalf("TopUpOrgs after delete = %v", orgs)
	}
}

func testTopUpAttempts(t *testing.T, l ledger.Ledger) {
	c, p := ctx(t), payments(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	_, err := p.BeginTopUp(c, "acme", t0)
	wantErr(t, err, topup.ErrNoSettings, "BeginTopUp without settings")
	must(p.PutTopUp(c, topUpOf("acme")))
	_, _, err = l.Credit(c, "acme", 1000, "seed-acme")
	noErr(t, err)
	_, err = p.BeginTopUp(c, "acme", t0)
	wantErr(t, err, topup.ErrNotNeeded, "BeginTopUp at the threshold")
	_, _, err = l.Adjust(c, "acme", -1, "spend-acme")
	noErr(t, err)

	a := must(p.BeginTopUp(c, "acme", t0))
	if a.Status != topup.Pending || a.Amount != 500 || a.Currency != "usd" || a.Org != "acme" || len(a.ID) < 10 {
		t.Fatalf("attempt %+v", a)
	}
	// Not yet made at the processor: the same attempt (the same idempotency key) comes back.
	if again := must(p.BeginTopUp(c, "acme", t0)); again.ID != a.ID {
		t.Fatalf("a pending attempt without payment came back as %s, want %s", again.ID, a.ID)
	}
	noErr(t, p.SetTopUpPayment(c, a.ID, "pi_1"))
	wantErr(t, p.SetTopUpPayment(c, "tu_none", "pi_2"), topup.ErrUnknownAttempt, "SetTopUpPayment of an unknown attempt")
	_, err = p.BeginTopUp(c, "acme", t0)
	wantErr(t, err, topup.ErrInFlight, "BeginTopUp with one in flight")

	done := must(p.FinishTopUp(c, a.ID, true, "", t0.Add(time.Minute)))
	if done.Status != topup.Succeeded || done.Payment != "pi_1" || done.FinishedAt == nil {
		t.Fatalf("finished %+v", done)
	}
	// Finishing again (a redelivered webhook) changes nothing.
	if again := must(p.FinishTopUp(c, a.ID, false, "late", t0.Add(2*time.Minute))); again.Status != topup.Succeeded {
		t.Fatalf("finished twice: %+v", again)
	}
	_, err = p.FinishTopUp(c, "tu_none", true, "", t0)
	wantErr(t, err, topup.ErrUnknownAttempt, "FinishTopUp of an unknown attempt")

	// A declined one stops further tries until the settings are updated, and is announced
	// (topup.failed) in its transaction.
	h := hooks(t, l)
	_, _, err = h.CreateWebhook(c, "https://example.com/topup", []ledger.EventType{ledger.EventTopUpFailed})
	noErr(t, err)
	b := must(p.BeginTopUp(c, "acme", t0.Add(time.Hour)))
	noErr(t, p.SetTopUpPayment(c, b.ID, "pi_2"))
	failed := must(p.FinishTopUp(c, b.ID, false, "card_declined", t0.Add(time.Hour)))
	if failed.Status != topup.Failed || failed.Reason != "card_declined" {
		t.Fatalf("failed attempt %+v", failed)
	}
	_, err = p.BeginTopUp(c, "acme", t0.Add(2*time.Hour))
	wantErr(t, err, topup.ErrStopped, "BeginTopUp after a decline")
	ds := must(h.ClaimDeliveries(c, 10, time.Minute, ledger.EndpointLimit{}))
	if len(ds) != 1 || ds[0].EventType != ledger.EventTopUpFailed || ds[0].Org != "acme" ||
		!strings.Contains(string(ds[0].Body), `card_declined`) || !strings.Contains(string(ds[0].Body), b.ID) {
		t.Fatalf("topup.failed deliveries %+v (%s)", ds, firstBody(ds))
	}
	must(p.FinishTopUp(c, b.ID, false, "again", t0.Add(time.Hour))) // a redelivered failure: no second event
	if ds := must(h.ClaimDeliveries(c, 10, time.Minute, ledger.EndpointLimit{})); len(ds) != 0 {
		t.Fatalf("a second topup.failed for one attempt: %+v", ds)
	}
	if s := must(p.TopUp(c, "acme")); s.Stopped == "" {
		t.Fatal("settings not stopped after a decline")
	}
	if orgs := must(p.TopUpOrgs(c)); len(orgs) != 0 {
		t.Fatalf("TopUpOrgs lists a stopped org: %v", orgs)
	}
	must(p.PutTopUp(c, topUpOf("acme")))
	if _, err := p.BeginTopUp(c, "acme", t0.Add(3*time.Hour)); err != nil {
		t.Fatalf("BeginTopUp after the settings were updated: %v", err)
	}
	list := must(p.TopUpAttempts(c, "acme", 0))
	if len(list) != 3 || list[0].Status != topup.Pending || list[2].ID != a.ID {
		t.Fatalf("attempts %+v", list)
	}
}

// testTopUpConcurrent: 100 callers at once start one attempt.
func firstBody(ds []ledger.Delivery) string {
	if len(ds) == 0 {
		return ""
	}
	return string(ds[0].Body)
}

func testTopUpConcurrent(t *testing.T, l ledger.Ledger) {
	c, p := ctx(t), payments(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	must(p.PutTopUp(c, topUpOf("acme")))
	var wg sync.WaitGroup
	var mu sync.Mutex
	ids := map[string]int{}
	errs := 0
	for range 100 {
		wg.Go(func() {
			a, err := p.BeginTopUp(c, "acme", t0)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs++
				t.Errorf("BeginTopUp: %v", err)
				return
			}
			ids[a.ID]++
		})
	}
	wg.Wait()
	if len(ids) != 1 || errs != 0 {
		t.Fatalf("100 concurrent BeginTopUp started %d attempts (%v), %d errors", len(ids), ids, errs)
	}
}

// testTopUpCaps: succeeded attempts count against the UTC day's and month's caps; failed ones
// do not.
func testTopUpCaps(t *testing.T, l ledger.Ledger) {
	c, p := ctx(t), payments(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	must(p.PutTopUp(c, topUpOf("acme"))) // 500 each, 1000 a day, 2000 a month
	day := time.Date(2026, 3, 29, 0, 0, 0, 0, time.UTC)
	run := func(at time.Time) error {
		a, err := p.BeginTopUp(c, "acme", at)
		if err != nil {
			return err
		}
		noErr(t, p.SetTopUpPayment(c, a.ID, "pi_"+a.ID))
		_, err = p.FinishTopUp(c, a.ID, true, "", at)
		return err
	}
	noErr(t, run(day.Add(time.Hour)))
	noErr(t, run(day.Add(2*time.Hour)))
	wantErr(t, run(day.Add(23*time.Hour+59*time.Minute)), topup.ErrCap, "third top-up of the day")
	noErr(t, run(day.Add(24*time.Hour)))
	noErr(t, run(day.Add(25*time.Hour)))
	wantErr(t, run(day.Add(48*time.Hour)), topup.ErrCap, "fifth top-up of the month, first of its day")
	noErr(t, run(day.Add(72*time.Hour))) // April 1: a new month
}

func testCreditOrg(t *testing.T, l ledger.Ledger) {
	c, p := ctx(t), payments(t, l)
	noErr(t, l.CreateOrg(c, "acme"))
	_, _, err := l.Credit(c, "acme", 10, "stripe:pi_1")
	noErr(t, err)
	_, _, err = l.Adjust(c, "acme", -5, "stripe:pi_2")
	noErr(t, err)
	if org := must(p.CreditOrg(c, "stripe:pi_1")); org != "acme" {
		t.Fatalf("CreditOrg = %q", org)
	}
	_, err = p.CreditOrg(c, "stripe:pi_2")
	wantErr(t, err, topup.ErrUnknownReference, "CreditOrg of an adjustment's reference")
	_, err = p.CreditOrg(c, "stripe:pi_3")
	wantErr(t, err, topup.ErrUnknownReference, "CreditOrg of an unknown reference")
}
