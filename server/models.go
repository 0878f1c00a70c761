package server

import (
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/llmescrow/escrow/middleware"
)

// openAIModel is one model in OpenAI's shape (GET /v1/models).
type openAIModel struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
}

// anthropicModel is one model in Anthropic's shape (GET /v1/models with anthropic-version).
type anthropicModel struct {
	Type        string `json:"type"`
	ID          string `json:"id"`
	DisplayName string `json:"display_name"`
	CreatedAt   string `json:"created_at"`
}

// servedModel is a priced model and the route that serves it.
type servedModel struct {
	name string
	up   *upstream
}

// served lists the priced models that a route of style serves, in the ledger's order (by
// name).
func (s *Server) served(c echo.Context, style Style) ([]servedModel, error) {
	ms, err := s.ops.Models(c.Request().Context())
	if err != nil {
		return nil, err
	}
	out := make([]servedModel, 0, len(ms))
	for _, m := range ms {
		if u := s.routes.lookup(style, m.Name); u != nil {
			out = append(out, servedModel{m.Name, u})
		}
	}
	return out, nil
}

// listStyle is the shape a model-list request asks for: Anthropic's when it carries
// anthropic-version (as Anthropic's SDKs send), else OpenAI's.
func listStyle(c echo.Context) Style {
	if c.Request().Header.Get("Anthropic-Version") != "" {
		return StyleAnthropic
	}
	return StyleOpenAI
}

// The ledger keeps no creation time for a price: OpenAI's created is 0 and Anthropic's
// created_at the Unix epoch.
const anthropicEpoch = "1970-01-01T00:00:00Z"

func (m servedModel) openAI() openAIModel {
	return openAIModel{ID: m.name, Object: "model", OwnedBy: m.up.ownedBy}
}

func (m servedModel) anthropic() anthropicModel {
	return anthropicModel{Type: "model", ID: m.name, DisplayName: m.name, CreatedAt: anthropicEpoch}
}

// listModels answers GET /v1/models: the models a client of this proxy can call — priced in
// the ledger and served by a route of the API style it speaks — in OpenAI's list shape, or
// Anthropic's for a request with anthropic-version. The middleware has authenticated the
// caller; nothing is held or billed. Every org may use every priced model, so the list is the
// same for all.
func (s *Server) listModels(c echo.Context) error {
	style := listStyle(c)
	ms, err := s.served(c, style)
	if err != nil {
		return s.modelsUnavailable(c, err)
	}
	if style == StyleAnthropic {
		data := make([]anthropicModel, len(ms))
		for i, m := range ms {
			data[i] = m.anthropic()
		}
		var first, last *string
		if len(data) > 0 {
			first, last = &data[0].ID, &data[len(data)-1].ID
		}
		return c.JSON(http.StatusOK, struct {
			Data    []anthropicModel `json:"data"`
			HasMore bool             `json:"has_more"`
			FirstID *string          `json:"first_id"`
			LastID  *string          `json:"last_id"`
		}{data, false, first, last})
	}
	data := make([]openAIModel, len(ms))
	for i, m := range ms {
		data[i] = m.openAI()
	}
	return c.JSON(http.StatusOK, struct {
		Object string        `json:"object"`
		Data   []openAIModel `json:"data"`
	}{"list", data})
}

// getModel answers GET /v1/models/{id}: one model of the list, or 404 (model_not_found, or
// Anthropic's not_found_error).
func (s *Server) getModel(c echo.Context) error {
	id := strings.TrimPrefix(c.Request().URL.Path, "/v1/models/")
	style := listStyle(c)
	ms, err := s.served(c, style)
	if err != nil {
		return s.modelsUnavailable(c, err)
	}
	for _, m := range ms {
		if m.name != id {
			continue
		}
		if style == StyleAnthropic {
			return c.JSON(http.StatusOK, m.anthropic())
		}
		return c.JSON(http.StatusOK, m.openAI())
	}
	msg := "The model '" + id + "' does not exist or you do not have access to it."
	if style == StyleAnthropic {
		return c.JSON(http.StatusNotFound, map[string]any{"type": "error", "error": map[string]string{"type": "not_found_error", "message": msg}})
	}
	return middleware.WriteError(c, &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest, Param: "model", Code: middleware.CodeModelNotFound,
		Message: msg})
}

func (s *Server) modelsUnavailable(c echo.Context, err error) error {
	s.log.Warn("model list: ledger unreachable", "err", err)
	return middleware.WriteError(c, &middleware.Error{Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable,
		Code: middleware.CodeServiceUnavailable, RetryAfter: time.Second, Message: "The model list is unavailable; please retry."})
}
