// Package payment turns a payment processor's signed webhooks into ledger entries, and runs
// each org's capped auto top-up (DESIGN.md "Money in"). Stripe is the first Processor.
//
// A verified event becomes at most one effect, each idempotent by its own ledger reference:
//
//   - a payment (Stripe: checkout.session.completed and async_payment_succeeded when paid,
//     payment_intent.succeeded) is a credit of the amount paid × the currency's configured rate,
//     referenced by the payment ("stripe:pi_…"), so a redelivered event, the same event
//     delivered 50 times at once, and the two events Stripe sends for one Checkout payment all
//     credit once;
//   - a refund (charge.refunded) is a debit (an adjust entry) of the amount this event refunded,
//     referenced by the charge and its refunded total; a refund of a credit already spent leaves
//     the org in debt, and the decision is flagged;
//   - a dispute (charge.dispute.created) freezes the org when Config.FreezeOnDispute is set;
//   - a failed payment of an auto top-up (payment_intent.payment_failed) ends the attempt and
//     stops the org's top-ups until its settings are updated.
//
// A refund may arrive before its payment: it is a debit of its own, applied as soon as its org
// is known, which the payment's credit later covers; each has its own reference, so neither is
// ever applied twice and the net is the same in any order. Every decision is recorded in the
// ledger's audit trail (actor "stripe").
package payment

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
)

// Sentinel errors.
var (
	// ErrSignature: the event's signature header is missing or malformed, or no configured
	// secret signed it (a forged event, or a secret not configured).
	ErrSignature = errors.New("payment: invalid signature")
	// ErrStale: the signature's timestamp is older than the tolerance (a replay of an old event).
	ErrStale = errors.New("payment: signature timestamp outside the tolerance")
	// ErrMalformed: a signed event whose payload cannot be read.
	ErrMalformed = errors.New("payment: malformed event")
	// ErrUnresolved: the event's org cannot be told yet (no org in its metadata, no credit of
	// its payment, no known customer), or its currency has no rate. The processor is answered
	// with an error so that it retries later, when an operator may have fixed the mapping.
	ErrUnresolved = errors.New("payment: org or currency not resolved")
	// ErrConfig: a constructor got an unusable config.
	ErrConfig = errors.New("payment: invalid config")
)

// Kind is what an event asks of the ledger.
type Kind string

// Event kinds.
const (
	KindPayment       Kind = "payment"        // credit Amount
	KindRefund        Kind = "refund"         // debit Amount
	KindDispute       Kind = "dispute"        // freeze (when configured)
	KindPaymentFailed Kind = "payment_failed" // end the top-up attempt TopUp
	KindIgnored       Kind = "ignored"        // nothing to do (an unknown type, a payment not yet paid)
)

// Event is a verified processor event, in the processor's neutral form.
type Event struct {
	ID   string // the processor's event id
	Type string // the processor's event type
	Kind Kind
	// Ref is the ledger reference of the event's effect (a payment's credit, a refund's debit);
	// PaymentRef is the reference of the payment it belongs to (its credit's Ref).
	Ref, PaymentRef string
	Org             string // the org named by the payment's metadata; "" when none
	Customer        string // the processor's customer; "" when none
	Currency        string // lower case
	Amount          int64  // in the currency's smallest unit
	TopUp           string // the auto top-up attempt the payment is for; "" when none
	Reason          string // why a payment failed, or why the event is ignored
}

// Processor verifies and reads one processor's webhooks.
type Processor interface {
	// Name is the processor's name: the audit trail's actor, the references' prefix.
	Name() string
	// Verify checks payload's signature (from its request headers header) and reads the event
	// (ErrSignature, ErrStale, ErrMalformed).
	Verify(payload []byte, header func(string) string) (Event, error)
}

