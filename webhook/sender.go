package webhook

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmescrow/escrow/ledger"
)

// Defaults of Config.
const (
	DefaultTimeout      = 10 * time.Second
	DefaultMaxAttempts  = 12
	DefaultBackoffMin   = 5 * time.Second
	DefaultBackoffMax   = time.Hour
	DefaultPollInterval = time.Second
	DefaultConcurrency  = 8
	// The lease of a claim is Timeout + LeaseMargin unless set.
	LeaseMargin = 30 * time.Second
)

// ErrConfig is returned by NewSender for an inconsistent configuration.
var ErrConfig = errors.New("webhook: invalid config")

// Config configures a Sender. The zero value of every field means its documented default.
type Config struct {
	// Timeout bounds one attempt (connect, send, answer). Default 10s.
	Timeout time.Duration
	// MaxAttempts is the number of attempts after which a delivery is marked failed. Default 12
	// (with the default backoff: about 5 hours of retries).
	MaxAttempts int
	// BackoffMin is the wait after the first failed attempt; it doubles with each attempt up to
	// BackoffMax. Each wait is drawn at random from [w/2, w] (jitter), so receivers that come
	// back are not hit by every sender at once. Defaults 5s and 1h.
	BackoffMin, BackoffMax time.Duration
	// Lease is how long a claimed delivery is not handed to another sender (in this process or
	// another one on the same ledger); it must exceed Timeout. Default Timeout + 30s.
	Lease time.Duration
	// PollInterval is how often the outbox is read for due deliveries. Default 1s.
	PollInterval time.Duration
	// Concurrency is how many attempts run at once. Default 8.
	Concurrency int
	// PerEndpoint is how many of those may go to one endpoint at once, so that an endpoint
	// that answers slowly (or never, until Timeout) leaves the other slots to the others.
	// Default max(1, Concurrency/4).
	PerEndpoint int
	// AllowPrivate lets endpoints be on loopback, link-local, private and other non-public
	// addresses (ESCROW_WEBHOOK_ALLOW_PRIVATE). Default false: such endpoints are refused when
	// created (CheckURL) and, after name resolution, at each attempt (a failed attempt).
	AllowPrivate bool
	// Client sends the requests. Default: an http.Client that follows no redirect (a 3xx is a
	// failed attempt), uses no proxy, and dials only public addresses unless AllowPrivate. A
	// Client given here replaces that dial-time check.
	Client *http.Client
	// Logger defaults to slog.Default(). Secrets and URLs are never logged.
	Logger *slog.Logger
}

func (c *Config) withDefaults() (Config, error) {
	var z Config
	if c != nil {
		z = *c
	}
	z.Timeout = cmp.Or(z.Timeout, DefaultTimeout)
	z.MaxAttempts = cmp.Or(z.MaxAttempts, DefaultMaxAttempts)
	z.BackoffMin = cmp.Or(z.BackoffMin, DefaultBackoffMin)
	z.BackoffMax = cmp.Or(z.BackoffMax, DefaultBackoffMax)
	z.Lease = cmp.Or(z.Lease, z.Timeout+LeaseMargin)
	z.PollInterval = cmp.Or(z.PollInterval, DefaultPollInterval)
	z.Concurrency = cmp.Or(z.Concurrency, DefaultConcurrency)
	z.PerEndpoint = cmp.Or(z.PerEndpoint, max(1, z.Concurrency/4))
	if z.Client == nil {
		z.Client = defaultClient(z.AllowPrivate)
	}
	if z.Logger == nil {
		z.Logger = slog.Default()
	}
	switch {
	case z.Timeout < 0 || z.MaxAttempts < 1 || z.BackoffMin < 0 || z.BackoffMax < z.BackoffMin || z.PollInterval < 0 || z.Concurrency < 1 || z.PerEndpoint < 1:
		return z, fmt.Errorf("%w: negative durations, MaxAttempts, Concurrency or PerEndpoint < 1, or BackoffMax < BackoffMin", ErrConfig)
	case z.Lease <= z.Timeout:
		return z, fmt.Errorf("%w: Lease (%v) must exceed Timeout (%v), or two senders could send one attempt at once", ErrConfig, z.Lease, z.Timeout)
	}
	return z, nil
}

