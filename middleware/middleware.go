package middleware

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"go.opentelemetry.io/otel/trace"
)

// OutcomeKind says how a request ended for billing.
type OutcomeKind string

const (
	OutcomeRefused      OutcomeKind = "refused"       // refused before the upstream call; nothing held
	OutcomePassed       OutcomeKind = "passed"        // a PassThrough path: no hold, no usage
	OutcomeRecorded     OutcomeKind = "recorded"      // usage from the response recorded
	OutcomeEstimated    OutcomeKind = "estimated"     // no usable usage: an estimate recorded
	OutcomeReleased     OutcomeKind = "released"      // the upstream failed: hold released, nothing charged
	OutcomeRecordFailed OutcomeKind = "record_failed" // usage certainly not recorded (refused or voided): client got an error, hold released
	// OutcomeRecordUnknown: recording failed and voiding could not reach the ledger, so whether
	// the usage will be stored is unknown: the connection was cut (neither a success nor an
	// error), the hold kept, and the void retried in the background.
	OutcomeRecordUnknown OutcomeKind = "record_unknown"
	// OutcomeRecordLater: recording failed after the response's content reached the client
	// (served ⇒ billed): the client got its end, the hold is kept alive and never released,
	// and the event is recorded again in the background until stored (never voided).
	OutcomeRecordLater OutcomeKind = "record_later"
	// OutcomeJob: a background response was started and its job recorded; its hold belongs to
	// the job, which is billed when it ends (package async).
	OutcomeJob OutcomeKind = "job"
)

// Outcome describes one handled request, for metrics and logs (Config.OnOutcome).
type Outcome struct {
	Kind       OutcomeKind
	HoldID     string // also the request id and the usage event id ("" if refused before one was made)
	Org        string
	KeyID      string
	Model      string
	Endpoint   string
	Status     int    // the HTTP status the client got
	Code       string // the error code of a refusal
	HoldAmount int64
	Cost       int64
	Usage      pricing.Usage
	FailOpen   bool          // passed without a hold because Redis could not answer
	FitCap     int64         // the output cap fit lowered the request's to (0: not fitted)
	Err        error         // what went wrong, if anything
	Duration   time.Duration // from the request's arrival to its outcome

	began time.Time
	span  trace.Span // the request's span (trace.go)
}

type middleware struct {
	cfg      Config
	keys     *ttlCache[ledger.APIKey]
	failures *failureLimiter // failed key look-ups per client IP
	models   *ttlCache[ledger.Model]
	pass     map[string]bool
	passDirs []string // PassThrough prefixes ("/v1/models/" for "/v1/models/*")
	allow    map[string]bool
	badKey   sync.Once // logs the first key id the limits layer cannot name
	tracer   trace.Tracer
}

func newMiddleware(cfg Config) (*middleware, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m := &middleware{cfg: cfg, pass: map[string]bool{}, allow: map[string]bool{}, tracer: newTracer(cfg.TracerProvider)}
	for _, p := range cfg.PassThrough {
		if dir, ok := strings.CutSuffix(p, "/*"); ok {
			m.passDirs = append(m.passDirs, dir+"/")
			continue
		}
		m.pass[p] = true
	}
	for _, f := range cfg.Allow {
		m.allow[f] = true
	}
	m.keys = newTTLCache[ledger.APIKey](cfg.KeyCacheTTL, cfg.MaxStale, cfg.KeyCacheSize, cfg.NegativeCacheSize, cfg.LookupTimeout,
		func(err error) bool { return errors.Is(err, ledger.ErrUnknownKey) })
	m.keys.stale = m.keyNotRevoked
	m.failures = newFailureLimiter(cfg.KeyFailuresPerMinute, cfg.KeyCacheSize, time.Minute)
	m.models = newTTLCache[ledger.Model](cfg.KeyCacheTTL, cfg.MaxStale, cfg.KeyCacheSize, cfg.NegativeCacheSize, cfg.LookupTimeout,
		func(err error) bool { return errors.Is(err, ledger.ErrUnknownModel) })
	if m.cfg.OrgFunc == nil {
		m.cfg.OrgFunc = m.bearerOrg
	}
	m.registerBatchPollers()
	return m, nil
}

func (m *middleware) handler(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if m.cfg.Skipper(c) {
			return next(c)
		}
		return m.traced(c, next)
	}
}

