// Package middleware is escrow's Echo middleware: it puts a hold on the customer's balance before
// an OpenAI-compatible request reaches the model, captures the real usage from the JSON or SSE
// response as it passes, records it durably before the response's final bytes reach the client,
// and releases the hold when the upstream fails.
//
//	e.Use(middleware.New(middleware.Config{Store: store, Ledger: ledger}))
//	e.Any("/v1/*", openAICompatibleHandler)
//
// Refusals are OpenAI-shaped JSON errors ({"error":{"message","type","param","code"}}): 401
// invalid_api_key, 404 for unpriced paths and unknown models, 400 for bad input, 413 for an
// oversized body, 429 insufficient_quota (x-should-retry: false) or rate_limit_exceeded
// (Retry-After), 429 budget_exceeded when a limit is reached (type insufficient_quota,
// x-should-retry: false, the limit in the body and its reset time in x-escrow-limit-reset),
// 403 account_frozen / key_frozen for a frozen org / key or project, and 503 when Redis is down
// or slow (Retry-After; never a 429).
//
// What happens to each request is reported through Config.OnOutcome and Config.Logger; the
// package registers no metrics itself.
package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"go.opentelemetry.io/otel/trace"
)

// Holds is what the middleware needs from the hot balance (*balance.Store implements it).
type Holds interface {
	// Reserve puts the request's hold on the org's balance (see balance.Store.Reserve for the
	// errors the middleware maps to refusals).
	Reserve(ctx context.Context, r balance.ReserveRequest) (balance.Reservation, error)
	// Release gives a hold back without a charge (the upstream failed, or a reserve's outcome
	// is unknown).
	Release(ctx context.Context, org, holdID string) (bool, error)
	// KeepAlive keeps a hold from expiring while its request runs, until the Lease is stopped,
	// and calls onLost when it cannot (the middleware then cancels the upstream call). A nil
	// Lease is fine: it stops as a no-op.
	KeepAlive(org, holdID string, onLost func(error)) (*balance.Lease, error)
	// ModelMax is the model's learned max cost of one choice (0: none yet).
	ModelMax(ctx context.Context, model string) (int64, error)
	// KeyRevoked reports whether the key was revoked (balance.Store.RevokeKey): a key look-up
	// past KeyCacheTTL is served from the cache while the ledger is down only once this says
	// false. A Holds that cannot tell answers false.
	KeyRevoked(ctx context.Context, keyID string) (bool, error)
}

// Directory is what the middleware needs from the ledger (ledger.Ledger implements it): API
// keys and model prices, read through a short in-process cache, and, when Config.Recorder is
// nil, usage recording, one event per call.
type Directory interface {
	LookupKey(ctx context.Context, secret string) (ledger.APIKey, error)
	Model(ctx context.Context, name string) (ledger.Model, error)
	// RecordUsage and VoidUsage stand in for a Recorder (see Config.Recorder).
	RecordUsage(ctx context.Context, events []ledger.UsageEvent) error
	VoidUsage(ctx context.Context, ev ledger.UsageEvent) error
}

// Recorder records usage events durably (*accounting.Recorder implements it).
type Recorder interface {
	// RecordReceipt stores ev durably before it returns. The Receipt carries the org's
	// available balance right after the event's hold was finished when the Recorder can tell
	// (HaveBalance; *accounting.Recorder with a Finisher can), for HeaderBalance.
	RecordReceipt(ctx context.Context, ev ledger.UsageEvent) (accounting.Receipt, error)
	// Void makes sure ev is never stored, after a RecordReceipt that failed or timed out: nil
	// when it is voided (a late write of it is then a no-op), ledger.ErrUsageRecorded when
	// it was stored first, errors.ErrUnsupported when this Recorder cannot void; any other
	// error leaves it unknown (Void is retried).
	Void(ctx context.Context, ev ledger.UsageEvent) error
}

// escrow's own types are what Config asks for.
var (
	_ Holds     = (*balance.Store)(nil)
	_ Directory = ledger.Ledger(nil)
	_ Recorder  = (*accounting.Recorder)(nil)
)

// Skipper returns true for requests the middleware leaves alone.
type Skipper func(c echo.Context) bool

// Identity is who is asking: the org that pays and the API key it used.
type Identity struct {
	Org   string
	KeyID string
	// Models is the key's allow-list (access.ModelAllowed): empty for every model; a request for
	// another model is answered 404 model_not_found, as if the model did not exist.
	Models []string
	// Exempt: the org is exempt (ledger access.OrgFlags): its requests take a zero hold, are never
	// refused for balance and never fitted, and are charged their real cost (exempt.go).
	Exempt bool
}

