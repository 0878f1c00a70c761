package middleware

import (
	"errors"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/endpoint"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/pricing"
	"github.com/tidwall/gjson"
)

// Proven and free endpoints (issue 32; DESIGN.md "Endpoints"): images priced per image and
// speech priced per character are billed from what the request proves (endpoint.Spec.Prove),
// so the hold is exactly the charge and no usage is read from the answer (audio bytes, or
// images without usage); moderations are free (endpoint.Spec.Free): a zero hold, counted by
// the request limits, and a usage event of cost 0. Both are outside the cap property of
// FuzzSpecBound (they have no output cap): their property is hold = charge, tested over HTTP
// (proven_test.go).

// statedSets is the field set each proven or free spec reads (endpoint.Spec.StatedFields).
var statedSets = func() map[*endpoint.Spec]*fieldSet {
	out := map[*endpoint.Spec]*fieldSet{}
	for _, s := range endpoint.All() {
		if !s.Free && s.Prove == nil {
			continue
		}
		names := []string{"model", "stream"}
		if s.EndUserField != "" {
			names = append(names, s.EndUserField)
		}
		for _, f := range s.StatedFields {
			if !slices.Contains(names, f) {
				names = append(names, f)
			}
		}
		out[s] = newFieldSet(names...)
	}
	return out
}()

// parseStated reads a body of a proven or free endpoint: its model (the spec's default when
// absent), its end user, and the fields its price depends on (endpoint.Stated); then the units
// it bills (Request.Proof). Unknown fields are passed on: they do not change what the upstream
// bills for the stated units.
func parseStated(spec *endpoint.Spec, body []byte) (Request, *Error) {
	var st endpoint.Stated
	r, e := walkTop(spec, body, statedSets[spec], allPlain, func(p *reqParser, name string, kind byte, v string) {
		switch {
		case name == spec.EndUserField:
			p.endUser(name, v)
		case kind == 'n':
		case name == "n":
			st.N = p.positive(name, v)
		case name == "partial_images":
			if v != "0" {
				st.PartialImages = p.positive(name, v)
			}
		case name == "size" || name == "quality":
			if p.nullOr(name, v, shapeString) {
				if name == "size" {
					st.Size = strings.Clone(rawString(v))
				} else {
					st.Quality = strings.Clone(rawString(v))
				}
			}
		case name == "input" && kind == '"':
			st.HasInput = true
			st.Chars = int64(utf8.RuneCountInString(rawString(v)))
		}
	})
	if e != nil {
		return r, e
	}
	st.TextBytes = int64(len(body))
	return proveStated(spec, r, st)
}

// proveStated completes a proven or free request read from its body: the model (the spec's
// default when absent) and the units it bills (Request.Proof).
func proveStated(spec *endpoint.Spec, r Request, st endpoint.Stated) (Request, *Error) {
	if r.Model == "" {
		if spec.DefaultModel == "" {
			return r, errMissing("model", "You must provide a model parameter.")
		}
		r.Model = spec.DefaultModel
	}
	proof := pricing.Usage{}
	if spec.Prove != nil {
		st.Model, st.Stream = r.Model, r.Stream
		u, ref := spec.Prove(st)
		if ref != nil {
			return r, errInvalid(ref.Param, ref.Message)
		}
		proof = u
		r.Stated = &st
	}
	r.Proof = &proof
	return r, nil
}

// reprove makes the proof of a proven request again with its model's prices and settings,
// which choose how it is billed (endpoint.Stated.Prices): per image or by tokens.
func (m *middleware) reprove(r *Request, model ledger.Model) *Error {
	if r.Stated == nil || r.Spec.Prove == nil {
		return nil
	}
	st := *r.Stated
	st.Prices, st.ImageTokens, st.MaxOutputTokens = model.Prices, m.cfg.ImageTokens[model.Name], model.MaxOutputTokens
	st.ImageOutputTokens = m.cfg.ImageOutputTokens[model.Name]
	u, ref := r.Spec.Prove(st)
	if ref != nil {
		return errInvalid(ref.Param, ref.Message)
	}
	r.Proof = &u
	return nil
}