// bearerOrg is the default OrgFunc: the key of "Authorization: Bearer <key>" or, when the
// request has no Authorization header, of "x-api-key: <key>" (as Anthropic's SDKs send it),
// looked up in the ledger. Neither header ever reaches the upstream.
func (m *middleware) bearerOrg(c echo.Context) (Identity, error) {
	h := c.Request().Header
	auth := h.Get("Authorization")
	scheme, key, ok := strings.Cut(auth, " ")
	key = strings.TrimSpace(key)
	ok = ok && strings.EqualFold(scheme, "Bearer") && key != ""
	if xkey := strings.TrimSpace(h.Get("X-Api-Key")); auth == "" && xkey != "" {
		key, ok = xkey, true
	}
	if !ok {
		return Identity{}, &Error{Status: http.StatusUnauthorized, Type: TypeInvalidRequest, Code: CodeInvalidAPIKey,
			Message: "You didn't provide an API key. Provide it in the Authorization header (Authorization: Bearer YOUR_KEY) or in x-api-key."}
	}
	ip := clientIP(c)
	k, err := m.keys.get(c.Request().Context(), key, func(ctx context.Context, secret string) (ledger.APIKey, error) {
		release, err := m.failures.gate(ctx, ip)
		if err != nil {
			return ledger.APIKey{}, fmt.Errorf("middleware: waiting to look up a key: %w", err)
		}
		defer release()
		return m.cfg.Ledger.LookupKey(ctx, secret)
	})
	if errors.Is(err, ledger.ErrUnknownKey) {
		if over, retryIn := m.failures.fail(ip); over {
			return Identity{}, &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: CodeRateLimit,
				RetryAfter: retryIn, Message: "Too many requests with unknown API keys from your address. Retry later."}
		}
	}
	if err != nil {
		return Identity{}, err
	}
	return Identity{Org: k.Org, KeyID: k.ID, Models: k.Models, Exempt: k.Exempt}, nil
}

// keyNotRevoked lets a stale cached key answer only once the Store confirms it was not revoked
// meanwhile (Config.MaxStale).
func (m *middleware) keyNotRevoked(ctx context.Context, k ledger.APIKey) error {
	rctx, cancel := context.WithTimeout(ctx, m.cfg.ReserveTimeout)
	defer cancel()
	revoked, err := m.cfg.Store.KeyRevoked(rctx, k.ID)
	switch {
	case err != nil:
		return fmt.Errorf("middleware: key revocation unknown: %w", err)
	case revoked:
		return fmt.Errorf("%w: revoked (pushed through redis)", ledger.ErrUnknownKey)
	}
	return nil
}

// call is one metered request on its way.
type call struct {
	m          *middleware
	id         Identity
	holdID     string
	req        Request
	model      ledger.Model
	holdAmount int64
	agreed     int64 // the hold amount computed for the request, kept when fail-open takes no hold
	failOpen   bool
	// limitKey is the key id the hold was reserved under ("" when none, or when the limits layer
	// cannot name the identity's key id).
	limitKey string
	reserved balance.Reservation // what Reserve answered (zero for fail-open: no hold)
	// rate is escrow's own x-ratelimit-* set of reserved, built once by proxy before the handler
	// runs; oneRateLimitSet tells it from the upstream's by it.
	rate   http.Header
	fitCap int64 // the output cap fit lowered the request's to (0: not fitted)
	start  time.Time
	sent   atomic.Bool // the handler read the request body: the upstream got the request (sentBody)
	// traceCtx is the record's parent context: Background, with the finish span when traced
	// (trace.go), never the client request's values or cancellation.
	traceCtx context.Context
}

func (m *middleware) refuse(c echo.Context, o Outcome, e *Error) error {
	if isAnthropic(c.Request().URL.Path) && !e.Anthropic {
		e = e.forAnthropic()
	}
	o.Kind, o.Status, o.Code, o.Err = OutcomeRefused, e.Status, e.Code, e
	if o.HoldID != "" {
		c.Response().Header().Set("x-request-id", o.HoldID)
	}
	err := m.cfg.ErrorHandler(c, e)
	m.report(o)
	return err
}

