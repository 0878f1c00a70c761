package admin

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/ledger"
)

// webhooks is the ledger's webhook side: ledger.ErrNoWebhooks for a ledger without one (both of
// escrow's ledgers have it).
func (a *API) webhooks() (ledger.Webhooks, error) {
	if a.hooks == nil {
		return nil, ledger.ErrNoWebhooks
	}
	return a.hooks, nil
}

func (a *API) createWebhook(c echo.Context) error {
	var req struct {
		URL    string             `json:"url"`
		Events []ledger.EventType `json:"events"`
	}
	if err := bind(c, &req); err != nil || c.Response().Committed {
		return err
	}
	if a.checkWebhook != nil {
		if err := a.checkWebhook(req.URL); err != nil {
			return a.fail(c, fmt.Errorf("%w: %w", ledger.ErrInvalidWebhook, err))
		}
	}
	h, err := a.webhooks()
	if err != nil {
		return a.fail(c, err)
	}
	w, secret, err := h.CreateWebhook(c.Request().Context(), req.URL, req.Events)
	if err != nil {
		return a.fail(c, err)
	}
	return writeJSON(c, http.StatusCreated, NewWebhook{Webhook: w, Secret: secret})
}

func (a *API) listWebhooks(c echo.Context) error {
	h, err := a.webhooks()
	if err != nil {
		return a.fail(c, err)
	}
	ws, err := h.ListWebhooks(c.Request().Context())
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, ws, "", []string{"id", "url", "events", "created_at"}, func(w ledger.Webhook) []string {
		evs := make([]string, len(w.Events))
		for i, e := range w.Events {
			evs[i] = string(e)
		}
		return []string{w.ID, w.URL, strings.Join(evs, " "), ts(w.CreatedAt)}
	})
}

func (a *API) deleteWebhook(c echo.Context) error {
	h, err := a.webhooks()
	if err != nil {
		return a.fail(c, err)
	}
	if err := h.DeleteWebhook(c.Request().Context(), c.Param("id")); err != nil {
		return a.fail(c, err)
	}
	return c.NoContent(http.StatusNoContent)
}

func (a *API) listDeliveries(c echo.Context) error {
	q, err := listQuery(c)
	if err != nil {
		return invalid(c, err.Error())
	}
	h, err := a.webhooks()
	if err != nil {
		return a.fail(c, err)
	}
	p, err := h.ListDeliveries(c.Request().Context(), c.Param("id"), q)
	if err != nil {
		return a.fail(c, err)
	}
	return writeList(c, p.Data, p.Next,
		[]string{"id", "webhook_id", "event_id", "event_type", "org", "status", "attempts", "last_status", "last_error", "next_attempt_at", "delivered_at", "created_at"},
		func(d ledger.Delivery) []string {
			next, done := "", ""
			if d.NextAttemptAt != nil {
				next = ts(*d.NextAttemptAt)
			}
			if d.DeliveredAt != nil {
				done = ts(*d.DeliveredAt)
			}
			return []string{i64(d.ID), d.WebhookID, d.EventID, string(d.EventType), d.Org, string(d.Status), strconv.Itoa(d.Attempts),
				strconv.Itoa(d.LastStatus), d.LastError, next, done, ts(d.CreatedAt)}
		})
}

// setThreshold applies a PATCH's low_balance_threshold (raw JSON: an integer in micro-units, or
// null to clear it); it answers the 400 itself.
func (a *API) setThreshold(c echo.Context, raw json.RawMessage) error {
	var t *int64
	if !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		var v int64
		if err := json.Unmarshal(raw, &v); err != nil {
			return invalid(c, "low_balance_threshold must be an integer (micro-units) or null")
		}
		t = &v
	}
	h, err := a.webhooks()
	if err != nil {
		return a.fail(c, err)
	}
	if err := h.SetLowBalanceThreshold(c.Request().Context(), c.Param("org"), t); err != nil {
		return a.fail(c, err)
	}
	return nil
}
