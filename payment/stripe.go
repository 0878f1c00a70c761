package payment

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82/webhook"
)

// The metadata keys escrow reads on Stripe objects (a Checkout Session, a PaymentIntent, a
// Charge): the org to credit, and the auto top-up attempt a PaymentIntent pays for.
const (
	MetadataOrg   = "escrow_org"
	MetadataTopUp = "escrow_topup"
)

// StripeConfig configures the Stripe processor.
type StripeConfig struct {
	// Secrets are the webhook endpoint's signing secrets (whsec_…): an event signed by any of
	// them is accepted, so a secret can be rolled (Stripe signs with both for a while) without
	// refusing events. At least one is required.
	Secrets []string
	// Tolerance is how old a signature's timestamp may be. Default webhook.DefaultTolerance
	// (5 minutes), Stripe's own.
	Tolerance time.Duration
}

// Stripe verifies Stripe's webhooks with stripe-go's webhook package.
type Stripe struct {
	secrets   []string
	tolerance time.Duration
}

// NewStripe returns the Stripe processor.
func NewStripe(cfg StripeConfig) (*Stripe, error) {
	var secrets []string
	for _, s := range cfg.Secrets {
		if s = strings.TrimSpace(s); s != "" {
			secrets = append(secrets, s)
		}
	}
	if len(secrets) == 0 {
		return nil, fmt.Errorf("%w: at least one Stripe webhook secret is required", ErrConfig)
	}
	if cfg.Tolerance < 0 {
		return nil, fmt.Errorf("%w: negative tolerance", ErrConfig)
	}
	if cfg.Tolerance == 0 {
		cfg.Tolerance = webhook.DefaultTolerance
	}
	return &Stripe{secrets: secrets, tolerance: cfg.Tolerance}, nil
}

// Name is "stripe".
func (s *Stripe) Name() string { return "stripe" }

// SignatureHeader is the header Stripe signs its webhooks in.
const SignatureHeader = "Stripe-Signature"

// Verify checks the Stripe-Signature header against every secret (stripe-go's
// ValidatePayloadWithTolerance) and reads the event.
func (s *Stripe) Verify(payload []byte, header func(string) string) (Event, error) {
	sig := header(SignatureHeader)
	var err error
	for _, secret := range s.secrets {
		if err = webhook.ValidatePayloadWithTolerance(payload, sig, secret, s.tolerance); err == nil {
			break
		}
		if errors.Is(err, webhook.ErrTooOld) {
			return Event{}, fmt.Errorf("%w: %w", ErrStale, err)
		}
	}
	if err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrSignature, err)
	}
	return parseStripe(payload)
}

// stripeEvent is the part of a Stripe event escrow reads. It is read with escrow's own types,
// not stripe-go's Event: those few fields are stable across API versions, so an endpoint on any
// version works (stripe-go's ConstructEvent refuses other versions than its own).
type stripeEvent struct {
	ID   string `json:"id"`
	Type string `json:"type"`
	Data struct {
		Object   stripeObject `json:"object"`
		Previous struct {
			AmountRefunded *int64 `json:"amount_refunded"`
		} `json:"previous_attributes"`
	} `json:"data"`
}

type stripeObject struct {
	ID                string            `json:"id"`
	Object            string            `json:"object"`
	Amount            int64             `json:"amount"`
	AmountReceived    int64             `json:"amount_received"`
	AmountTotal       int64             `json:"amount_total"`
	AmountRefunded    int64             `json:"amount_refunded"`
	Currency          string            `json:"currency"`
	Customer          json.RawMessage   `json:"customer"`
	PaymentIntent     json.RawMessage   `json:"payment_intent"`
	Charge            json.RawMessage   `json:"charge"`
	Metadata          map[string]string `json:"metadata"`
	ClientReferenceID string            `json:"client_reference_id"`
	PaymentStatus     string            `json:"payment_status"`
	LastPaymentError  *struct {
		Code        string `json:"code"`
		DeclineCode string `json:"decline_code"`
		Message     string `json:"message"`
	} `json:"last_payment_error"`
}

// idOf reads an expandable field: an id, or an object with one; "" for null or absent.
func idOf(raw json.RawMessage) string {
	var id string
	if json.Unmarshal(raw, &id) == nil {
		return id
	}
	var obj struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(raw, &obj) == nil {
		return obj.ID
	}
	return ""
}

func parseStripe(payload []byte) (Event, error) {
	var se stripeEvent
	if err := json.Unmarshal(payload, &se); err != nil {
		return Event{}, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if se.ID == "" || se.Type == "" {
		return Event{}, fmt.Errorf("%w: no event id or type", ErrMalformed)
	}
	o := se.Data.Object
	ev := Event{ID: se.ID, Type: se.Type, Kind: KindIgnored, Currency: strings.ToLower(o.Currency),
		Customer: idOf(o.Customer), Org: o.Metadata[MetadataOrg], TopUp: o.Metadata[MetadataTopUp]}
	ref := func(id string) string { return "stripe:" + id }
	switch se.Type {
	case "checkout.session.completed", "checkout.session.async_payment_succeeded":
		if o.PaymentStatus != "paid" {
			ev.Reason = fmt.Sprintf("checkout session %s is %q, not paid: credited when paid (async_payment_succeeded)", o.ID, o.PaymentStatus)
			return ev, nil
		}
		// The PaymentIntent's own event (payment_intent.succeeded) has the same reference: one
		// credit for both.
		pay := idOf(o.PaymentIntent)
		if pay == "" {
			pay = o.ID
		}
		ev.Kind, ev.Amount, ev.Ref, ev.PaymentRef = KindPayment, o.AmountTotal, ref(pay), ref(pay)
		if ev.Org == "" {
			ev.Org = o.ClientReferenceID
		}
	case "payment_intent.succeeded":
		ev.Kind, ev.Amount, ev.Ref, ev.PaymentRef = KindPayment, o.AmountReceived, ref(o.ID), ref(o.ID)
	case "payment_intent.payment_failed":
		ev.Kind, ev.PaymentRef = KindPaymentFailed, ref(o.ID)
		ev.Reason = "payment failed"
		if e := o.LastPaymentError; e != nil {
			ev.Reason = strings.Trim(e.Code+" "+e.DeclineCode, " ")
		}
	case "charge.refunded":
		// amount_refunded is the charge's refunded total; previous_attributes has the total
		// before this refund. The reference names the total after it: each partial refund is
		// its own debit, and a redelivery is the same one.
		var before int64
		if p := se.Data.Previous.AmountRefunded; p != nil {
			before = *p
		}
		pay := idOf(o.PaymentIntent)
		if pay == "" {
			pay = o.ID
		}
		ev.PaymentRef = ref(pay)
		if o.AmountRefunded <= before {
			ev.Reason = fmt.Sprintf("charge %s: refunded total %d not above %d", o.ID, o.AmountRefunded, before)
			return ev, nil
		}
		ev.Kind, ev.Amount = KindRefund, o.AmountRefunded-before
		ev.Ref = "stripe:refund:" + o.ID + ":" + strconv.FormatInt(o.AmountRefunded, 10)
	case "charge.dispute.created":
		pay := idOf(o.PaymentIntent)
		if pay == "" {
			pay = idOf(o.Charge)
		}
		ev.Kind, ev.Amount, ev.PaymentRef, ev.Ref = KindDispute, o.Amount, ref(pay), "stripe:dispute:"+o.ID
	default:
		ev.Reason = "event type " + se.Type + " moves no money"
	}
	return ev, nil
}
