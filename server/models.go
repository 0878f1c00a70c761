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

// served lists the priced models that a route of the OpenAI style serves, in the ledger's
// order (by name). created is 0: the ledger keeps no creation time for a price.
func (s *Server) served(c echo.Context) ([]openAIModel, error) {
	ms, err := s.ops.Models(c.Request().Context())
	if err != nil {
		return nil, err
	}
	out := make([]openAIModel, 0, len(ms))
	for _, m := range ms {
		if u := s.routes.lookup(StyleOpenAI, m.Name); u != nil {
			out = append(out, openAIModel{ID: m.Name, Object: "model", OwnedBy: u.ownedBy})
		}
	}
	return out, nil
}

// listModels answers GET /v1/models: the models a client of this proxy can call — priced in
// the ledger and served by a route — in OpenAI's list shape. The middleware has authenticated
// the caller; nothing is held or billed. Every org may use every priced model, so the list is
// the same for all.
func (s *Server) listModels(c echo.Context) error {
	ms, err := s.served(c)
	if err != nil {
		return s.modelsUnavailable(c, err)
	}
	return c.JSON(http.StatusOK, struct {
		Object string        `json:"object"`
		Data   []openAIModel `json:"data"`
	}{"list", ms})
}

// getModel answers GET /v1/models/{id}: one model of the list, or 404 model_not_found.
func (s *Server) getModel(c echo.Context) error {
	id := strings.TrimPrefix(c.Request().URL.Path, "/v1/models/")
	ms, err := s.served(c)
	if err != nil {
		return s.modelsUnavailable(c, err)
	}
	for _, m := range ms {
		if m.ID == id {
			return c.JSON(http.StatusOK, m)
		}
	}
	return middleware.WriteError(c, &middleware.Error{Status: http.StatusNotFound, Type: middleware.TypeInvalidRequest, Param: "model", Code: middleware.CodeModelNotFound,
		Message: "The model '" + id + "' does not exist or you do not have access to it."})
}

func (s *Server) modelsUnavailable(c echo.Context, err error) error {
	s.log.Warn("model list: ledger unreachable", "err", err)
	return middleware.WriteError(c, &middleware.Error{Status: http.StatusServiceUnavailable, Type: middleware.TypeServiceUnavailable,
		Code: middleware.CodeServiceUnavailable, RetryAfter: time.Second, Message: "The model list is unavailable; please retry."})
}
