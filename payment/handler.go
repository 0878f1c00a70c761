package payment

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger"
)

// MaxEventBytes bounds a webhook's body (Stripe's events are a few KiB).
const MaxEventBytes = 1 << 20

// rejectedAuditPerMinute bounds how many refused (unsigned, forged, stale) deliveries a process
// records in the audit trail per minute: anyone can send them, and they must not fill the
// ledger. The rest are logged.
const rejectedAuditPerMinute = 60

// Handler answers one processor's webhooks: POST its events here (escrow's proxy mounts
// Stripe's at /webhooks/stripe). The answers are what the processor expects:
//
//   - 200 for every verified event, whatever it came to (credited, a duplicate, ignored, a
//     reference conflict): retrying it would change nothing;
//   - 400 for a missing, malformed or unknown signature, a stale timestamp or an unreadable
//     payload (nothing moves; Stripe shows the delivery as failed);
//   - 422 for a verified event whose org or currency is not known yet (retried by the
//     processor for days, so an operator can add the mapping or the rate);
//   - 503 when the ledger fails (retried).
//
// Every decision is recorded in the audit trail (actor: the processor's name).
func (p *Payments) Handler(proc Processor) echo.HandlerFunc {
	a := &auditor{p: p, actor: proc.Name(), action: "POST /webhooks/" + proc.Name()}
	return func(c echo.Context) error {
		r := c.Request()
		body, err := io.ReadAll(io.LimitReader(r.Body, MaxEventBytes+1))
		if err != nil || len(body) > MaxEventBytes {
			return a.answer(c, http.StatusBadRequest, Decision{Outcome: Rejected, Detail: "body unreadable or above 1 MiB"})
		}
		ev, err := proc.Verify(body, r.Header.Get)
		if err != nil {
			return a.answer(c, http.StatusBadRequest, Decision{Outcome: Rejected, Detail: err.Error()})
		}
		ctx := context.WithoutCancel(r.Context()) // a write that started finishes
		d, err := p.Apply(ctx, ev)
		status := http.StatusOK
		switch {
		case err == nil:
		case errors.Is(err, ErrUnresolved):
			status = http.StatusUnprocessableEntity
		case errors.Is(err, ledger.ErrLedgerUnavailable):
			status = http.StatusServiceUnavailable
		default:
			status = http.StatusServiceUnavailable
			p.log.Error("payment event failed", "event", ev.ID, "type", ev.Type, "err", err)
		}
		return a.answer(c, status, d)
	}
}

type auditor struct {
	p              *Payments
	actor, action  string
	mu             sync.Mutex
	minute         time.Time
	rejectedLogged int
}

// answer records the decision and answers it as JSON.
func (a *auditor) answer(c echo.Context, status int, d Decision) error {
	a.p.count(d.Outcome)
	ctx := context.WithoutCancel(c.Request().Context())
	detail := fmt.Sprintf("event %s (%s): %s", d.Event, d.Type, d.Outcome)
	if d.Amount != 0 {
		detail += fmt.Sprintf(" %d micro-units, reference %s, seq %d", d.Amount, d.Ref, d.Seq)
	}
	if d.Debt {
		detail += " [debt]"
	}
	if d.Detail != "" {
		detail += ": " + d.Detail
	}
	log := a.p.log.With("event", d.Event, "type", d.Type, "outcome", d.Outcome, "org", d.Org, "status", status)
	if d.Outcome == Rejected && d.Event == "" && !a.allowRejected() {
		log.Warn("payment webhook refused (audit trail rate-limited)", "detail", d.Detail)
	} else if _, err := a.p.ops.Ledger().RecordAudit(ctx, ledger.AuditRecord{
		Actor: a.actor, Action: a.action, Target: d.Org, Status: status, Detail: truncate(detail, 4096),
	}); err != nil {
		log.Error("payment audit record failed", "err", err)
	}
	log.Info("payment webhook", "amount", d.Amount, "reference", d.Ref, "debt", d.Debt)
	return c.JSON(status, d)
}

// allowRejected: whether another refused delivery may be recorded this minute.
func (a *auditor) allowRejected() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now().Truncate(time.Minute)
	if !now.Equal(a.minute) {
		a.minute, a.rejectedLogged = now, 0
	}
	a.rejectedLogged++
	return a.rejectedLogged <= rejectedAuditPerMinute
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