// serveProven holds what a proven request bills (0 for a free one: a zero hold, counted by the
// limits like any request) and serves it; finish charges the same (provenCharge).
func (m *middleware) serveProven(c echo.Context, next echo.HandlerFunc, id Identity, body []byte, r Request, o Outcome) error {
	req := c.Request()
	req.Header.Del(HeaderFit) // nothing to fit: the price is fixed by the request
	model := ledger.Model{Name: r.Model}
	var amount int64
	if !r.Spec.Free {
		var e *Error
		if model, _, e = m.priceModel(req.Context(), body, &r); e != nil {
			return m.refuse(c, o, e)
		}
		if e = m.reprove(&r, model); e != nil {
			return m.refuse(c, o, e)
		}
		if e = provenPriced(model, *r.Proof); e != nil {
			return m.refuse(c, o, e)
		}
		cost, err := model.Cost(*r.Proof)
		if err != nil || cost > balance.MaxAmount {
			return m.refuse(c, o, errInvalid("", "The price of this request is beyond what can be held."))
		}
		amount = cost
		defer m.useModel(req.Context(), r.Model)()
	}
	u, err := uuid.NewV7()
	if err != nil {
		return m.refuse(c, o, errInternal("No request id could be made."))
	}
	cl := &call{m: m, id: id, holdID: u.String(), req: r, model: model, holdAmount: amount, agreed: amount,
		limitKey: m.limitKey(id), start: o.began}
	if amount == 0 {
		cl.id.Exempt = true // a zero hold: limits, freezes and the in-flight cap, no money (exempt.go)
	}
	o.HoldID, o.HoldAmount = cl.holdID, amount
	// A token-billed proof (gpt-image, a transcription by tokens) is a token bound too: tokens
	// limits hold it; a proof of items, characters or seconds holds no tokens.
	res, err := m.reserve(req.Context(), cl, amount, r.Proof.Tokens())
	exemptHold(cl, &o, err)
	if err != nil {
		if e := m.provenRefusal(err, cl, model, amount, &o); e != nil {
			return m.refuse(c, o, e)
		}
	} else {
		cl.reserved = res
	}
	return cl.proxy(c, next, body, o)
}

// provenRefusal maps a failed reserve of a proven request to its refusal, as reserveHold does
// (no fit: the price is fixed); nil means fail-open: the request passes without a hold.
func (m *middleware) provenRefusal(err error, cl *call, model ledger.Model, amount int64, o *Outcome) *Error {
	o.Err = err
	if e := rateRefusal(err, time.Now()); e != nil {
		return e
	}
	if errors.Is(err, balance.ErrEndUserRequired) {
		p := m.endUserParam(cl.req)
		return errMissing(p, "This organization's end-user limits need the end user of every request: set '"+p+"'.")
	}
	if e := m.quotaRefusal(err, model, cl.req, fitPlan{}, amount); e != nil {
		return e
	}
	e, unknown := m.reserveError(err, amount)
	if unknown {
		m.releaseLater(cl.id.Org, cl.holdID, err)
	}
	if e != nil {
		return e
	}
	o.Err = nil
	cl.holdAmount, cl.failOpen = 0, true
	o.HoldAmount, o.FailOpen = 0, true
	m.cfg.Logger.Warn("escrow: fail-open: request passes without a hold", "hold_id", cl.holdID, "org", cl.id.Org, "err", err)
	return nil
}

// provenPriced refuses a proof with a class the model has no price for: never billed at
// another rate (a 400 naming the class, nothing held).
func provenPriced(model ledger.Model, proof pricing.Usage) *Error {
	for c := range proof.Units {
		if _, ok := model.Price(c); !ok {
			e := errInvalid(provenParam(c), "The model '"+model.Name+"' has no price for '"+string(c)+"' on this endpoint.")
			e.Status = http.StatusBadRequest
			return e
		}
	}
	return nil
}