func (m *middleware) report(o Outcome) {
	o.Duration = time.Since(o.began)
	observe(o)
	if m.cfg.OnOutcome != nil {
		m.cfg.OnOutcome(o)
	}
	log := m.cfg.Logger
	switch o.Kind {
	case OutcomeRecordFailed:
		log.Error("escrow: usage not recorded", "hold_id", o.HoldID, "org", o.Org, "model", o.Model, "err", o.Err)
	case OutcomeRecordLater:
		log.Warn("escrow: usage of a served request not recorded yet; retried until stored", "hold_id", o.HoldID, "org", o.Org, "model", o.Model, "cost", o.Cost, "err", o.Err)
	case OutcomeRecordUnknown:
		log.Error("escrow: usage outcome unknown; connection cut, void retried", "hold_id", o.HoldID, "org", o.Org, "model", o.Model, "err", o.Err)
	case OutcomeEstimated:
		log.Warn("escrow: usage estimated", "hold_id", o.HoldID, "org", o.Org, "model", o.Model, "cost", o.Cost, "err", o.Err)
	default:
		if log.Enabled(context.Background(), slog.LevelDebug) {
			log.Debug("escrow: request", "outcome", string(o.Kind), "hold_id", o.HoldID, "org", o.Org, "model", o.Model,
				"status", o.Status, "code", o.Code, "hold", o.HoldAmount, "cost", o.Cost, "err", o.Err)
		}
	}
}

// serve meters one request: who asks, what it asks for, at what price, the hold; then the
// upstream call and its usage (call.proxy).
func (m *middleware) serve(c echo.Context, next echo.HandlerFunc) error {
	start := time.Now()
	req := c.Request()
	o := Outcome{Endpoint: req.URL.Path, began: start, span: trace.SpanFromContext(req.Context())}
	id, e := m.identify(c, &o)
	if e != nil {
		return m.refuse(c, o, e)
	}
	if rt, ok := endpoint.LookupBatch(req.Method, req.URL.Path); ok && m.cfg.Batches.on() {
		return m.serveBatch(c, next, id, rt, o) // the batch APIs (batches.go)
	}
	if pricedSpec(req.URL.Path) == nil {
		return m.serveUnpriced(c, next, o)
	}
	body, r, e := m.readPriced(c, &o)
	if e == nil {
		e = keyModelRefusal(id, r.Model)
	}
	if e != nil {
		return m.refuse(c, o, e)
	}
	if r.Proof != nil {
		return m.serveProven(c, next, id, body, r, o) // billed from what the request proves (proven.go)
	}
	model, stamp, e := m.priceModel(req.Context(), body, &r)
	if e != nil {
		return m.refuse(c, o, e)
	}
	fitOff := strings.EqualFold(strings.TrimSpace(req.Header.Get(HeaderFit)), "off") // escrow's header values: any case
	req.Header.Del(HeaderFit)
	cl, e := m.reserveHold(req.Context(), id, r, model, fitOff, start, &o)
	if e != nil {
		return m.refuse(c, o, e)
	}
	if !cl.failOpen {
		defer m.useModel(req.Context(), r.Model)()
	}
	if !cl.failOpen && m.modelChanged(req.Context(), r.Model, stamp) {
		// The hold came late after a stale read of the model, which has changed since: priced
		// again under the model as it is now.
		m.release(id.Org, cl.holdID) // taken for nothing
		if model, _, e = m.priceModel(req.Context(), body, &r); e != nil {
			return m.refuse(c, o, e)
		}
		if cl, e = m.reserveHold(req.Context(), id, r, model, fitOff, start, &o); e != nil {
			return m.refuse(c, o, e)
		}
	}
	if c := outputCapOf(cl.model, cl.req); c > 0 {
		body = m.capBody(body, cl.req, c) // the cap the hold priced, in the endpoint's field
	}
	if cl.fitCap > 0 {
		c.Response().Header().Set(HeaderOutputCap, strconv.FormatInt(cl.fitCap, 10))
	}
	return cl.proxy(c, next, body, o)
}

