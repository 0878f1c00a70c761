package payment

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stripe/stripe-go/v82"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/topup"
)

// TopUpConfig configures TopUps.
type TopUpConfig struct {
	// Stripe is the Stripe API client the PaymentIntents are created with
	// (stripe.NewClient(key), or with stripe.WithBackends for another URL). Required.
	Stripe *stripe.Client
	// Now is the clock of the caps' days and months. Default time.Now.
	Now func() time.Time
	// Refresh is how often the set of orgs with auto top-up is read again from the ledger (an
	// org set up by another process is topped up from then on). Default 30s.
	Refresh time.Duration
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

const defaultTopUpRefresh = 30 * time.Second

// checkTimeout bounds one org's check in Drain (the ledger's transaction and Stripe's call).
const checkTimeout = 30 * time.Second

// TopUps starts auto top-ups: told by the accounting worker which orgs a pass charged
// (accounting.WorkerConfig.Charged = TopUps.Charged), it starts one top-up for each whose
// ledger balance is now below its threshold, off the request path. The ledger decides
// (topup.Store.BeginTopUp): at most one attempt in flight per org, the caps, a stop after a
// decline. An attempt is a PaymentIntent created and confirmed off-session, its id the
// idempotency key; it is credited only by its payment_intent.succeeded webhook.
type TopUps struct {
	ops    *accounting.Ops
	pays   topup.Store
	client *stripe.Client
	now    func() time.Time
	every  time.Duration
	log    *slog.Logger

	stats struct{ started, failed, capped, errors atomic.Int64 }

	enabled atomic.Pointer[map[string]bool] // orgs with settings that may run; nil: not read yet
	mu      sync.Mutex
	dirty   map[string]struct{}
	wake    chan struct{}
	stop    context.CancelFunc
	done    chan struct{}
}

// NewTopUps returns the auto top-up runner over ops (whose ledger must have the payments role).
func NewTopUps(ops *accounting.Ops, cfg *TopUpConfig) (*TopUps, error) {
	var c TopUpConfig
	if cfg != nil {
		c = *cfg
	}
	if ops == nil || c.Stripe == nil {
		return nil, fmt.Errorf("%w: top-ups need ops and a Stripe client", ErrConfig)
	}
	pays, err := ops.Payments()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if c.Refresh < 0 {
		return nil, fmt.Errorf("%w: negative refresh", ErrConfig)
	}
	if c.Refresh == 0 {
		c.Refresh = defaultTopUpRefresh
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return &TopUps{ops: ops, pays: pays, client: c.Stripe, now: c.Now, every: c.Refresh,
		log: c.Logger.With("component", "escrow.topup"), dirty: map[string]struct{}{}, wake: make(chan struct{}, 1)}, nil
}

// Charged marks orgs whose balance a pass lowered; it never blocks. Orgs without auto top-up
// are dropped here (from the set read every Refresh), so the worker pays nothing for them.
func (t *TopUps) Charged(orgs []string) {
	en := t.enabled.Load()
	t.mu.Lock()
	n := 0
	for _, o := range orgs {
		if en == nil || (*en)[o] {
			t.dirty[o] = struct{}{}
			n++
		}
	}
	t.mu.Unlock()
	if n > 0 {
		select {
		case t.wake <- struct{}{}:
		default:
		}
	}
}

// Refresh reads the set of orgs with auto top-up again.
func (t *TopUps) Refresh(ctx context.Context) error {
	orgs, err := t.pays.TopUpOrgs(ctx)
	if err != nil {
		return err
	}
	m := make(map[string]bool, len(orgs))
	for _, o := range orgs {
		m[o] = true
	}
	t.enabled.Store(&m)
	return nil
}

// Start runs the loop that checks the marked orgs until Stop.
func (t *TopUps) Start(ctx context.Context) error {
	if t.stop != nil {
		return errors.New("payment: top-ups already started")
	}
	if err := t.Refresh(ctx); err != nil {
		t.log.Warn("auto top-up orgs not read; every charged org is checked until they are", "err", err)
	}
	run, cancel := context.WithCancel(context.WithoutCancel(ctx))
	t.stop, t.done = cancel, make(chan struct{})
	go func() {
		defer close(t.done)
		tick := time.NewTicker(t.every)
		defer tick.Stop()
		for {
			select {
			case <-run.Done():
				return
			case <-tick.C:
				if err := t.Refresh(run); err != nil {
					t.log.Warn("auto top-up orgs not read", "err", err)
				}
			case <-t.wake:
				_ = t.Drain(run)
			}
		}
	}()
	return nil
}

// Stop ends the loop (an attempt being made finishes first, within ctx).
func (t *TopUps) Stop(ctx context.Context) error {
	if t.stop == nil {
		return nil
	}
	t.stop()
	select {
	case <-t.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Drain checks every org marked so far, one after the other.
func (t *TopUps) Drain(ctx context.Context) error {
	t.mu.Lock()
	orgs := make([]string, 0, len(t.dirty))
	for o := range t.dirty {
		orgs = append(orgs, o)
	}
	clear(t.dirty)
	t.mu.Unlock()
	var errs []error
	for _, o := range orgs {
		cctx, cancel := context.WithTimeout(ctx, checkTimeout)
		_, err := t.Check(cctx, o)
		cancel()
		if err != nil && !Quiet(err) {
			t.log.Warn("auto top-up not started", "org", o, "err", err)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// TopUpStats are the runner's totals since it was made, for metrics.
type TopUpStats struct {
	Started int64 // PaymentIntents created (each credited only by its webhook)
	Failed  int64 // attempts declined (their orgs stopped)
	Capped  int64 // checks refused by a daily or monthly cap
	Errors  int64 // checks that failed (Stripe or the ledger did not answer)
}

// Stats returns the runner's totals.
func (t *TopUps) Stats() TopUpStats {
	return TopUpStats{Started: t.stats.started.Load(), Failed: t.stats.failed.Load(), Capped: t.stats.capped.Load(), Errors: t.stats.errors.Load()}
}

// Quiet: an answer of BeginTopUp that is the normal case (nothing to do), not a failure.
func Quiet(err error) bool {
	for _, s := range []error{topup.ErrNoSettings, topup.ErrNotNeeded, topup.ErrInFlight, topup.ErrStopped, topup.ErrCap} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// Check starts the org's top-up if the ledger says one is due, and returns the attempt. The
// ledger's reasons not to (Quiet errors) come back as they are. A declined charge ends the
// attempt as failed, which stops the org's top-ups; a processor that does not answer leaves it
// pending, and the next Check retries it with the same idempotency key.
func (t *TopUps) Check(ctx context.Context, org string) (topup.Attempt, error) {
	a, err := t.pays.BeginTopUp(ctx, org, t.now())
	if err != nil {
		if errors.Is(err, topup.ErrCap) {
			t.stats.capped.Add(1)
			t.audit(ctx, org, "topup.capped", err.Error())
		} else if !Quiet(err) {
			t.stats.errors.Add(1)
		}
		return a, err
	}
	s, err := t.pays.TopUp(ctx, org)
	if err != nil {
		return a, err
	}
	params := &stripe.PaymentIntentCreateParams{
		Amount:        stripe.Int64(a.Amount),
		Currency:      stripe.String(a.Currency),
		Customer:      stripe.String(s.Customer),
		PaymentMethod: stripe.String(s.PaymentMethod),
		Confirm:       stripe.Bool(true),
		OffSession:    stripe.Bool(true),
		Description:   stripe.String("escrow auto top-up of " + org),
	}
	params.AddMetadata(MetadataOrg, org)
	params.AddMetadata(MetadataTopUp, a.ID)
	params.SetIdempotencyKey(a.ID)
	pi, err := t.client.V1PaymentIntents.Create(ctx, params)
	var se *stripe.Error
	switch {
	case errors.As(err, &se) && se.Type == stripe.ErrorTypeCard:
		if se.PaymentIntent != nil && se.PaymentIntent.ID != "" {
			_ = t.pays.SetTopUpPayment(ctx, a.ID, se.PaymentIntent.ID)
		}
		reason := string(se.Code)
		if se.DeclineCode != "" {
			reason += " " + string(se.DeclineCode)
		}
		return t.fail(ctx, a, reason)
	case err != nil:
		t.stats.errors.Add(1)
		t.audit(ctx, org, "topup.retry", fmt.Sprintf("attempt %s: %v (retried with the same idempotency key)", a.ID, err))
		return a, fmt.Errorf("payment: top-up %s of %s: %w", a.ID, org, err)
	}
	if err := t.pays.SetTopUpPayment(ctx, a.ID, pi.ID); err != nil {
		return a, err
	}
	a.Payment = pi.ID
	switch pi.Status {
	case stripe.PaymentIntentStatusSucceeded, stripe.PaymentIntentStatusProcessing:
		t.stats.started.Add(1)
		t.audit(ctx, org, "topup.started", fmt.Sprintf("attempt %s: %d %s, payment %s %s; credited by its webhook", a.ID, a.Amount, a.Currency, pi.ID, pi.Status))
		return a, nil
	default: // requires_action (authentication), requires_payment_method: an off-session charge that cannot go through
		return t.fail(ctx, a, "payment "+string(pi.Status))
	}
}

func (t *TopUps) fail(ctx context.Context, a topup.Attempt, reason string) (topup.Attempt, error) {
	f, err := t.pays.FinishTopUp(ctx, a.ID, false, reason, t.now())
	if err != nil {
		return a, err
	}
	t.stats.failed.Add(1)
	t.audit(ctx, a.Org, "topup.failed", fmt.Sprintf("attempt %s: %s; top-ups stopped until the settings are updated", a.ID, reason))
	t.log.Warn("auto top-up declined; the org's top-ups stop until its settings are updated", "org", a.Org, "attempt", a.ID, "reason", reason)
	if en := t.enabled.Load(); en != nil {
		t.enabled.Store(without(*en, a.Org))
	}
	return f, nil
}

func without(m map[string]bool, org string) *map[string]bool {
	out := make(map[string]bool, len(m))
	for k, v := range m {
		if k != org {
			out[k] = v
		}
	}
	return &out
}

func (t *TopUps) audit(ctx context.Context, org, action, detail string) {
	if _, err := t.ops.Ledger().RecordAudit(context.WithoutCancel(ctx), ledger.AuditRecord{
		Actor: "escrow.topup", Action: action, Target: org, Status: 0, Detail: truncate(detail, 4096),
	}); err != nil {
		t.log.Error("top-up audit record failed", "org", org, "err", err)
	}
}
