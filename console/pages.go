package console

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
)

// The pages. Each reads through accounting.Ops or the ledger roles it hands out (Ops.Ledger),
// the calls the admin API's reads and the customer views make; none reads Redis or the ledger
// any other way.

// pageSize is the rows of a paged list.
const pageSize = 50

type orgsData struct {
	Orgs []accounting.OrgView
	Next string
}

func (c *Console) orgsPage(ec echo.Context) error {
	p, err := c.ops.ListOrgs(ec.Request().Context(), ledger.ListQuery{Cursor: ec.QueryParam("after"), Limit: pageSize})
	if err != nil {
		return c.failPage(ec, err)
	}
	return c.render(ec, http.StatusOK, "orgs", sessionOf(ec), "Orgs", orgsData{Orgs: p.Data, Next: p.Next})
}

// usage is an org's usage charts over the last ChartDays days.
type usage struct {
	From    time.Time
	ByDay   Chart
	ByModel Chart
	Total   int64
}

// readUsage reads the org's usage by day and by model since the start of the UTC day
// ChartDays−1 days ago (two UsageReport calls over that range, the admin API's usage route).
func (c *Console) readUsage(ctx context.Context, org string) (usage, error) {
	now := c.now().UTC()
	today := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC)
	from := today.AddDate(0, 0, -(ChartDays - 1))
	byDay, err := c.ops.Ledger().UsageReport(ctx, org, ledger.UsageQuery{From: from, GroupBy: ledger.GroupByDay})
	if err != nil {
		return usage{}, err
	}
	byModel, err := c.ops.Ledger().UsageReport(ctx, org, ledger.UsageQuery{From: from, GroupBy: ledger.GroupByModel})
	if err != nil {
		return usage{}, err
	}
	u := usage{From: from, ByDay: dayChart(byDay, today), ByModel: modelChart(byModel)}
	for _, r := range byDay {
		u.Total += r.Cost
	}
	return u, nil
}

type orgData struct {
	Org       accounting.OrgView
	Balance   accounting.Balance
	Hot       bool // Balance read from Redis; false: the hot balance did not answer
	Frozen    bool
	Usage     usage
	Entries   []ledger.EntryInfo
	NextEntry string
	Keys      []ledger.KeyInfo
	Limits    []accounting.LimitView
	CreditRef string // the credit form's reference (one per rendering: a resubmitted form credits once)
}

func (c *Console) orgPage(ec echo.Context) error {
	ctx := ec.Request().Context()
	org := ec.Param("org")
	if err := balance.ValidateOrg(org); err != nil {
		return c.failPage(ec, err)
	}
	d := orgData{CreditRef: "console-" + randomToken()[:24]}
	var err error
	if d.Org, err = c.ops.Org(ctx, org); err != nil && !errors.Is(err, accounting.ErrHotBalance) {
		return c.failPage(ec, err)
	}
	d.Balance, err = c.ops.Balance(ctx, org)
	switch {
	case err == nil:
		d.Hot = true
	case errors.Is(err, accounting.ErrHotBalance):
		d.Balance = accounting.Balance{Org: org, LedgerBalance: d.Org.Balance}
	default:
		return c.failPage(ec, err)
	}
	ls, err := c.ops.Ledger().Limits(ctx, org)
	if err != nil {
		return c.failPage(ec, err)
	}
	d.Frozen = slices.ContainsFunc(ls.Frozen, func(s balance.Scope) bool { return s.Kind == balance.ScopeOrg })
	if d.Usage, err = c.readUsage(ctx, org); err != nil {
		return c.failPage(ec, err)
	}
	ents, err := c.ops.Ledger().ListEntries(ctx, org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Cursor: ec.QueryParam("entries"), Limit: pageSize}})
	if err != nil {
		return c.failPage(ec, err)
	}
	d.Entries, d.NextEntry = ents.Data, ents.Next
	keys, err := c.ops.Ledger().ListKeys(ctx, org, ledger.ListQuery{Limit: ledger.MaxPageSize})
	if err != nil {
		return c.failPage(ec, err)
	}
	d.Keys = keys.Data
	if d.Limits, err = c.ops.ListLimits(ctx, org); err != nil {
		return c.failPage(ec, err)
	}
	return c.render(ec, http.StatusOK, "org", sessionOf(ec), "Org "+org, d)
}