// Config configures Payments. The zero value of a field is its documented default.
type Config struct {
	// Rates is, per currency (ISO code, lower case), how many micro-units one smallest unit of
	// it credits (a cent of USD is 10,000 micro-units of a deployment that counts in USD). A
	// payment in a currency without a rate credits nothing (ErrUnresolved). Required.
	Rates map[string]int64
	// FreezeOnDispute freezes an org when a dispute of one of its payments is opened (it is
	// unfrozen by the admin API). Default false: a dispute is recorded and nothing else.
	FreezeOnDispute bool
	// Customers maps processor customers to orgs, for payments whose metadata names no org
	// (consulted after the metadata and after the auto top-up settings' customers). Default none.
	Customers map[string]string
	// Now is the clock of auto top-up attempts finished by a webhook. Default time.Now.
	Now func() time.Time
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Payments applies verified events to the ledger through accounting's operations.
type Payments struct {
	ops  *accounting.Ops
	cfg  Config
	log  *slog.Logger
	pays topup.Store // nil when the ledger has no payments role

	counts sync.Map // Outcome → *atomic.Int64: the webhook decisions, for metrics
}

// Outcomes lists every Outcome (the metrics' label values).
var Outcomes = []Outcome{Credited, Debited, Duplicate, Frozen, Noted, TopUpFailed, Ignored, Conflict, Unresolved, Rejected, Failed}

// Decisions is how many webhook decisions of outcome o this process made (Handler's).
func (p *Payments) Decisions(o Outcome) int64 {
	if c, ok := p.counts.Load(o); ok {
		return c.(*atomic.Int64).Load()
	}
	return 0
}

func (p *Payments) count(o Outcome) {
	c, _ := p.counts.LoadOrStore(o, new(atomic.Int64))
	c.(*atomic.Int64).Add(1)
}

// New returns Payments over ops.
func New(ops *accounting.Ops, cfg *Config) (*Payments, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if ops == nil {
		return nil, fmt.Errorf("%w: nil ops", ErrConfig)
	}
	rates := make(map[string]int64, len(c.Rates))
	for cur, r := range c.Rates {
		if r <= 0 || r > balance.MaxAmount {
			return nil, fmt.Errorf("%w: rate of %q must be in (0, %d]", ErrConfig, cur, balance.MaxAmount)
		}
		rates[strings.ToLower(cur)] = r
	}
	c.Rates, c.Customers = rates, maps.Clone(c.Customers)
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	pays, _ := ops.Payments()
	return &Payments{ops: ops, cfg: c, log: c.Logger.With("component", "escrow.payment"), pays: pays}, nil
}

// Outcome names a decision.
type Outcome string

// Outcomes.
const (
	Credited    Outcome = "credited"     // a new credit entry
	Debited     Outcome = "debited"      // a new debit (refund) entry
	Duplicate   Outcome = "duplicate"    // the effect was applied before (a redelivery): nothing new
	Frozen      Outcome = "frozen"       // the org was frozen (a dispute)
	Noted       Outcome = "noted"        // recorded only (a dispute without FreezeOnDispute)
	TopUpFailed Outcome = "topup_failed" // an auto top-up attempt failed: the org's top-ups stop
	Ignored     Outcome = "ignored"      // an event type or state that moves no money
	Conflict    Outcome = "conflict"     // the reference is used with another org or amount: nothing moved
	Unresolved  Outcome = "unresolved"   // org or currency unknown: answered so that it is retried
	Rejected    Outcome = "rejected"     // signature, staleness or payload refused
	Failed      Outcome = "failed"       // the ledger failed: answered so that it is retried
)

// Decision is what was done with one event.
type Decision struct {
	Event   string  `json:"event,omitempty"`
	Type    string  `json:"type,omitempty"`
	Outcome Outcome `json:"outcome"`
	Org     string  `json:"org,omitempty"`
	Amount  int64   `json:"amount,omitempty"` // micro-units credited (> 0) or debited (< 0)
	Seq     int64   `json:"seq,omitempty"`    // the entry's sequence number
	Ref     string  `json:"reference,omitempty"`
	// Debt flags a refund that left the org's ledger balance below zero (the credit was spent).
	Debt    bool   `json:"debt,omitempty"`
	Balance *int64 `json:"balance,omitempty"` // the ledger balance after a debit
	Detail  string `json:"detail,omitempty"`
}

// Apply applies one verified event. A returned error wraps ErrUnresolved (retry later, after
// a fix) or is the ledger's (retry later); the Decision says what was done either way.
func (p *Payments) Apply(ctx context.Context, ev Event) (Decision, error) {
	d := Decision{Event: ev.ID, Type: ev.Type, Outcome: Ignored, Detail: ev.Reason}
	switch {
	case ev.Kind == KindIgnored:
		return d, nil
	case ev.Kind == KindPaymentFailed && (ev.TopUp == "" || p.pays == nil):
		d.Detail = "a failed payment that is no auto top-up"
		return d, nil
	}
	org, err := p.resolve(ctx, ev)
	if err != nil && ev.Kind == KindDispute && !p.cfg.FreezeOnDispute && errors.Is(err, ErrUnresolved) {
		d.Outcome, d.Detail = Noted, "dispute of a payment of no known org; FreezeOnDispute is off"
		return d, nil
	}
	if err != nil {
		d.Outcome, d.Detail = Unresolved, err.Error()
		if !errors.Is(err, ErrUnresolved) {
			d.Outcome = Failed
		}
		return d, err
	}
	d.Org = org
	switch ev.Kind {
	case KindPayment:
		return p.credit(ctx, ev, d)
	case KindRefund:
		return p.refund(ctx, ev, d)
	case KindDispute:
		if !p.cfg.FreezeOnDispute {
			d.Outcome, d.Detail = Noted, "dispute recorded; FreezeOnDispute is off"
			return d, nil
		}
		if err := p.ops.Freeze(ctx, org, balance.Scope{Kind: balance.ScopeOrg}); err != nil && !errors.Is(err, accounting.ErrHotBalance) {
			d.Outcome, d.Detail = Failed, err.Error()
			return d, err
		}
		d.Outcome, d.Detail = Frozen, "org frozen: dispute of "+ev.PaymentRef
		return d, nil
	case KindPaymentFailed:
		a, err := p.pays.FinishTopUp(ctx, ev.TopUp, false, ev.Reason, p.cfg.Now())
		if err != nil {
			if errors.Is(err, topup.ErrUnknownAttempt) {
				d.Outcome, d.Detail = Ignored, err.Error()
				return d, nil
			}
			d.Outcome, d.Detail = Failed, err.Error()
			return d, err
		}
		d.Outcome, d.Detail = TopUpFailed, fmt.Sprintf("top-up %s %s: %s; top-ups stopped until the settings are updated", a.ID, a.Status, ev.Reason)
		return d, nil
	}
	return d, nil
}

// micro converts an amount in the event's currency to micro-units.
func (p *Payments) micro(ev Event) (int64, error) {
	rate, ok := p.cfg.Rates[ev.Currency]
	if !ok {
		return 0, fmt.Errorf("%w: no rate for currency %q", ErrUnresolved, ev.Currency)
	}
	if ev.Amount <= 0 || ev.Amount > balance.MaxAmount/rate {
		return 0, fmt.Errorf("%w: amount %d %s × rate %d", ledger.ErrInvalidAmount, ev.Amount, ev.Currency, rate)
	}
	return ev.Amount * rate, nil
}

func (p *Payments) credit(ctx context.Context, ev Event, d Decision) (Decision, error) {
	amt, err := p.micro(ev)
	if err != nil {
		return p.refused(d, err)
	}
	d.Ref = ev.Ref
	e, created, err := p.ops.Credit(ctx, d.Org, amt, ev.Ref)
	switch {
	case errors.Is(err, ledger.ErrReferenceConflict):
		d.Outcome, d.Detail = Conflict, fmt.Sprintf("reference %s is used with another org or amount", ev.Ref)
		return d, nil
	case err != nil && e.Seq == 0:
		return p.refused(d, err)
	}
	// ErrHotBalance: the entry is durable; the worker brings the hot balance up to it.
	d.Amount, d.Seq, d.Outcome = amt, e.Seq, Credited
	if !created {
		d.Outcome = Duplicate
	}
	if ev.TopUp != "" && p.pays != nil {
		if _, err := p.pays.FinishTopUp(ctx, ev.TopUp, true, "", p.cfg.Now()); err != nil && !errors.Is(err, topup.ErrUnknownAttempt) {
			d.Detail = "credited; top-up attempt not marked: " + err.Error()
			return d, err // retried: the credit is idempotent, the attempt is finished next time
		}
		d.Detail = "auto top-up " + ev.TopUp
	}
	return d, nil
}

func (p *Payments) refund(ctx context.Context, ev Event, d Decision) (Decision, error) {
	amt, err := p.micro(ev)
	if err != nil {
		return p.refused(d, err)
	}
	d.Ref = ev.Ref
	e, created, err := p.ops.Adjust(ctx, d.Org, -amt, ev.Ref)
	switch {
	case errors.Is(err, ledger.ErrReferenceConflict):
		d.Outcome, d.Detail = Conflict, fmt.Sprintf("reference %s is used with another org or amount", ev.Ref)
		return d, nil
	case err != nil && e.Seq == 0:
		return p.refused(d, err)
	}
	d.Amount, d.Seq, d.Outcome = -amt, e.Seq, Debited
	if !created {
		d.Outcome = Duplicate
	}
	if acct, err := p.ops.Ledger().Account(ctx, d.Org); err == nil {
		b := acct.Balance
		d.Balance = &b
		if b < 0 {
			d.Debt = true
			d.Detail = fmt.Sprintf("refund of %s leaves the org in debt (%d micro-units): the credit was spent", ev.PaymentRef, b)
			p.log.Warn("refund left an org in debt", "org", d.Org, "balance", b, "reference", ev.Ref, "event", ev.ID)
		}
	}
	return d, nil
}

// refused turns an error into a decision: unknown currency or org → Unresolved; an invalid
// amount → Rejected (no retry helps); the ledger's trouble → Failed.
func (p *Payments) refused(d Decision, err error) (Decision, error) {
	d.Detail = err.Error()
	switch {
	case errors.Is(err, ErrUnresolved):
		d.Outcome = Unresolved
		return d, err
	case errors.Is(err, ledger.ErrUnknownOrg):
		d.Outcome = Unresolved
		return d, fmt.Errorf("%w: %w", ErrUnresolved, err)
	case errors.Is(err, ledger.ErrInvalidAmount):
		d.Outcome = Rejected
		return d, nil
	}
	d.Outcome = Failed
	return d, err
}

// resolve finds the event's org: for a refund or a dispute the org its payment was credited to
// first; then the metadata's org; then the auto top-up settings' customers; then
// Config.Customers.
func (p *Payments) resolve(ctx context.Context, ev Event) (string, error) {
	if p.pays != nil && ev.Kind != KindPayment && ev.PaymentRef != "" {
		org, err := p.pays.CreditOrg(ctx, ev.PaymentRef)
		if err == nil {
			return org, nil
		}
		if !errors.Is(err, topup.ErrUnknownReference) {
			return "", err
		}
	}
	if ev.Org != "" {
		if err := balance.ValidateOrg(ev.Org); err != nil {
			return "", fmt.Errorf("%w: %w", ErrUnresolved, err)
		}
		return ev.Org, nil
	}
	if ev.Customer != "" {
		if p.pays != nil {
			org, err := p.pays.OrgOfCustomer(ctx, ev.Customer)
			if err == nil {
				return org, nil
			}
			if !errors.Is(err, topup.ErrNoSettings) {
				return "", err
			}
		}
		if org, ok := p.cfg.Customers[ev.Customer]; ok {
			return org, nil
		}
	}
	return "", fmt.Errorf("%w: event %s names no org (metadata escrow_org), its payment %s was not credited, and customer %q is not mapped",
		ErrUnresolved, ev.ID, ev.PaymentRef, ev.Customer)
}