// identify finds who is asking (Config.OrgFunc) and checks the org id.
func (m *middleware) identify(c echo.Context, o *Outcome) (Identity, *Error) {
	id, err := m.cfg.OrgFunc(c)
	if err != nil {
		return id, m.identityError(err)
	}
	o.Org, o.KeyID = id.Org, id.KeyID
	if err := balance.ValidateOrg(id.Org); err != nil {
		// The one org-id rule, checked before anything is read or held (an OrgFunc may return
		// anything; a ledger row may predate the rule).
		o.Err = err
		return id, errInvalid("", "The organization id of this API key is not valid: "+err.Error())
	}
	c.Set(identityKey, id) // IdentityOf
	return id, nil
}

// serveUnpriced passes an authenticated request to a path that is not billed (PassThrough, or
// count_tokens) without a hold, or refuses it with a 404.
func (m *middleware) serveUnpriced(c echo.Context, next echo.HandlerFunc, o Outcome) error {
	req := c.Request()
	path := req.URL.Path
	spec := endpoint.Lookup(path) // an unbilled endpoint (count_tokens), or none
	if spec != nil && m.cfg.Route != nil {
		// Unbilled, but sent to the upstream of its model's route, like the Messages it
		// counts for.
		if e := m.routeUnpriced(c); e != nil {
			return m.refuse(c, o, e)
		}
	}
	if m.passes(path) || spec != nil {
		req.Header.Del("Authorization")
		req.Header.Del("X-Api-Key")
		o.Kind = OutcomePassed
		err := next(c)
		o.Status = c.Response().Status
		m.report(o)
		return err
	}
	return m.refuse(c, o, &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Code: CodeNotFound,
		Message: "Invalid URL (" + req.Method + " " + path + ")"})
}

// readPriced reads and parses a priced request's body, refuses what cannot be priced, and
// routes its model (Config.Route), renaming it in the body when the route says so.
func (m *middleware) readPriced(c echo.Context, o *Outcome) ([]byte, Request, *Error) {
	req := c.Request()
	path := req.URL.Path
	if req.Method != http.MethodPost {
		return nil, Request{}, &Error{Status: http.StatusMethodNotAllowed, Type: TypeInvalidRequest, Code: CodeMethodNotAllowed,
			Message: "Method " + req.Method + " is not allowed on " + path + "; use POST."}
	}
	body, e := readBody(req, m.cfg.MaxRequestBytes)
	if e != nil {
		return nil, Request{}, e
	}
	r, e := parseBody(req, path, body) // JSON, or a multipart form (multipart.go)
	if e != nil {
		return nil, Request{}, e
	}
	// On every priced path: a gateway behind an OpenAI-style route may pass the header on to
	// Anthropic too.
	if e := msgBetas(req.Header, &r); e != nil {
		return nil, Request{}, e
	}
	if e := m.endUser(req.Header, &r); e != nil {
		return nil, Request{}, e
	}
	o.Model = r.Model
	if e := m.backgroundRefusal(r); e != nil {
		return nil, Request{}, e
	}
	for _, f := range r.Features {
		if !m.allow[f] && classFeatures[f] == nil { // a feature classes price: priceModel checks the model's prices
			return nil, Request{}, errFeature(f)
		}
	}
	if m.cfg.Route != nil {
		up, err := m.cfg.Route(c, r.Model)
		if err != nil {
			o.Err = err
			return nil, Request{}, m.routeError(err)
		}
		if up != "" && up != r.Model {
			// parseRequest refused any body whose "model" key is not unique and exactly spelled,
			// so the member replaced is the one priced; the hold's size bound counts the new body.
			if body, e = renameModel(req, r, body, up); e != nil {
				return nil, Request{}, e
			}
			r.Size = max(r.Size, len(body))
		}
	}
	return body, r, nil
}

// endUser settles the request's end user: the configured header's value (Config.EndUserHeader)
// or the body's. It must follow the key id rule, since it names limit counters; with
// Config.RequireEndUser it must be there.
func (m *middleware) endUser(h http.Header, r *Request) *Error {
	param := m.endUserParam(*r)
	if m.cfg.EndUserHeader != "" {
		r.EndUser = h.Get(m.cfg.EndUserHeader)
	}
	if r.EndUser == "" {
		if m.cfg.RequireEndUser {
			return errMissing(param, "This API needs the end user of every request: set '"+param+"'.")
		}
		return nil
	}
	if err := (balance.Scope{Kind: balance.ScopeEndUser, ID: r.EndUser}).Validate(); err != nil {
		return errInvalid(param, "'"+param+"' must be 1 to 128 printable ASCII characters without spaces or { } , ; : |.")
	}
	return nil
}

