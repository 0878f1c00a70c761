package server

import "fmt"

// The roles of a process (Config.Role, ESCROW_ROLE, -role; issue 36 "Two planes"): a fleet of
// proxies that hold no admin credential, and an admin process that serves only the admin API.
const (
	RoleAll   = "all"   // the proxy and, with ESCROW_ADMIN_TOKEN, the admin API (the default)
	RoleProxy = "proxy" // the proxy only: no admin routes are mounted, no admin token is needed
	RoleAdmin = "admin" // the admin API only (and the probes and metrics): no upstream is needed
)

func (c *Config) checkRole() error {
	switch c.Role {
	case "":
		c.Role = RoleAll
	case RoleAll, RoleProxy:
	case RoleAdmin:
		if c.AdminToken == "" {
			return fmt.Errorf("ESCROW_ROLE=admin needs ESCROW_ADMIN_TOKEN")
		}
	default:
		return fmt.Errorf("ESCROW_ROLE: want all, proxy or admin, got %q", c.Role)
	}
	return nil
}