func (c *Console) modelsPage(ec echo.Context) error {
	ms, err := c.ops.Models(ec.Request().Context())
	if err != nil {
		return c.failPage(ec, err)
	}
	return c.render(ec, http.StatusOK, "models", sessionOf(ec), "Models and prices", modelsTable(ms))
}

// modelsData is the models page: a column per price class that some model prices (registry
// order, defaults applied), so a new class needs no template change.
type modelsData struct {
	Classes []pricing.Class
	Rows    []modelRow
}

type modelRow struct {
	ledger.Model
	Cells []priceCell
}

// priceCell is one model's price of one class; Set is false when the model cannot bill it.
type priceCell struct {
	Class  pricing.Class
	Micros int64
	Set    bool
}

func modelsTable(ms []ledger.Model) modelsData {
	var d modelsData
	seen := map[pricing.Class]bool{}
	all := pricing.Prices{}
	for i := range ms {
		ms[i] = ms[i].Effective()
		for c, v := range ms[i].Prices {
			if !seen[c] {
				seen[c], all[c] = true, v
			}
		}
	}
	d.Classes = all.Sorted()
	for _, m := range ms {
		r := modelRow{Model: m}
		for _, c := range d.Classes {
			v, ok := m.Prices[c]
			r.Cells = append(r.Cells, priceCell{Class: c, Micros: v, Set: ok})
		}
		d.Rows = append(d.Rows, r)
	}
	return d
}

type auditData struct {
	Records []ledger.AuditRecord
	Next    string
}

func (c *Console) auditPage(ec echo.Context) error {
	p, err := c.ops.Ledger().AuditLog(ec.Request().Context(), ledger.ListQuery{Cursor: ec.QueryParam("after"), Limit: pageSize})
	if err != nil {
		return c.failPage(ec, err)
	}
	return c.render(ec, http.StatusOK, "audit", sessionOf(ec), "Audit log", auditData{Records: p.Data, Next: p.Next})
}

type webhooksData struct {
	Supported bool
	Hooks     []ledger.Webhook
}

func (c *Console) webhooksPage(ec echo.Context) error {
	var d webhooksData
	if h, ok := c.ops.Ledger().(ledger.Webhooks); ok {
		var err error
		if d.Hooks, err = h.ListWebhooks(ec.Request().Context()); err != nil && !errors.Is(err, ledger.ErrNoWebhooks) {
			return c.failPage(ec, err)
		}
		d.Supported = err == nil
	}
	return c.render(ec, http.StatusOK, "webhooks", sessionOf(ec), "Webhooks", d)
}

type meData struct {
	View     accounting.CustomerView
	Usage    usage
	Requests []ledger.EntryInfo
	Next     string
}

// mePage is the customer's own page: the numbers of the customer views (accounting.CustomerView,
// what /api/v1/credits and /api/v1/key answer), the usage charts and the org's requests. The org
// is the session's, never a parameter.
func (c *Console) mePage(ec echo.Context) error {
	ctx := ec.Request().Context()
	sess := sessionOf(ec)
	d := meData{}
	var err error
	d.View, err = c.ops.CustomerView(ctx, sess.org, sess.keyID)
	if errors.Is(err, ledger.ErrUnknownOrg) { // an identity whose org has no account yet, as the views answer it
		d.View, err = accounting.CustomerView{Org: sess.org, Key: accounting.KeyView{ID: sess.keyID}}, nil
	}
	if err != nil {
		return c.failPage(ec, err)
	}
	if d.Usage, err = c.readUsage(ctx, sess.org); err != nil && !errors.Is(err, ledger.ErrUnknownOrg) {
		return c.failPage(ec, err)
	}
	p, err := c.ops.Ledger().ListEntries(ctx, sess.org, ledger.EntryQuery{ListQuery: ledger.ListQuery{Cursor: ec.QueryParam("after"), Limit: pageSize},
		Kind: ledger.KindCharge})
	if err != nil && !errors.Is(err, ledger.ErrUnknownOrg) {
		return c.failPage(ec, err)
	}
	d.Requests, d.Next = p.Data, p.Next
	return c.render(ec, http.StatusOK, "me", sess, "Your account", d)
}

// Used is what the customer's credits lost: the charges and what requests in flight hold
// (credits − used = available, as /api/v1/credits answers total_usage).
func (d meData) Used() int64 { return max(d.View.Credited-d.View.Available, 0) }