// Stats are a sender's running totals.
type Stats struct {
	Attempts  int64 // requests sent (or tried)
	Delivered int64 // deliveries answered with a 2xx
	Retries   int64 // failed attempts with another one to come
	Failed    int64 // deliveries given up after MaxAttempts
	// ClaimErrors counts failed reads of the outbox (a ledger outage: logged once per streak).
	ClaimErrors int64
}

// Sender delivers the outbox's events. Several senders (in one process or many, on one ledger)
// may run at once: a claim is exclusive for its lease.
type Sender struct {
	store ledger.Webhooks
	cfg   Config
	log   *slog.Logger
	wake  chan struct{}

	attempts, delivered, retries, failed, claimErrors atomic.Int64

	busyMu sync.Mutex
	busy   map[string]int // attempts running, by endpoint (webhook id)

	runMu  sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
	sends  sync.WaitGroup
}

// NewSender returns a sender over store (a ledger that implements ledger.Webhooks); cfg may
// be nil for the defaults.
func NewSender(store ledger.Webhooks, cfg *Config) (*Sender, error) {
	if store == nil {
		return nil, errors.New("webhook: nil store")
	}
	c, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return &Sender{store: store, cfg: c, log: c.Logger.With("component", "escrow.webhook"), wake: make(chan struct{}, 1),
		busy: map[string]int{}}, nil
}

// Config returns the sender's configuration, defaults applied.
func (s *Sender) Config() Config { return s.cfg }

// Stats returns the sender's running totals.
func (s *Sender) Stats() Stats {
	return Stats{Attempts: s.attempts.Load(), Delivered: s.delivered.Load(), Retries: s.retries.Load(), Failed: s.failed.Load(),
		ClaimErrors: s.claimErrors.Load()}
}

// Start starts the delivery loop. It runs until Stop (or until ctx ends).
func (s *Sender) Start(ctx context.Context) error {
	s.runMu.Lock()
	defer s.runMu.Unlock()
	if s.done != nil {
		return errors.New("webhook: sender already started")
	}
	ctx, s.cancel = context.WithCancel(ctx)
	s.done = make(chan struct{})
	go func() {
		defer close(s.done)
		s.loop(ctx)
	}()
	return nil
}

