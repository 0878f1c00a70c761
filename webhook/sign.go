// Package webhook delivers escrow's webhook events: a Sender claims due deliveries from the
// ledger's outbox (ledger.Webhooks), POSTs each one's JSON body, signed, to its endpoint, and
// records the outcome, retrying with exponential backoff and jitter up to a bound on attempts.
// Delivery is at least once: a receiver deduplicates by the event id header.
//
// Every request carries
//
//	Content-Type: application/json
//	X-Escrow-Event-Id: <uuid>          (the same on every attempt and every endpoint)
//	X-Escrow-Event-Type: balance.low | credit.received | key.revoked | limit.crossed
//	X-Escrow-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, t + "." + body)>
//
// like Stripe's signatures: Verify checks one (a receiver in Go may call it; any language can
// recompute it in a few lines).
package webhook

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Request headers.
const (
	HeaderSignature = "X-Escrow-Signature"
	HeaderEventID   = "X-Escrow-Event-Id"
	HeaderEventType = "X-Escrow-Event-Type"
	HeaderAttempt   = "X-Escrow-Attempt" // 1, 2, 3 … (informational)
)

// ErrBadSignature is returned by Verify for a missing, malformed, wrong or stale signature.
var ErrBadSignature = errors.New("webhook: bad signature")

// Sign returns the X-Escrow-Signature value of body sent at t with secret.
func Sign(secret string, t time.Time, body []byte) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	return "t=" + ts + ",v1=" + mac(secret, ts, body)
}

func mac(secret, ts string, body []byte) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(ts))
	m.Write([]byte("."))
	m.Write(body)
	return hex.EncodeToString(m.Sum(nil))
}

// Verify checks header (an X-Escrow-Signature value) against body and secret, and that its
// timestamp is within tolerance of now (0: no check). Any v1 value may match (several are
// allowed, as during a secret rotation).
func Verify(header, secret string, body []byte, tolerance time.Duration, now time.Time) error {
	var ts string
	var sigs []string
	for _, part := range strings.Split(header, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		switch {
		case !ok:
			return fmt.Errorf("%w: malformed", ErrBadSignature)
		case k == "t":
			ts = v
		case k == "v1":
			sigs = append(sigs, v)
		}
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || len(sigs) == 0 {
		return fmt.Errorf("%w: no timestamp or no v1", ErrBadSignature)
	}
	if d := now.Sub(time.Unix(sec, 0)); tolerance > 0 && (d > tolerance || d < -tolerance) {
		return fmt.Errorf("%w: timestamp %d outside the tolerance", ErrBadSignature, sec)
	}
	want := mac(secret, ts, body)
	for _, s := range sigs {
		if hmac.Equal([]byte(s), []byte(want)) {
			return nil
		}
	}
	return fmt.Errorf("%w: no v1 matches", ErrBadSignature)
}
