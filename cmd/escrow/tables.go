package main

import (
	"strconv"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/admin"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
	"github.com/llmescrow/escrow/pricing"
)

// The tables of the admin API's answers, each decoded into the API's own type (accounting's,
// or admin's where the answer is not an accounting type as it is). The column names are the
// JSON fields.

var orgTable = table[accounting.OrgView]{
	{"id", func(o accounting.OrgView) string { return o.ID }},
	{"name", func(o accounting.OrgView) string { return o.Name }},
	{"ledger_balance", func(o accounting.OrgView) string { return i64(o.Balance) }},
	{"available", func(o accounting.OrgView) string { return optI64(o.Available) }},
	{"held", func(o accounting.OrgView) string { return i64(o.Held) }},
	{"created_at", func(o accounting.OrgView) string { return ts(o.CreatedAt) }},
}

// thresholdTable is an org's low-balance threshold.
var thresholdTable = append(orgTable.only("id"),
	column[accounting.OrgView]{"low_balance_threshold", func(o accounting.OrgView) string { return optI64(o.LowBalanceThreshold) }})

var namedTable = table[admin.Named]{
	{"id", func(n admin.Named) string { return n.ID }},
	{"name", func(n admin.Named) string { return n.Name }},
}

var newKeyTable = table[admin.NewKey]{
	{"id", func(k admin.NewKey) string { return k.ID }},
	{"name", func(k admin.NewKey) string { return k.Name }},
	{"key", func(k admin.NewKey) string { return k.Key }},
}

var keyTable = table[ledger.KeyInfo]{
	{"id", func(k ledger.KeyInfo) string { return k.ID }},
	{"name", func(k ledger.KeyInfo) string { return k.Name }},
	{"project", func(k ledger.KeyInfo) string { return k.Project }},
	{"created_at", func(k ledger.KeyInfo) string { return ts(k.CreatedAt) }},
	{"last_used_at", func(k ledger.KeyInfo) string { return optTS(k.LastUsedAt) }},
	{"revoked_at", func(k ledger.KeyInfo) string { return optTS(k.RevokedAt) }},
}

// creditTable is a ledger entry as a credit's answer shows it.
var creditTable = table[ledger.LedgerEntry]{
	{"org", func(e ledger.LedgerEntry) string { return e.Org }},
	{"seq", func(e ledger.LedgerEntry) string { return i64(e.Seq) }},
	{"delta", func(e ledger.LedgerEntry) string { return i64(e.Delta) }},
	{"reference", func(e ledger.LedgerEntry) string { return e.Ref }},
	{"created_at", func(e ledger.LedgerEntry) string { return ts(e.CreatedAt) }},
}

// grantTable is a credit grant (docs/grants.md).
var grantTable = table[grant.Grant]{
	{"seq", func(g grant.Grant) string { return i64(g.Seq) }},
	{"reference", func(g grant.Grant) string { return g.Reference }},
	{"priority", func(g grant.Grant) string { return i64(int64(g.Priority)) }},
	{"amount", func(g grant.Grant) string { return i64(g.Amount) }},
	{"rest", func(g grant.Grant) string { return i64(g.Rest) }},
	{"expires_at", func(g grant.Grant) string {
		if g.ExpiresAt.IsZero() {
			return "never"
		}
		return ts(g.ExpiresAt)
	}},
	{"expired", func(g grant.Grant) string {
		if !g.Expired {
			return ""
		}
		return i64(g.ExpiredAmount)
	}},
}

// requestCell is a cell of an entry's request (a charge's), empty for an entry without one.
func requestCell(cell func(ledger.EntryRequest) string) func(ledger.EntryInfo) string {
	return func(e ledger.EntryInfo) string {
		if e.Request == nil {
			return ""
		}
		return cell(*e.Request)
	}
}

var entryTable = table[ledger.EntryInfo]{
	{"seq", func(e ledger.EntryInfo) string { return i64(e.Seq) }},
	{"kind", func(e ledger.EntryInfo) string { return string(e.Kind) }},
	{"delta", func(e ledger.EntryInfo) string { return i64(e.Delta) }},
	{"reference", func(e ledger.EntryInfo) string { return e.Ref }},
	{"request_id", requestCell(func(r ledger.EntryRequest) string { return r.ID })},
	{"model", requestCell(func(r ledger.EntryRequest) string { return r.Model })},
	{"end_user", requestCell(func(r ledger.EntryRequest) string { return r.EndUser })},
	{"cost", requestCell(func(r ledger.EntryRequest) string { return i64(r.Cost) })},
	{"hold_amount", requestCell(func(r ledger.EntryRequest) string { return i64(r.HoldAmount) })},
	{"created_at", func(e ledger.EntryInfo) string { return ts(e.CreatedAt) }},
}