// endUserParam is where a request names its end user: the configured header, else the body's
// field of its endpoint.
func (m *middleware) endUserParam(r Request) string {
	if m.cfg.EndUserHeader != "" {
		return m.cfg.EndUserHeader
	}
	return r.Spec.EndUserField
}

// priceModel finds the prices of the request's model (or the DefaultModel's) and checks the
// request's output cap against the model's.
// The stamp is the model's state in Redis the prices were read under (modelChanged).
func (m *middleware) priceModel(ctx context.Context, body []byte, r *Request) (ledger.Model, modelStamp, *Error) {
	model, stamp, err := m.lookupModel(ctx, r.Model)
	switch {
	case errors.Is(err, ledger.ErrUnknownModel) && m.cfg.DefaultModel != nil:
		model = *m.cfg.DefaultModel
		model.Name = r.Model
	case errors.Is(err, ledger.ErrUnknownModel):
		return model, stamp, &Error{Status: http.StatusNotFound, Type: TypeInvalidRequest, Param: "model", Code: CodeModelNotFound,
			Message: "The model '" + r.Model + "' does not exist or you do not have access to it."}
	case err != nil:
		return model, stamp, errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter)
	}
	if e := m.pricedFeatures(model, *r); e != nil {
		return model, stamp, e
	}
	if r.OutputCap > 0 && model.MaxOutputTokens > 0 && r.OutputCap > model.MaxOutputTokens {
		return model, stamp, errInvalid(capParam(body, r.Spec), "The output token limit "+strconv.FormatInt(r.OutputCap, 10)+
			" is above the model's maximum of "+strconv.FormatInt(model.MaxOutputTokens, 10)+".")
	}
	r.PartTokens = m.partTokens(model.Name, *r)
	return model, stamp, nil
}

// reserveHold sizes the hold (Config.HoldFunc), makes the request's id and reserves the hold;
// with FailOpen, Redis trouble lets the call go on without one.
//
// A request whose hold is its bound and does not fit is fitted (fit.go) unless fitOff: its
// output cap is lowered until the bound fits, and call.fitCap says so.
func (m *middleware) reserveHold(ctx context.Context, id Identity, r Request, model ledger.Model, fitOff bool, start time.Time, o *Outcome) (*call, *Error) {
	learned, err := m.cfg.Store.ModelMax(ctx, model.Name)
	if err != nil {
		learned = 0 // the reserve will meet the same trouble; Model.MaxCost stands in
	}
	amount, err := m.cfg.HoldFunc(ctx, HoldInput{Request: r, Model: model, LearnedMax: learned, Fallback: m.cfg.DefaultHold})
	if err != nil || amount <= 0 || amount > balance.MaxAmount {
		m.cfg.Logger.Error("escrow: bad hold amount", "model", r.Model, "amount", amount, "err", err)
		return nil, errInternal("The hold for this request could not be computed.")
	}
	u, err := uuid.NewV7()
	if err != nil {
		return nil, errInternal("No request id could be made.")
	}
	cl := &call{m: m, id: id, holdID: u.String(), req: r, model: model, holdAmount: amount, agreed: amount,
		limitKey: m.limitKey(id), start: start}
	o.HoldID, o.HoldAmount = cl.holdID, amount

	plan := m.planFit(fitOff || id.Exempt, model, r, amount)
	res, err := m.reserve(ctx, cl, amount, tokenBound(r, outputCapOf(model, r)))
	exemptHold(cl, o, err)
	for try := 1; err != nil && plan.on && try < maxFitTries; try++ {
		room, ok := roomOf(err)
		if !ok {
			break
		}
		c, b, ok := fitCap(model, r, plan.minCap, plan.cap, room)
		if !ok {
			break
		}
		if res, err = m.reserve(ctx, cl, b, tokenBound(r, c)); err == nil {
			cl.holdAmount, cl.agreed, o.HoldAmount = b, b, b
			cl.req.OutputCap = c
			if c < plan.cap {
				cl.fitCap, o.FitCap = c, c
			}
		}
	}
	if err == nil {
		cl.reserved = res
		return cl, nil
	}
	if e := rateRefusal(err, time.Now()); e != nil {
		o.Err = err
		return nil, e
	}
	if errors.Is(err, balance.ErrEndUserRequired) {
		o.Err = err
		p := m.endUserParam(r)
		return nil, errMissing(p, "This organization's end-user limits need the end user of every request: set '"+p+"'.")
	}
	if e := m.quotaRefusal(err, model, r, plan, amount); e != nil {
		o.Err = err
		return nil, e
	}
	e, unknown := m.reserveError(err, amount)
	if unknown {
		// The reserve may have committed unseen: give it back once Redis answers.
		m.releaseLater(id.Org, cl.holdID, err)
	}
	if e != nil {
		o.Err = err
		return nil, e
	}
	cl.holdAmount, cl.failOpen = 0, true
	o.HoldAmount, o.FailOpen = 0, true
	m.cfg.Logger.Warn("escrow: fail-open: request passes without a hold", "hold_id", cl.holdID, "org", id.Org, "err", err)
	return cl, nil
}

