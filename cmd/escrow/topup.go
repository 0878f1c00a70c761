package main

import (
	"net/http"
	"net/url"
	"strconv"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/ledger/topup"
)

var topUpTable = table[topup.Settings]{
	{"org", func(s topup.Settings) string { return s.Org }},
	{"threshold", func(s topup.Settings) string { return i64(s.Threshold) }},
	{"amount", func(s topup.Settings) string { return i64(s.Amount) }},
	{"currency", func(s topup.Settings) string { return s.Currency }},
	{"customer", func(s topup.Settings) string { return s.Customer }},
	{"payment_method", func(s topup.Settings) string { return s.PaymentMethod }},
	{"daily_cap", func(s topup.Settings) string { return i64(s.DailyCap) }},
	{"monthly_cap", func(s topup.Settings) string { return i64(s.MonthlyCap) }},
	{"stopped", func(s topup.Settings) string { return s.Stopped }},
}

var attemptTable = table[topup.Attempt]{
	{"id", func(a topup.Attempt) string { return a.ID }},
	{"status", func(a topup.Attempt) string { return string(a.Status) }},
	{"amount", func(a topup.Attempt) string { return i64(a.Amount) }},
	{"currency", func(a topup.Attempt) string { return a.Currency }},
	{"payment", func(a topup.Attempt) string { return a.Payment }},
	{"reason", func(a topup.Attempt) string { return a.Reason }},
	{"created_at", func(a topup.Attempt) string { return ts(a.CreatedAt) }},
	{"finished_at", func(a topup.Attempt) string { return optTS(a.FinishedAt) }},
}

// cmdTopUp: escrow topup ORG | attempts ORG | set ORG --threshold … | delete ORG.
func cmdTopUp(args []string) error {
	fs, o := newFlags("topup")
	threshold := fs.String("threshold", "", "start a top-up when a charge leaves the ledger balance below this (micro-units) (set)")
	amount := fs.String("amount", "", "charged per top-up, in the currency's smallest unit, e.g. cents (set)")
	currency := fs.String("currency", "usd", "the currency charged (set)")
	customer := fs.String("customer", "", "the Stripe customer (cus_…) (set)")
	method := fs.String("payment-method", "", "the customer's payment method charged off-session (pm_…) (set)")
	daily := fs.String("daily-cap", "", "most charged per UTC day, smallest unit (set)")
	monthly := fs.String("monthly-cap", "", "most charged per UTC calendar month, smallest unit (set)")
	pos, c, err := begin(fs, args)
	if err != nil {
		return err
	}
	usage := usageErr("usage: escrow topup ORG | attempts ORG | set ORG --threshold MICRO --amount N --currency C --customer CUS --payment-method PM --daily-cap N --monthly-cap N | delete ORG  [--json|--csv]")
	switch {
	case len(pos) == 1:
		return show(c, o, http.MethodGet, "/orgs/"+url.PathEscape(pos[0])+"/topup", nil, via(topUpTable, func(t accounting.TopUp) topup.Settings { return t.Settings }))
	case len(pos) == 2 && pos[0] == "attempts":
		t, raw, err := fetch[accounting.TopUp](c, http.MethodGet, "/orgs/"+url.PathEscape(pos[1])+"/topup", nil)
		if err != nil {
			return err
		}
		return attemptTable.print(o, raw, t.Attempts)
	case len(pos) == 2 && pos[0] == "set":
		var nums [4]int64
		for i, s := range []*string{threshold, amount, daily, monthly} {
			if nums[i], err = strconv.ParseInt(*s, 10, 64); err != nil {
				return usage
			}
		}
		body := admin.TopUpRequest{Threshold: nums[0], Amount: nums[1], Currency: *currency, Customer: *customer,
			PaymentMethod: *method, DailyCap: nums[2], MonthlyCap: nums[3]}
		return show(c, o, http.MethodPut, "/orgs/"+url.PathEscape(pos[1])+"/topup", body, topUpTable)
	case len(pos) == 2 && pos[0] == "delete":
		return c.do(http.MethodDelete, "/orgs/"+url.PathEscape(pos[1])+"/topup", nil, "auto top-up of "+pos[1]+" deleted")
	default:
		return usage
	}
}