// usageCounts are a usage row's columns after its group.
var usageCounts = table[ledger.UsageRow]{
	{"requests", func(r ledger.UsageRow) string { return i64(r.Requests) }},
	{"cost", func(r ledger.UsageRow) string { return i64(r.Cost) }},
	{"prompt_tokens", func(r ledger.UsageRow) string { return i64(r.Prompt) }},
	{"cached_tokens", func(r ledger.UsageRow) string { return i64(r.Cached) }},
	{"completion_tokens", func(r ledger.UsageRow) string { return i64(r.Completion) }},
}

// usageTable is a usage report grouped by by (day, model, key or end_user): the group, then the counts.
func usageTable(by string) table[ledger.UsageRow] {
	group := table[ledger.UsageRow]{{by, func(r ledger.UsageRow) string { return r.Group }}}
	return append(group, usageCounts...)
}

var topTable = append(table[admin.Spender]{{"org", func(s admin.Spender) string { return s.Org }}},
	via(usageCounts, func(s admin.Spender) ledger.UsageRow { return s.UsageRow })...)

var priceClassTable = table[admin.PriceClass]{
	{"class", func(p admin.PriceClass) string { return string(p.Name) }},
	{"unit", func(p admin.PriceClass) string { return string(p.Unit) }},
	{"side", func(p admin.PriceClass) string { return p.Side }},
	{"bounds_input", func(p admin.PriceClass) string { return strconv.FormatBool(p.BoundsInput) }},
	{"default", func(p admin.PriceClass) string { return p.Default }},
	{"doc", func(p admin.PriceClass) string { return p.Doc }},
}

// modelTable is the columns of models: the name, one column "<class>_price" per price class
// any of them prices, in the registry's order (a new class needs no column here), the limits.
func modelTable(ms []ledger.Model) table[ledger.Model] {
	t := append(table[ledger.Model]{{"model", func(m ledger.Model) string { return m.Name }}}, priceColumns(ms...)...)
	return append(t, table[ledger.Model]{
		{"max_input_tokens", func(m ledger.Model) string { return i64(m.MaxInputTokens) }},
		{"max_output_tokens", func(m ledger.Model) string { return i64(m.MaxOutputTokens) }},
		{"max_cost", func(m ledger.Model) string { return i64(m.MaxCost) }},
		{"default_hold", func(m ledger.Model) string { return i64(m.DefaultHold) }},
	}...)
}

// priceColumns are a column per class the models price, in the registry's order.
func priceColumns(ms ...ledger.Model) table[ledger.Model] {
	all := pricing.Prices{}
	for _, m := range ms {
		for c := range m.Prices {
			all[c] = 0
		}
	}
	var t table[ledger.Model]
	for _, c := range all.Sorted() {
		t = append(t, column[ledger.Model]{string(c) + ledger.PriceSuffix, func(m ledger.Model) string {
			if v, ok := m.Prices[c]; ok {
				return i64(v)
			}
			return ""
		}})
	}
	return t
}

var requestTable = table[ledger.RequestInfo]{
	{"id", func(r ledger.RequestInfo) string { return r.ID }},
	{"org", func(r ledger.RequestInfo) string { return r.Org }},
	{"key_id", func(r ledger.RequestInfo) string { return r.KeyID }},
	{"model", func(r ledger.RequestInfo) string { return r.Model }},
	{"status", func(r ledger.RequestInfo) string { return r.Status }},
	{"cost", func(r ledger.RequestInfo) string { return i64(r.Cost) }},
	{"hold_amount", func(r ledger.RequestInfo) string { return i64(r.HoldAmount) }},
	{"estimated", func(r ledger.RequestInfo) string { return strconv.FormatBool(r.Estimated) }},
	{"usage", func(r ledger.RequestInfo) string { return jsonCell(r.Usage) }},
	{"created_at", func(r ledger.RequestInfo) string { return ts(r.CreatedAt) }},
}