// reserve reserves the call's hold of amount (and tokens, its token bound, on tokens limits),
// under ReserveTimeout.
func (m *middleware) reserve(ctx context.Context, cl *call, amount, tokens int64) (balance.Reservation, error) {
	rctx, cancel := context.WithTimeout(ctx, m.cfg.ReserveTimeout)
	defer cancel()
	if cl.id.Exempt {
		amount = 0 // exempt.go
	}
	rctx, span := m.startStep(rctx, SpanReserve)
	if span.IsRecording() {
		span.SetAttributes(AttrOrg.String(cl.id.Org), AttrHold.String(cl.holdID), AttrHoldAmount.Int64(amount))
	}
	res, err := m.cfg.Store.Reserve(rctx, balance.ReserveRequest{Org: cl.id.Org, HoldID: cl.holdID, Amount: amount, KeyID: cl.limitKey, Tokens: tokens,
		EndUser: cl.req.EndUser, Exempt: cl.id.Exempt})
	endStep(span, err)
	return res, err
}

// limitKey is the key id to reserve under: the identity's, unless the limits layer cannot name
// it (balance.ValidateReserveKey: a custom OrgFunc may return ids with , ; : | or spaces). Such
// a key is reserved without a key id, so only the org's limits and freeze apply to it (its usage
// events keep the key id for reports; the ledger leaves it out of the limit attribution); the
// first one is logged, once per middleware. Refusing them instead would turn every request of
// that authenticator into an error.
func (m *middleware) limitKey(id Identity) string {
	if id.KeyID == "" {
		return ""
	}
	if err := balance.ValidateReserveKey(id.KeyID); err != nil {
		m.badKey.Do(func() {
			m.cfg.Logger.Warn("escrow: key id cannot be named by limits: its requests are reserved without a key id (only the org's limits and freeze apply); "+
				"return key ids of 1-128 printable ASCII bytes without space, braces or , ; : | from the OrgFunc", "key_id", id.KeyID, "err", err)
		})
		return ""
	}
	return id.KeyID
}