// Config configures the middleware. Zero fields take the documented defaults.
type Config struct {
	// Skipper skips the middleware for some requests. Default: none skipped.
	Skipper Skipper

	// Store holds and releases balance. Required.
	Store Holds
	// Ledger resolves API keys and model prices (and records usage when Recorder is nil).
	// Required.
	Ledger Directory
	// Recorder records usage events durably. Default: the Ledger's RecordUsage, one event per
	// call, voided with its VoidUsage (pass an *accounting.Recorder for group commit and the
	// local journal). When a record fails or times out, the Recorder is asked to void the
	// event: only a void that succeeded lets the client get an error (the request is then never
	// charged), an event found stored lets it complete, and otherwise (a Recorder that cannot
	// void included) the connection is cut with the hold kept (OutcomeRecordUnknown).
	// x-escrow-balance (see HeaderBalance) is sent only when the Recorder's Receipt has the
	// balance (*accounting.Recorder with a Finisher); else it is left out.
	Recorder Recorder
	// Jobs records background work (an *async.Poller is one). With it, a Responses request
	// with "background": true is held like any other, forwarded, and its job recorded (and its
	// hold handed to the job) before the client gets the response id (background.go). nil:
	// background responses are refused (400).
	Jobs Jobs

	// OrgFunc identifies the org. Default: the key of "Authorization: Bearer <key>" (or, with no
	// Authorization header, of "x-api-key: <key>", as Anthropic's SDKs send it) looked up in
	// the Ledger (cached for KeyCacheTTL). Returning an *Error refuses with it; an error that is
	// ledger.ErrUnknownKey refuses with 401 invalid_api_key; any other error with 503.
	// Identity.KeyID names the key for its limits, freezes and usage events: it must pass
	// balance.ValidateReserveKey (the ledgers' "key_…" ids do); a key id that does not is
	// reserved without a key id (only the org's limits and freeze apply; its usage events keep
	// it for reports), logged once.
	OrgFunc func(c echo.Context) (Identity, error)
	// HoldFunc chooses the hold amount. Default: HoldAmount.
	HoldFunc func(ctx context.Context, in HoldInput) (int64, error)
	// ErrorHandler writes refusals. Default: WriteError.
	ErrorHandler func(c echo.Context, e *Error) error
	// OnOutcome, when set, is called once per request the middleware handled, after the
	// response (for metrics). It must not block.
	OnOutcome func(Outcome)
	// TracerProvider, when set, traces each request (trace.go): a span per request with
	// children for reserve, the upstream call, finish and record. Default nil: no spans (a
	// no-op tracer, nothing allocated).
	TracerProvider trace.TracerProvider
	// Logger logs failures (and, at debug level, outcomes). Default: slog.Default().
	Logger *slog.Logger

	// PassThrough lists paths (besides the priced endpoints) that are passed to the handler
	// after authentication, without a hold (e.g. "/v1/models"); a path ending in "/*" passes
	// every path below it ("/v1/models/*"). Default: none; every other path gets a 404.
	PassThrough []string
	// Route, when set, is asked for each priced request, once its model is read and before its
	// price is looked up or anything is held, whether an upstream serves that model; it may
	// record its choice on c (c.Set) for the handler. A non-empty upstreamModel other than the
	// requested one is written as the body's "model" for the handler (the member the
	// middleware read, and only it), while the request is still priced as the model the client
	// named: the name the route maps from. An *Error refuses the request with it (e.g. 404
	// model_not_found for a model no upstream serves), any other error with 503; either way
	// nothing is held. Default: nil (every model goes to the handler as named).
	Route func(c echo.Context, model string) (upstreamModel string, err error)
	// Batches turns on the batch APIs — /v1/files, /v1/batches, /v1/messages/batches —
	// each batch held at its lines' bounds and billed per line once it ends (batches.go).
	// Default: off (those paths are unknown: 404).
	Batches Batches
	// Allow lists the features the price table cannot price that may pass anyway: "audio",
	// "image_output", "service_tier:<tier>" (e.g. "service_tier:priority"), "tool:<type>" (e.g.
	// "tool:web_search"); on /v1/messages also "tool:<server tool type>", "mcp_servers",
	// "container", "cache_ttl:1h", "speed:<speed>", "inference_geo:<geo>", "beta:<name>" (an
	// anthropic-beta outside the built-in list of betas that do not change billing, e.g.
	// "beta:context-1m-2025-08-07").
	// Default: none (such requests get a 400).
	Allow []string
	// DefaultModel, when set, prices models the Ledger does not know (its Name is ignored).
	// Default: nil (unknown models get a 404 model_not_found).
	DefaultModel *ledger.Model
	// DefaultHold is the hold when nothing better is known (micro-units, > 0). Default 1_000_000.
	DefaultHold int64
	// FailOpen lets requests through without a hold when Redis is down or slow; their usage is
	// still recorded and charged. Default false (503).
	FailOpen bool

	// MaxRequestBytes bounds a request body. Default 4 MiB.
	MaxRequestBytes int64
	// MaxResponseBytes bounds what is kept of a response: a JSON body is kept whole up to it
	// (so that a failed record still answers a clean 503) and one SSE event is parsed whole up
	// to it. Past it the bytes pass on as they come while a streaming scanner reads the usage,
	// so no response is too large to bill; only its end waits for the record (a failed record
	// then aborts the connection), and its cost headers become trailers (see HeaderCost).
	// Default 1 MiB.
	MaxResponseBytes int
	// KeyCacheTTL is how long a key look-up (or a model) is trusted. Default 5s. Past it, an
	// entry still answers for up to MaxStale while the ledger is unreachable (default 10m, at
	// most balance.RevocationTTL) — for a key, only once Redis confirms it was not revoked
	// meanwhile (Holds.KeyRevoked; revocations are pushed by balance.Store.RevokeKey): so a
	// revoked key stops within KeyCacheTTL even while the ledger is down, on every process.
	KeyCacheTTL time.Duration
	MaxStale    time.Duration
	// KeyCacheSize bounds the key and model caches (entries each). Default 10,000.
	KeyCacheSize int
	// NegativeCacheSize bounds the caches of unknown keys and unknown models (entries each),
	// kept apart from the others: a flood of random keys churns only these and never evicts a
	// valid key. Default 1,000.
	NegativeCacheSize int
	// KeyFailuresPerMinute is how many unknown keys (keys the ledger does not know) one client IP
	// may present per minute before they are answered 429 rate_limit_exceeded (with
	// Retry-After) instead of 401 until the minute ends. A key that exists is never refused for
	// it: keys that are not cached are always looked up, those of an address past the limit one
	// at a time, so a client trying random keys holds at most one ledger connection. The client
	// IP is the one echo's IPExtractor gives when it is set (configure it behind a trusted
	// proxy: the server's ESCROW_TRUSTED_PROXIES), else the connection's remote address
	// (X-Forwarded-For is not trusted by default). Default 20; negative turns the limit off.
	KeyFailuresPerMinute int
	// LookupTimeout bounds one ledger look-up. Default 2s.
	LookupTimeout time.Duration
	// ReserveTimeout bounds the reserve call; past it the client gets a 503. Default 1s.
	ReserveTimeout time.Duration
	// RetryAfter is the Retry-After of 503s and of 429 rate_limit_exceeded. Default 1s.
	RetryAfter time.Duration
	// RecordTimeout bounds recording a usage event. Default 15s.
	RecordTimeout time.Duration
	// VoidTimeout bounds the void that asks the ledger, after a record failed or timed out,
	// whether the event is stored (see Recorder). Default: RecordTimeout.
	VoidTimeout time.Duration
	// HangupTimeout and HangupBytes are the read-on bound: how long and how much the handler may
	// go on after the client hung up (its writes are swallowed so the real usage still arrives).
	// Default 2m and 64 MiB (the proxy's ESCROW_READ_ON sets HangupTimeout). Past them the
	// upstream call is cancelled and the request charged an estimate, also when the upstream had
	// not answered yet (it got the request: the provider bills it): a request whose hold is its
	// bound is charged its hold, any other its input bound (the body's bytes at the highest input
	// price) plus the output streamed, never more than the hold (estimate.go).
	HangupTimeout time.Duration
	HangupBytes   int64
	// ReleaseRetryFor bounds the background release after a reserve whose outcome is unknown.
	// Default 10m.
	ReleaseRetryFor time.Duration

	// RenameUpstreamRateLimit keeps the upstream's x-ratelimit-* response headers (the
	// operator's own quota with the provider) as x-upstream-ratelimit-*. Default false: they are
	// dropped, and the client sees one set, escrow's (its key's requests and tokens limits).
	RenameUpstreamRateLimit bool

	// NoFit turns fit off (DESIGN "Holds that fit"): a request whose bound does not fit the
	// balance or a limit's room is refused instead of being served with a lower output cap. A
	// request asks for the refusal itself with "X-Escrow-Fit: off".
	NoFit bool
	// FitMinOutputTokens is the smallest output cap fit serves; below it the request is
	// refused (with the numbers). A request whose own cap is lower is never fitted below it.
	// Default 256.
	FitMinOutputTokens int64
	// FitFields names, per endpoint path, the cap field written into a body that has none
	// (every forwarded body carries the cap its hold priced): the one its upstream reads.
	// Defaults (endpoint.Spec.FitField): max_completion_tokens for chat completions (an upstream
	// that knows only max_tokens wants "max_tokens" here), max_output_tokens for Responses,
	// max_tokens for legacy completions and Messages.
	FitFields map[string]string

	// ImageTokens is, per model name, the most input tokens one image part at detail "high" or
	// "auto" can bill, for models whose provider rule gives more than the endpoint's default
	// (endpoint.Spec.Images: 1,445 for OpenAI's tile rule, 85 at detail "low"; 1,600 for
	// Anthropic). Set it for gpt-4o-mini (2,833 + 5,667 per tile: 48,169) and for models of
	// OpenAI's patch rule (1,536 patches × the model's multiplier, e.g. 2,461 for gpt-4.1-mini).
	ImageTokens map[string]int64
	// ImageOutputTokens is, per model name, the most output tokens one image of a token-billed
	// image model (an image_output price) can bill at any size and quality, replacing the
	// published gpt-image-1 table (endpoint.ImageOutputTokens) for a model whose table differs.
	ImageOutputTokens map[string]int64
	// ToolTokens is, per model name, the most tokens the upstream adds to the input for tool
	// or function definitions besides their bytes, replacing the endpoint's default
	// (endpoint.Spec.ToolOverhead: 1,024).
	ToolTokens map[string]int64

	// EndUserHeader, when set, names the request header that carries the end user (limits of
	// scope end_user; usage grouped by end user) in place of the body's OpenAI "user" field or
	// Anthropic metadata.user_id: for a gateway in front of escrow that knows its users. An end
	// user follows the key id rule (1 to 128 printable ASCII bytes without space or { } , ; : |);
	// another is refused with 400 and nothing held.
	EndUserHeader string
	// RequireEndUser refuses (400, nothing held) a priced request that names no end user.
	// Without it such a request is served and counted by no end-user limit.
	RequireEndUser bool
}