var auditTable = table[ledger.AuditRecord]{
	{"id", func(r ledger.AuditRecord) string { return i64(r.ID) }},
	{"at", func(r ledger.AuditRecord) string { return ts(r.At) }},
	{"actor", func(r ledger.AuditRecord) string { return r.Actor }},
	{"action", func(r ledger.AuditRecord) string { return r.Action }},
	{"target", func(r ledger.AuditRecord) string { return r.Target }},
	{"status", func(r ledger.AuditRecord) string { return strconv.Itoa(r.Status) }},
}

var driftTable = table[accounting.Drift]{
	{"org", func(d accounting.Drift) string { return d.Org }},
	{"warm", func(d accounting.Drift) string { return strconv.FormatBool(d.Warm) }},
	{"hot", func(d accounting.Drift) string { return i64(d.Hot) }},
	{"expected", func(d accounting.Drift) string { return i64(d.Expected) }},
	{"drift", func(d accounting.Drift) string { return i64(d.Drift) }},
	{"repaired", func(d accounting.Drift) string { return strconv.FormatBool(d.Repaired) }},
	{"caught_up", func(d accounting.Drift) string { return strconv.FormatBool(d.CaughtUp) }},
}

var epochTable = table[admin.Epoch]{
	{"generation", func(e admin.Epoch) string { return i64(e.Generation) }},
	{"id", func(e admin.Epoch) string { return e.ID }},
}

var webhookTable = table[ledger.Webhook]{
	{"id", func(w ledger.Webhook) string { return w.ID }},
	{"url", func(w ledger.Webhook) string { return w.URL }},
	{"events", func(w ledger.Webhook) string { return jsonCell(w.Events) }},
	{"created_at", func(w ledger.Webhook) string { return ts(w.CreatedAt) }},
}

var newWebhookTable = append(via(webhookTable, func(w admin.NewWebhook) ledger.Webhook { return w.Webhook }),
	column[admin.NewWebhook]{"secret", func(w admin.NewWebhook) string { return w.Secret }})

var deliveryTable = table[ledger.Delivery]{
	{"id", func(d ledger.Delivery) string { return i64(d.ID) }},
	{"event_type", func(d ledger.Delivery) string { return string(d.EventType) }},
	{"org", func(d ledger.Delivery) string { return d.Org }},
	{"status", func(d ledger.Delivery) string { return string(d.Status) }},
	{"attempts", func(d ledger.Delivery) string { return strconv.Itoa(d.Attempts) }},
	{"last_status", func(d ledger.Delivery) string { return strconv.Itoa(d.LastStatus) }},
	{"last_error", func(d ledger.Delivery) string { return d.LastError }},
	{"next_attempt_at", func(d ledger.Delivery) string { return optTS(d.NextAttemptAt) }},
	{"created_at", func(d ledger.Delivery) string { return ts(d.CreatedAt) }},
}

// limitTable is a limit as it is created or changed; limitViewTable adds its window's state.
var limitTable = table[admin.Limit]{
	{"id", func(l admin.Limit) string { return l.ID }},
	{"scope", func(l admin.Limit) string { return l.Scope }},
	{"scope_id", func(l admin.Limit) string { return l.ScopeID }},
	{"window", func(l admin.Limit) string { return l.Window }},
	{"unit", func(l admin.Limit) string { return balance.Unit(l.Unit).String() }},
	{"cap", func(l admin.Limit) string { return i64(l.Cap) }},
}

var limitViewTable = append(via(limitTable, func(l accounting.LimitView) admin.Limit {
	return admin.Limit{ID: l.ID, Scope: string(l.Scope), ScopeID: l.ScopeID, Window: string(l.Window), Unit: l.Unit, Cap: l.Cap}
}), table[accounting.LimitView]{
	{"used", func(l accounting.LimitView) string { return i64(l.Used) }},
	{"held", func(l accounting.LimitView) string { return i64(l.Held) }},
	{"resets_at", func(l accounting.LimitView) string { return optTS(l.ResetsAt) }},
	{"end_users", func(l accounting.LimitView) string { // a limit of each end user apart only
		if l.EndUsers == nil {
			return ""
		}
		return strconv.Itoa(*l.EndUsers)
	}},
}...)

// endUserTable is an end user of a limit of each end user apart, with its current window.
var endUserTable = table[accounting.EndUserUsed]{
	{"end_user", func(u accounting.EndUserUsed) string { return u.EndUser }},
	{"used", func(u accounting.EndUserUsed) string { return i64(u.Used) }},
	{"held", func(u accounting.EndUserUsed) string { return i64(u.Held) }},
}