// reserveError maps a failed reserve to a refusal. unknown is true when the reserve may have
// committed (Redis trouble). A nil *Error means: pass without a hold (fail-open).
func (m *middleware) reserveError(err error, amount int64) (e *Error, unknown bool) {
	// *balance.LimitError and *balance.InsufficientError were answered by quotaRefusal, with
	// their numbers; these are the bare sentinels a Holds may return.
	var frozen *balance.FrozenError
	switch {
	case errors.As(err, &frozen):
		return frozenRefusal(frozen.Scope), false
	case errors.Is(err, balance.ErrLimit): // a Holds that names no limit
		return limitRefusal(&balance.LimitError{}), false
	case errors.Is(err, balance.ErrFrozen):
		return frozenRefusal(balance.Scope{}), false
	case errors.Is(err, balance.ErrInsufficient):
		return &Error{Status: http.StatusTooManyRequests, Type: TypeInsufficientQuota, Code: CodeInsufficientQuota, NoRetry: true,
			Message: "You exceeded your current quota: your balance does not cover this request. Add credit and retry."}, false
	case errors.Is(err, balance.ErrTooManyHolds):
		return &Error{Status: http.StatusTooManyRequests, Type: TypeRateLimit, Code: CodeRateLimit, RetryAfter: m.cfg.RetryAfter,
			Message: "Too many requests in flight for your organization. Retry when some have finished."}, false
	case errors.Is(err, balance.ErrInvalidOrg):
		return errInvalid("", "The organization id of this API key is not valid."), false
	case errors.Is(err, balance.ErrUnknownOrg):
		return &Error{Status: http.StatusUnauthorized, Type: TypeInvalidRequest, Code: CodeInvalidAPIKey,
			Message: "The organization of this API key has no account."}, false
	case errors.Is(err, balance.ErrInvalidAmount):
		m.cfg.Logger.Error("escrow: reserve refused the amount", "amount", amount, "err", err)
		return errInternal("The hold for this request could not be computed."), false
	case errors.Is(err, balance.ErrGone), errors.Is(err, balance.ErrCold):
		return errUnavailable("The balance service is not ready; please retry.", m.cfg.RetryAfter), false
	case errors.Is(err, balance.ErrLedger):
		// A cold org whose snapshot (or catch-up) failed: nothing was reserved, and fail-open
		// must not serve it either, since fail-open only stands in for a hot balance that
		// Redis cannot give; here there is no balance at all to stand in for.
		return errUnavailable("The billing service is unavailable; please retry.", m.cfg.RetryAfter), false
	}
	if m.cfg.FailOpen && errors.Is(err, balance.ErrRedis) {
		return nil, true
	}
	// Redis trouble with fail-open off, or a failure nobody classified (a timeout while
	// waiting for a warm-up): 503, and a release in case a reserve committed unseen.
	return errUnavailable("The balance service is unavailable; please retry.", m.cfg.RetryAfter), true
}

// passes reports whether path is a PassThrough path.
func (m *middleware) passes(path string) bool {
	if m.pass[path] {
		return true
	}
	for _, d := range m.passDirs {
		if strings.HasPrefix(path, d) && len(path) > len(d) {
			return true
		}
	}
	return false
}

// modelField is the one top-level field routeUnpriced reads.
var modelField = newFieldSet("model")

// routeUnpriced routes a request passed unbilled whose body names a model
// (/v1/messages/count_tokens): Config.Route is asked for that model, and a rename is applied to
// the body as for a priced request. The model member is read by the same rules as a priced
// request's (one, exactly spelled), so the model routed is the one the upstream reads.
func (m *middleware) routeUnpriced(c echo.Context) *Error {
	req := c.Request()
	body, e := readBody(req, m.cfg.MaxRequestBytes)
	if e != nil {
		return e
	}
	if e := checkJSONObject(body); e != nil {
		return e
	}
	var model string
	var seen uint64
	forEachRaw(bstr(body), func(key, v string) bool {
		i, kc := modelField.check(key, &seen)
		switch kc {
		case keyUnknown:
			return true
		case keyVariant, keyDuplicate:
			e = keyError("", key, modelField.names[i], kc)
			return false
		}
		if s := rawString(v); rawKind(v) == '"' && s != "" {
			model = strings.Clone(s)
			return true
		}
		e = errInvalid("model", "'model' must be a non-empty string.")
		return false
	})
	if e != nil {
		return e
	}
	if model == "" {
		return &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Param: "model", Code: CodeMissingField,
			Message: "You must provide a model parameter."}
	}
	up, err := m.cfg.Route(c, model)
	if err != nil {
		return m.routeError(err)
	}
	if up != "" && up != model {
		body = setTopString(body, "model", up)
	}
	setBody(req, body)
	return nil
}

// routeError maps a failed Config.Route to a refusal.
func (m *middleware) routeError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	m.cfg.Logger.Warn("escrow: routing failed", "err", err)
	return errUnavailable("The routing service is unavailable; please retry.", m.cfg.RetryAfter)
}

func (m *middleware) identityError(err error) *Error {
	var e *Error
	switch {
	case errors.As(err, &e):
		return e
	case errors.Is(err, ledger.ErrUnknownKey):
		return &Error{Status: http.StatusUnauthorized, Type: TypeInvalidRequest, Code: CodeInvalidAPIKey,
			Message: "Incorrect API key provided."}
	}
	m.cfg.Logger.Warn("escrow: api key look-up failed", "err", err)
	return errUnavailable("The authentication service is unavailable; please retry.", m.cfg.RetryAfter)
}

