package webhook

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"
)

// ErrAddressNotAllowed is wrapped by CheckURL's refusals and by the error of an attempt whose
// endpoint resolved to an address the policy refuses.
var ErrAddressNotAllowed = errors.New("webhook: endpoint address not allowed")

// The address policy (Config.AllowPrivate off): an endpoint is a public http or https URL
// without credentials. Names are resolved at each attempt and every address dialed is checked
// then (net.Dialer.Control), so a name that points inside later (DNS rebinding) is refused as
// well; redirects are never followed.

// nonPublic are the ranges beyond what netip's predicates name: "this network", shared
// address space (carrier-grade NAT), IETF protocol assignments, benchmarking, reserved and
// broadcast, and the IPv6 prefixes that embed an IPv4 address (NAT64, 6to4) or are reserved for
// documentation and discard.
var nonPublic = func() []netip.Prefix {
	var ps []netip.Prefix
	for _, s := range []string{"0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "240.0.0.0/4",
		"64:ff9b::/96", "64:ff9b:1::/48", "2002::/16", "100::/64", "2001:db8::/32"} {
		ps = append(ps, netip.MustParsePrefix(s))
	}
	return ps
}()

// publicAddr reports whether a may receive webhooks under the address policy: a global unicast
// address outside the private, shared and reserved ranges.
func publicAddr(a netip.Addr) bool {
	a = a.Unmap()
	if !a.IsValid() || !a.IsGlobalUnicast() || a.IsPrivate() {
		return false
	}
	for _, p := range nonPublic {
		if p.Contains(a) {
			return false
		}
	}
	return true
}

// CheckURL checks an endpoint's URL: absolute http or https, without user:pass@; and, unless
// allowPrivate, with a host that is not a loopback, unspecified, link-local, private or
// otherwise non-public address (as an IP literal or a "localhost" name). Other names are
// checked after resolution, at each attempt.
func CheckURL(rawURL string, allowPrivate bool) error {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: want an absolute http or https URL", ErrAddressNotAllowed)
	}
	if u.User != nil {
		return fmt.Errorf("%w: the URL carries credentials (user:pass@); put a token in its path or query, and check the signature", ErrAddressNotAllowed)
	}
	if allowPrivate {
		return nil
	}
	host := strings.ToLower(strings.TrimSuffix(u.Hostname(), "."))
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return fmt.Errorf("%w: %s is this machine (set ESCROW_WEBHOOK_ALLOW_PRIVATE to allow private addresses)", ErrAddressNotAllowed, host)
	}
	if a, err := netip.ParseAddr(host); err == nil && !publicAddr(a) {
		return fmt.Errorf("%w: %s is not a public address (set ESCROW_WEBHOOK_ALLOW_PRIVATE to allow private addresses)", ErrAddressNotAllowed, host)
	}
	return nil
}

// refusePrivate is a net.Dialer's Control: it refuses to connect to an address that is not
// public, after the name was resolved.
func refusePrivate(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("%w: cannot read the address %q", ErrAddressNotAllowed, address)
	}
	if !publicAddr(ap.Addr()) {
		return fmt.Errorf("%w: the endpoint resolved to %s, not a public address", ErrAddressNotAllowed, ap.Addr())
	}
	return nil
}

// defaultClient is Config.Client's default: no redirects followed (a 3xx is a failed attempt),
// no proxy from the environment (it would be dialed instead of the endpoint), and unless
// allowPrivate, only public addresses dialed.
func defaultClient(allowPrivate bool) *http.Client {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	if !allowPrivate {
		d.Control = refusePrivate
	}
	tr := &http.Transport{
		DialContext:           d.DialContext,
		ForceAttemptHTTP2:     true,
		MaxIdleConns:          100,
		IdleConnTimeout:       90 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ExpectContinueTimeout: time.Second,
	}
	return &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}
