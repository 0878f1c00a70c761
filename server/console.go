package server

import (
	"fmt"
	"net/http"

	"github.com/labstack/echo/v4"

	"github.com/llmescrow/escrow/console"
)

// mountConsole serves the web console at /console/ (Config.Console). Its writes go to an admin
// API of its own, mounted on an Echo that serves nothing else (none without an admin token:
// then only customers log in).
func (s *Server) mountConsole(e *echo.Echo) error {
	var adm http.Handler
	if s.cfg.AdminToken != "" {
		ae := echo.New()
		if err := s.esc.MountAdmin(ae.Group(console.DefaultAdminPrefix)); err != nil {
			return fmt.Errorf("console: %w", err)
		}
		adm = ae
	}
	con, err := console.New(s.esc.Ops(), &console.Config{Admin: adm, Token: s.cfg.AdminToken, Logger: s.log})
	if err != nil {
		return err
	}
	con.Register(e.Group("/console"))
	return nil
}
