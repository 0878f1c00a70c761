package middleware

import (
	"context"
	"net/http"
	"strconv"
	"strings"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger"
)

// The cost of each request, told to its client.
//
// A 2xx JSON response carries HeaderCost (the micro-units charged for the request: the priced
// usage, or the hold when its usage could not be read) and HeaderBalance (the org's available
// balance right after that charge: the request's hold finished, other requests' holds still
// counted). Both are known only once the usage is recorded, at the end of the body, so:
//
//   - a body of at most Config.MaxResponseBytes is already held whole until the record (so that
//     a failed record can still answer a clean error); they go out as headers with it. No
//     memory beyond that existing bound.
//   - a larger body (streamed as it comes, memory flat), or one in a coding escrow cannot read,
//     has its header sent before the cost is known: they are announced in a Trailer header and
//     sent as HTTP trailers after the body, and the body's Content-Length is dropped (an
//     HTTP/1.1 body with a length cannot carry trailers; it goes chunked instead).
//
// An event stream carries them only when the client asks with HeaderIncludeCost: true, as an
// SSE comment, a block of its own, right before the held-back end (`data: [DONE]`, or a
// terminal Responses event; right after that event when it was too long to keep whole, since
// only its tail was held; none when the stream has no such end):
//
//	: escrow {"cost":123,"balance":999877}
//
// A comment is skipped by every conforming SSE parser (the OpenAI SDKs drop lines starting
// with ':'; an `event: escrow` event would reach their callers as a bogus chunk), so a client
// that asked for it keeps working; without the header a stream is left as it was.
//
// HeaderBalance (and "balance") is left out whenever the balance after the charge is unknown:
// fail-open requests (no hot balance), a finish that failed or found the hold gone, a cold
// org, a Recorder whose Receipt has no balance (the default, or an *accounting.Recorder with no
// Finisher). Nothing is
// sent when the request is not charged (upstream errors) or its record failed.
const (
	HeaderCost        = "X-Escrow-Cost"
	HeaderBalance     = "X-Escrow-Balance"
	HeaderIncludeCost = "X-Escrow-Include-Cost"
)

// record records ev, with the balance after it when the Recorder can tell.
func (m *middleware) record(ctx context.Context, ev ledger.UsageEvent) (accounting.Receipt, error) {
	return m.cfg.Recorder.RecordReceipt(ctx, ev)
}

// costReceipt is what a recorded request was charged and the org's balance after it.
type costReceipt struct {
	cost    int64
	balance int64
	haveBal bool
}

// set writes the receipt into h (the header, or the declared trailers).
func (r costReceipt) set(h http.Header) {
	h.Set(HeaderCost, strconv.FormatInt(r.cost, 10))
	if r.haveBal {
		h.Set(HeaderBalance, strconv.FormatInt(r.balance, 10))
	} else {
		h.Del(HeaderBalance) // nothing the handler set survives
	}
}

// comment is the receipt as an SSE comment, a block of its own.
func (r costReceipt) comment() []byte {
	b := append(make([]byte, 0, 64), `: escrow {"cost":`...)
	b = strconv.AppendInt(b, r.cost, 10)
	if r.haveBal {
		b = append(b, `,"balance":`...)
		b = strconv.AppendInt(b, r.balance, 10)
	}
	return append(b, "}\n\n"...)
}

// wantsCost reports whether the client asked for the cost inside an event stream.
func wantsCost(h http.Header) bool {
	v, err := strconv.ParseBool(strings.ToLower(strings.TrimSpace(h.Get(HeaderIncludeCost)))) // any case
	return err == nil && v
}