// Stop stops claiming and waits for the attempts in flight (each bounded by Timeout), or for
// ctx. A delivery whose attempt is cut short is sent again after its lease.
func (s *Sender) Stop(ctx context.Context) error {
	s.runMu.Lock()
	cancel, done := s.cancel, s.done
	s.runMu.Unlock()
	if done == nil {
		return nil
	}
	cancel()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Poke makes the sender read the outbox now rather than at its next poll.
func (s *Sender) Poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *Sender) loop(ctx context.Context) {
	defer s.sends.Wait()
	slots := make(chan struct{}, s.cfg.Concurrency)
	tick := time.NewTicker(s.cfg.PollInterval)
	defer tick.Stop()
	// Attempts are not cut by Stop (only by their Timeout): their outcome is then recorded.
	sendCtx := context.WithoutCancel(ctx)
	failing := false // the outbox could not be read: logged once until it can again
	for {
		if free := cap(slots) - len(slots); free > 0 {
			ds, err := s.store.ClaimDeliveries(ctx, free, s.cfg.Lease, ledger.EndpointLimit{Max: s.cfg.PerEndpoint, Busy: s.busyNow()})
			switch {
			case err != nil && ctx.Err() == nil:
				s.claimErrors.Add(1)
				if !failing {
					s.log.Warn("webhook: reading the outbox failed; retrying at each poll", "err", err)
				}
				failing = true
			case err == nil && failing:
				s.log.Info("webhook: the outbox is readable again")
				failing = false
			}
			for _, d := range ds {
				slots <- struct{}{}
				s.sends.Add(1)
				s.setBusy(d.WebhookID, +1)
				go func() {
					defer s.sends.Done()
					s.attempt(sendCtx, d)
					s.setBusy(d.WebhookID, -1)
					<-slots
					s.Poke()
				}()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-s.wake:
		}
	}
}

// busyNow is a copy of the attempts running by endpoint, for a claim.
func (s *Sender) busyNow() map[string]int {
	s.busyMu.Lock()
	defer s.busyMu.Unlock()
	return maps.Clone(s.busy)
}

func (s *Sender) setBusy(endpoint string, delta int) {
	s.busyMu.Lock()
	defer s.busyMu.Unlock()
	if s.busy[endpoint] += delta; s.busy[endpoint] <= 0 {
		delete(s.busy, endpoint)
	}
}

// attempt sends one claimed delivery and records the outcome.
func (s *Sender) attempt(ctx context.Context, d ledger.Delivery) {
	s.attempts.Add(1)
	o := s.send(ctx, d)
	switch {
	case o.Status == ledger.DeliveryDelivered:
		s.delivered.Add(1)
	case d.Attempts >= s.cfg.MaxAttempts:
		o.Status = ledger.DeliveryFailed
		s.failed.Add(1)
		s.log.Warn("webhook: delivery failed for good", "delivery", d.ID, "webhook", d.WebhookID, "event", d.EventID,
			"type", d.EventType, "attempts", d.Attempts, "err", o.Error)
	default:
		o.Status, o.RetryAfter = ledger.DeliveryPending, s.Backoff(d.Attempts)
		s.retries.Add(1)
		s.log.Debug("webhook: attempt failed; retrying", "delivery", d.ID, "webhook", d.WebhookID, "attempt", d.Attempts,
			"retry_after", o.RetryAfter, "err", o.Error)
	}
	fctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	if err := s.store.FinishDelivery(fctx, d.ID, d.Attempts, o); err != nil {
		// A lost lease (another sender has the delivery now) or a ledger outage: the lease
		// makes the delivery due again, so at worst it is sent once more.
		s.log.Warn("webhook: recording an attempt failed", "delivery", d.ID, "attempt", d.Attempts, "err", err)
	}
}

// send POSTs the body, signed now, within Timeout.
func (s *Sender) send(ctx context.Context, d ledger.Delivery) ledger.Outcome {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	// Endpoints stored before the policy (or written to the ledger directly) are checked too;
	// their addresses after resolution, by the client's dialer.
	if err := CheckURL(d.URL, true); err != nil {
		return ledger.Outcome{Error: err.Error()}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.URL, bytes.NewReader(d.Body))
	if err != nil {
		return ledger.Outcome{Error: "bad request: " + errText(err)}
	}
	h := req.Header
	h.Set("Content-Type", "application/json")
	h.Set("User-Agent", "escrow-webhook/1")
	h.Set(HeaderEventID, d.EventID)
	h.Set(HeaderEventType, string(d.EventType))
	h.Set(HeaderAttempt, strconv.Itoa(d.Attempts))
	h.Set(HeaderSignature, Sign(d.Secret, time.Now(), d.Body))
	resp, err := s.cfg.Client.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return ledger.Outcome{Error: fmt.Sprintf("no answer within %v", s.cfg.Timeout)}
		}
		return ledger.Outcome{Error: errText(err)}
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return ledger.Outcome{Status: ledger.DeliveryDelivered, HTTPStatus: resp.StatusCode}
	}
	return ledger.Outcome{HTTPStatus: resp.StatusCode, Error: "HTTP " + strconv.Itoa(resp.StatusCode)}
}

// errText is err without the URL (which may carry a token): the inner error of a *url.Error.
func errText(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Op + ": " + ue.Err.Error()
	}
	return err.Error()
}

// Backoff is the wait after failed attempt number n (1, 2, …): BackoffMin·2^(n-1), at most
// BackoffMax, drawn from [w/2, w].
func (s *Sender) Backoff(n int) time.Duration {
	w := s.cfg.BackoffMin
	for i := 1; i < n && w < s.cfg.BackoffMax; i++ {
		w *= 2
	}
	w = min(w, s.cfg.BackoffMax)
	if w <= 1 {
		return w
	}
	return w/2 + rand.N(w/2+1)
}
