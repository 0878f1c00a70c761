package webhook_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/webhook"
)

// TestCheckURL: the address policy refuses URLs with credentials always, and non-public hosts
// unless private addresses are allowed.
func TestCheckURL(t *testing.T) {
	t.Parallel()
	refused := []string{
		"http://127.0.0.1:8080/h", "http://127.9.9.9/", "http://[::1]:9/h", "http://0.0.0.0/", "http://[::]/",
		"http://169.254.169.254/latest/meta-data/", "http://[fe80::1%25eth0]/", "http://localhost:6379",
		"http://LOCALHOST./x", "http://a.localhost/", "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.1.1/",
		"http://[fd00::1]/", "http://100.64.0.1/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:10.0.0.1]/",
		"http://255.255.255.255/", "http://224.0.0.1/", "http://[64:ff9b::a00:1]/", "http://0/", "http://2130706433/",
	}
	for _, u := range refused {
		err := webhook.CheckURL(u, false)
		if u == "http://0/" || u == "http://2130706433/" {
			// Not IP literals to Go's resolver either; checked when dialed, if they resolve.
			continue
		}
		if !errors.Is(err, webhook.ErrAddressNotAllowed) {
			t.Errorf("CheckURL(%q) = %v, want a refusal", u, err)
		}
		if err := webhook.CheckURL(u, true); err != nil {
			t.Errorf("CheckURL(%q, allow private) = %v", u, err)
		}
	}
	for _, u := range []string{"https://user:pass@hooks.example.com/h", "https://token@hooks.example.com/h", "ftp://hooks.example.com/", "/relative", "https://"} {
		if err := webhook.CheckURL(u, true); !errors.Is(err, webhook.ErrAddressNotAllowed) {
			t.Errorf("CheckURL(%q, allow private) = %v, want a refusal", u, err)
		}
	}
	for _, u := range []string{"https://hooks.example.com/h?token=x", "http://93.184.215.14:8080/h", "https://[2606:4700::1111]/h"} {
		if err := webhook.CheckURL(u, false); err != nil {
			t.Errorf("CheckURL(%q) = %v", u, err)
		}
	}
}

// TestDeliveryRefusesPrivateAddresses (issue 22 item 4): endpoints that reached the ledger
// without the admin API's check (an IP literal on loopback, a name that resolves to it, a URL
// with credentials) are never sent to: the address is checked after resolution, when dialed,
// and the attempt fails with the reason. With AllowPrivate the same receiver gets its event.
func TestDeliveryRefusesPrivateAddresses(t *testing.T) {
	t.Parallel()
	ledgers(t, func(t *testing.T, l ledger.Ledger) {
		r := newReceiver(t, func(int) int { return http.StatusOK })
		port := r.URL[strings.LastIndex(r.URL, ":")+1:]
		h := l.(ledger.Webhooks)
		var ids []string
		for _, u := range []string{r.URL + "/ip", "http://localhost:" + port + "/name", "http://user:pass@127.0.0.1:" + port + "/creds"} {
			w, _, err := h.CreateWebhook(context.Background(), u, []ledger.EventType{ledger.EventCreditReceived})
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, w.ID)
		}
		if err := l.CreateOrg(context.Background(), "o"); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(context.Background(), "o", 5, "p"); err != nil {
			t.Fatal(err)
		}
		cfg := fastConfig()
		cfg.AllowPrivate, cfg.MaxAttempts = false, 1
		refusing := startSender(t, l, cfg)
		for _, id := range ids {
			waitFor(t, "the delivery to fail", func() bool {
				ds := deliveries(t, l, id)
				return len(ds) == 1 && ds[0].Status == ledger.DeliveryFailed
			})
			if d := deliveries(t, l, id)[0]; !strings.Contains(d.LastError, "not allowed") {
				t.Errorf("delivery %+v: want an address refusal as its last error", d)
			}
		}
		if got := r.requests(); len(got) != 0 {
			t.Fatalf("%d requests reached the private receiver", len(got))
		}

		// The same receiver, allowed (by another sender: this one stops first).
		if err := refusing.Stop(context.Background()); err != nil {
			t.Fatal(err)
		}
		w, _, err := h.CreateWebhook(context.Background(), "http://localhost:"+port+"/allowed", []ledger.EventType{ledger.EventCreditReceived})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(context.Background(), "o", 5, "p2"); err != nil {
			t.Fatal(err)
		}
		startSender(t, l, fastConfig())
		waitFor(t, "the allowed delivery", func() bool {
			ds := deliveries(t, l, w.ID)
			return len(ds) == 1 && ds[0].Status == ledger.DeliveryDelivered
		})
	})
}