// releaseLater releases a hold in the background, retrying with backoff until Redis answers or
// ReleaseRetryFor has passed.
func (m *middleware) releaseLater(org, holdID string, cause error) {
	m.retryLater(func(attempt int) (bool, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := m.cfg.Store.Release(ctx, org, holdID)
		cancel()
		if err == nil && attempt > 1 {
			m.cfg.Logger.Info("escrow: background release done", "hold_id", holdID, "org", org, "attempts", attempt)
		}
		return err == nil, err
	}, func(attempts int, err error) {
		m.cfg.Logger.Error("escrow: background release gave up; the reaper will release the hold",
			"hold_id", holdID, "org", org, "attempts", attempts, "err", err, "cause", cause)
	})
}

// retryLater calls try in the background, with backoff (50 ms doubling up to 5 s), until it is
// done or ReleaseRetryFor has passed; then gaveUp gets the attempts made and the last error.
func (m *middleware) retryLater(try func(attempt int) (done bool, err error), gaveUp func(attempts int, err error)) {
	go func() {
		deadline := time.Now().Add(m.cfg.ReleaseRetryFor)
		wait := 50 * time.Millisecond
		for attempt := 1; ; attempt++ {
			done, err := try(attempt)
			if done {
				return
			}
			if time.Now().Add(wait).After(deadline) {
				gaveUp(attempt, err)
				return
			}
			time.Sleep(wait)
			wait = min(2*wait, 5*time.Second)
		}
	}()
}

// release gives a hold back at once (upstream failure), falling back to releaseLater.
func (m *middleware) release(org, holdID string) {
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.ReserveTimeout)
	_, err := m.cfg.Store.Release(ctx, org, holdID)
	cancel()
	if err != nil {
		m.releaseLater(org, holdID, err)
	}
}

// readBody reads the whole body up to limit bytes.
func readBody(req *http.Request, limit int64) ([]byte, *Error) {
	tooLarge := &Error{Status: http.StatusRequestEntityTooLarge, Type: TypeInvalidRequest, Code: CodeRequestTooLarge,
		Message: "The request body is larger than the limit of " + strconv.FormatInt(limit, 10) + " bytes."}
	if req.ContentLength > limit {
		return nil, tooLarge
	}
	if req.Body == nil || req.Body == http.NoBody {
		return nil, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON, Message: "The request body is empty."}
	}
	var buf bytes.Buffer
	if req.ContentLength > 0 {
		buf.Grow(int(req.ContentLength) + 1)
	}
	n, err := buf.ReadFrom(io.LimitReader(req.Body, limit+1))
	_ = req.Body.Close()
	if n > limit {
		return nil, tooLarge
	}
	if err != nil {
		return nil, &Error{Status: http.StatusBadRequest, Type: TypeInvalidRequest, Code: CodeInvalidJSON, Message: "The request body could not be read."}
	}
	return buf.Bytes(), nil
}

// setBody gives the handler body as the request body.
func setBody(req *http.Request, body []byte) {
	req.Body = io.NopCloser(bytes.NewReader(body))
	req.ContentLength = int64(len(body))
	req.Header.Set("Content-Length", strconv.Itoa(len(body)))
	req.Header.Del("Transfer-Encoding")
	req.TransferEncoding = nil
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

func featureParam(f string) string {
	switch {
	case f == "audio":
		return "audio"
	case f == "image_output":
		return "modalities"
	case strings.HasPrefix(f, "service_tier:"):
		return "service_tier"
	case strings.HasPrefix(f, "tool:"):
		return "tools"
	case f == "mcp_servers", f == "container":
		return f
	case strings.HasPrefix(f, "cache_ttl:"):
		return "cache_control.ttl"
	case strings.HasPrefix(f, "inference_geo:"):
		return "inference_geo"
	case strings.HasPrefix(f, "beta:"):
		return "anthropic-beta"
	case strings.HasPrefix(f, "speed:"):
		return "speed"
	}
	return ""
}

// capParam names the request's cap field in a refusal: the first of the endpoint's that the
// body sends.
func capParam(body []byte, spec *endpoint.Spec) string {
	for _, k := range spec.CapFields {
		if bytes.Contains(body, []byte(`"`+k+`"`)) {
			return k
		}
	}
	return spec.FitField
}