// provenParam is the request field a class comes from, for a refusal.
func provenParam(c pricing.Class) string {
	if strings.HasPrefix(string(c), "per_image_") {
		return "size"
	}
	if c == pricing.Characters {
		return "model"
	}
	return ""
}

// provenCharge is what a proven request is charged: what it proved, at the prices it was held
// at (the upstream bills the stated units whether or not the client read the answer) — or,
// when its proof is a bound (fromAnswer), the usage its answer reports; an answer without a
// usage escrow can read and price is charged the bound, the hold (estimated).
func (cl *call) provenCharge(cw *captureWriter) (pricing.Usage, int64, bool) {
	u := *cl.req.Proof
	estimated := false
	if fromAnswer(cl.req.Spec, u) {
		if read, ok := answerUsage(cl.req.Spec, cw); ok && provenPriced(cl.model, read) == nil {
			if cost, err := cl.model.Cost(read); err == nil {
				return read, cost, false
			}
		}
		estimated = u.Tokens() > 0 // a token bound billed whole
	}
	cost, err := cl.model.Cost(u)
	if err != nil {
		cl.m.cfg.Logger.Error("escrow: proven usage could not be priced", "hold_id", cl.holdID, "usage", u, "err", err)
		return u, max(cl.agreed, 1), true
	}
	return u, cost, estimated
}

// fromAnswer reports whether a proven request is billed from its answer's usage: its spec
// reads one (endpoint.Spec.Usage) and its proof is a bound, not a count of items or characters
// fixed by the request (images per image, speech).
func fromAnswer(spec *endpoint.Spec, proof pricing.Usage) bool {
	if spec.Usage == nil {
		return false
	}
	for c := range proof.Units {
		if info, _ := pricing.Lookup(c); info.Unit == pricing.PerItem || info.Unit == pricing.PerMCharacters {
			return false
		}
	}
	return true
}

// answerUsage is the usage a proven request's JSON answer reports, read by its spec.
func answerUsage(spec *endpoint.Spec, cw *captureWriter) (pricing.Usage, bool) {
	var raw gjson.Result
	switch {
	case cw == nil:
		return pricing.Usage{}, false
	case cw.mode == modeJSON:
		r, ok := cw.scan.rawUsage()
		if !ok {
			return pricing.Usage{}, false
		}
		raw = r
	case cw.mode == modeSSE && cw.sse.usageRaw != nil && !cw.sse.upstreamError:
		raw = gjson.ParseBytes(cw.sse.usageRaw)
	default:
		return pricing.Usage{}, false
	}
	u, ok := spec.Usage(usageObject{raw})
	if !ok || u.Check() != nil {
		return pricing.Usage{}, false
	}
	return u, true
}

// usageObject is an answer's usage object for a spec's reader (endpoint.UsageObject): members
// matched as a client's decoder matches them (case folded, the last of duplicates).
type usageObject struct{ gjson.Result }

func (o usageObject) at(path string) gjson.Result {
	v := o.Result
	for name := range strings.SplitSeq(path, ".") {
		v = member(v, name)
	}
	return v
}

func (o usageObject) Count(path string, required bool) (int64, bool) {
	v := o.at(path)
	if !present(v) {
		return 0, !required
	}
	return tokenCount(v)
}

func (o usageObject) Ceil(path string) (int64, bool) {
	v := o.at(path)
	if v.Type != gjson.Number {
		return 0, false
	}
	f := v.Float()
	if !(f >= 0 && f <= maxTokens) {
		return 0, false
	}
	return int64(math.Ceil(f)), true
}

func (o usageObject) Has(path string) bool { return present(o.at(path)) }

func (o usageObject) String(path string) string {
	if v := o.at(path); v.Type == gjson.String {
		return v.String()
	}
	return ""
}