// DefaultConfig holds the defaults (Store and Ledger must still be set).
var DefaultConfig = Config{
	Skipper:              func(echo.Context) bool { return false },
	HoldFunc:             HoldAmount,
	ErrorHandler:         WriteError,
	DefaultHold:          1_000_000,
	MaxRequestBytes:      4 << 20,
	MaxResponseBytes:     1 << 20,
	KeyCacheTTL:          5 * time.Second,
	MaxStale:             10 * time.Minute,
	KeyCacheSize:         10_000,
	NegativeCacheSize:    1_000,
	KeyFailuresPerMinute: 20,
	LookupTimeout:        2 * time.Second,
	ReserveTimeout:       time.Second,
	RetryAfter:           time.Second,
	RecordTimeout:        15 * time.Second,
	HangupTimeout:        2 * time.Minute,
	HangupBytes:          64 << 20,
	ReleaseRetryFor:      10 * time.Minute,
	FitMinOutputTokens:   256,
}

// New returns the middleware; it panics on a bad Config (use ToMiddleware to get the error).
func New(cfg Config) echo.MiddlewareFunc {
	m, err := cfg.ToMiddleware()
	if err != nil {
		panic(err)
	}
	return m
}

// ToMiddleware validates the Config and returns the middleware.
func (cfg Config) ToMiddleware() (echo.MiddlewareFunc, error) {
	m, err := newMiddleware(cfg)
	if err != nil {
		return nil, err
	}
	return m.handler, nil
}

// ErrConfig is returned by ToMiddleware for an unusable Config.
var ErrConfig = errors.New("middleware: invalid config")

// ledgerRecorder is the default Recorder: the Ledger's own RecordUsage and VoidUsage.
type ledgerRecorder struct{ l Directory }

func (r ledgerRecorder) RecordReceipt(ctx context.Context, ev ledger.UsageEvent) (accounting.Receipt, error) {
	return accounting.Receipt{}, r.l.RecordUsage(ctx, []ledger.UsageEvent{ev})
}

func (r ledgerRecorder) Void(ctx context.Context, ev ledger.UsageEvent) error {
	return r.l.VoidUsage(ctx, ev)
}

func (cfg Config) withDefaults() (Config, error) {
	d := DefaultConfig
	if cfg.Store == nil {
		return cfg, fmt.Errorf("%w: Store is required", ErrConfig)
	}
	if cfg.Ledger == nil {
		return cfg, fmt.Errorf("%w: Ledger is required", ErrConfig)
	}
	if cfg.Recorder == nil {
		cfg.Recorder = ledgerRecorder{cfg.Ledger}
	}
	if cfg.Skipper == nil {
		cfg.Skipper = d.Skipper
	}
	if cfg.HoldFunc == nil {
		cfg.HoldFunc = d.HoldFunc
	}
	if cfg.ErrorHandler == nil {
		cfg.ErrorHandler = d.ErrorHandler
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.DefaultHold = cmp.Or(cfg.DefaultHold, d.DefaultHold)
	cfg.MaxRequestBytes = cmp.Or(cfg.MaxRequestBytes, d.MaxRequestBytes)
	cfg.MaxResponseBytes = cmp.Or(cfg.MaxResponseBytes, d.MaxResponseBytes)
	cfg.KeyCacheTTL = cmp.Or(cfg.KeyCacheTTL, d.KeyCacheTTL)
	cfg.MaxStale = cmp.Or(cfg.MaxStale, d.MaxStale)
	cfg.KeyCacheSize = cmp.Or(cfg.KeyCacheSize, d.KeyCacheSize)
	cfg.NegativeCacheSize = cmp.Or(cfg.NegativeCacheSize, d.NegativeCacheSize)
	cfg.KeyFailuresPerMinute = cmp.Or(cfg.KeyFailuresPerMinute, d.KeyFailuresPerMinute)
	cfg.LookupTimeout = cmp.Or(cfg.LookupTimeout, d.LookupTimeout)
	cfg.ReserveTimeout = cmp.Or(cfg.ReserveTimeout, d.ReserveTimeout)
	cfg.RetryAfter = cmp.Or(cfg.RetryAfter, d.RetryAfter)
	cfg.RecordTimeout = cmp.Or(cfg.RecordTimeout, d.RecordTimeout)
	cfg.VoidTimeout = cmp.Or(cfg.VoidTimeout, cfg.RecordTimeout)
	cfg.FitMinOutputTokens = cmp.Or(cfg.FitMinOutputTokens, d.FitMinOutputTokens)
	cfg.HangupTimeout = cmp.Or(cfg.HangupTimeout, d.HangupTimeout)
	cfg.HangupBytes = cmp.Or(cfg.HangupBytes, d.HangupBytes)
	cfg.ReleaseRetryFor = cmp.Or(cfg.ReleaseRetryFor, d.ReleaseRetryFor)
	switch {
	case cfg.DefaultHold < 0 || cfg.DefaultHold > balance.MaxAmount:
		return cfg, fmt.Errorf("%w: DefaultHold %d must be in (0, %d]", ErrConfig, cfg.DefaultHold, balance.MaxAmount)
	case cfg.MaxRequestBytes < 0, cfg.MaxResponseBytes < 0, cfg.KeyCacheSize < 0, cfg.NegativeCacheSize < 0, cfg.HangupBytes < 0:
		return cfg, fmt.Errorf("%w: sizes must be > 0", ErrConfig)
	case cfg.KeyCacheTTL < 0, cfg.MaxStale < 0, cfg.LookupTimeout < 0, cfg.ReserveTimeout < 0, cfg.RetryAfter < 0,
		cfg.RecordTimeout < 0, cfg.VoidTimeout < 0, cfg.HangupTimeout < 0, cfg.ReleaseRetryFor < 0, cfg.FitMinOutputTokens < 0:
		return cfg, fmt.Errorf("%w: durations must be > 0", ErrConfig)
	case cfg.MaxStale > balance.RevocationTTL:
		// A stale key older than the revocation mark could outlive its revocation.
		return cfg, fmt.Errorf("%w: MaxStale %v is above balance.RevocationTTL (%v)", ErrConfig, cfg.MaxStale, balance.RevocationTTL)
	}
	if m := cfg.DefaultModel; m != nil {
		if err := m.Prices.Check(); err != nil {
			return cfg, fmt.Errorf("%w: DefaultModel: %w", ErrConfig, err)
		}
		if m.DefaultHold < 0 {
			return cfg, fmt.Errorf("%w: DefaultModel has a negative hold", ErrConfig)
		}
	}
	return cfg, nil
}
