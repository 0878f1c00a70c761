package server

import (
	"cmp"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Config is the proxy's configuration. Every field but Logger has an environment variable and a
// flag of the same meaning (LoadConfig; `-h` lists them with their defaults); a flag beats the
// variable, the variable beats the default. DefaultConfig returns the defaults.
type Config struct {
	Addr     string
	RedisURL string
	// AdminRedisURL is the Redis URL of the admin plane's user (balance.ACLRules, `escrow
	// redis-acl`): the writes of limits, freezes, model versions, revocations and the epoch go
	// through it, RedisURL then being the data user's. Empty: RedisURL's user writes both
	// planes, except with RoleProxy, which then writes no admin key (balance.Config.DataOnly).
	AdminRedisURL  string
	DatabaseURL    string
	UpstreamURL    string
	UpstreamAPIKey string
	// AnthropicURL and AnthropicAPIKey: without a routes file, a catch-all anthropic-style
	// route (the Messages API's routes, /v1/messages and /v1/messages/count_tokens), its key
	// sent as x-api-key. Empty: those routes go to the in-process upstream when there is one (the
	// demo's fake serves both APIs), else every model is 404 there.
	AnthropicURL    string
	AnthropicAPIKey string
	RoutesFile      string
	AdminToken      string
	// Role is what this process serves: RoleAll (default), RoleProxy (the proxy only: no admin
	// routes, no admin token needed) or RoleAdmin (the admin API only: no upstream needed).
	Role string
	// Console serves the web console at /console/ (package console): operators log in with
	// the admin token, customers with an API key.
	Console     bool
	HoldTTL     time.Duration
	FailOpen    bool
	MaxInFlight int
	// EndUserFields bounds each org's limit counters in Redis: past it, end users' lifetime
	// counters are evicted and loaded again from the ledger (balance.Config.EndUserFields).
	EndUserFields   int
	Prefix          string
	Migrate         bool
	AllowEviction   bool
	MaxBodyBytes    int64
	DefaultHold     int64
	JournalDir      string
	JournalMaxBytes int64
	ReapGrace       time.Duration
	PinTTL          time.Duration
	// The job poller (background responses; package async): how long a claimed job is this
	// process's, and the pause between two polls of a job (doubling from min to max).
	JobLease, JobMinBackoff, JobMaxBackoff time.Duration
	SweepInterval                          time.Duration
	PassInterval                           time.Duration
	ReapInterval                           time.Duration
	ScanInterval                           time.Duration
	ReconcileEvery                         time.Duration
	ReplayInterval                         time.Duration
	ShutdownTimeout                        time.Duration
	LogLevel                               string
	LogFormat                              string
	DemoBalance                            int64
	BenchBaseline                          bool
	Coalesce                               bool
	PprofAddr                              string
	RecordTimeout                          time.Duration
	ReserveTimeout                         time.Duration
	KeyCacheTTL                            time.Duration
	KeyMaxStale                            time.Duration
	KeyFailures                            int

	// RedisWaitReplicas > 0: each reserve waits (Redis WAIT, RedisWaitTimeout at most) until
	// that many replicas acknowledged its hold, else 503 (balance.Config.WaitReplicas;
	// docs/failover.md).
	RedisWaitReplicas int64
	RedisWaitTimeout  time.Duration

	// The customer views (server/view.go, issue 34): their Postgres pool's size and statement
	// timeout, and each key's token bucket (ViewRate a second, ViewBurst at most; 0: no limit).
	ViewConns   int
	ViewTimeout time.Duration
	ViewRate    int64
	ViewBurst   int
	// TrustedProxies are the proxies (CIDRs, comma-separated) whose X-Forwarded-For is read for
	// the client's address; empty: the connection's address is the client's.
	TrustedProxies string

	// ReadOn bounds how long the upstream is read on after the client hung up, for the real
	// usage; past it the upstream call is cut and the request charged an estimate (docs/failure-policy.md "What
	// a hang-up and an upstream error cost").
	ReadOn time.Duration

	// Fit (docs/failure-policy.md "What a request holds"): a request whose bound does not fit is served with a
	// lower output cap, at least FitMinOutput tokens; FitChatField is the cap field added to a
	// chat completion that has none.
	Fit          bool
	FitMinOutput int64
	FitChatField string

	// End users (limits of scope end_user, usage by end user): the header that names them in
	// place of the body's user field (empty: the body), and whether every request must name one.
	EndUserHeader  string
	RequireEndUser bool

	// Webhook deliveries (package webhook).
	WebhookTimeout     time.Duration
	WebhookMaxAttempts int
	// WebhookAllowPrivate lets webhook endpoints be on private, loopback and link-local
	// addresses.
	WebhookAllowPrivate bool

	// Payments and auto top-up (package payment, docs/payments.md).
	StripeWebhookSecrets  string
	StripeTolerance       time.Duration
	StripeFreezeOnDispute bool
	StripeAPIKey          string
	StripeAPIURL          string
	PaymentRates          string

	// The client-facing HTTP server's timeouts (see newHTTPServer).
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration

	// UpstreamRequestHeaders and UpstreamResponseHeaders are the headers that cross the proxy
	// besides the ones that always do: comma-separated names, a trailing * makes a prefix,
	// "none" is the empty list (see headers.go).
	UpstreamRequestHeaders  string
	UpstreamResponseHeaders string
	// UpstreamRateLimit is what becomes of the upstream's x-ratelimit-* headers: "drop" (the
	// client sees escrow's only) or "rename" (kept as x-upstream-ratelimit-*).
	UpstreamRateLimit string

	// Logger receives the server's logs; nil: one built from LogLevel and LogFormat, on stderr.
	Logger *slog.Logger

	// limitClock shifts the clock of the limit windows (balance.Config.ClockOffset): tests
	// only, to run a per-minute burst inside one minute.
	limitClock time.Duration
	// voidTimeout is the middleware's VoidTimeout (0: RecordTimeout): tests only, so that a
	// record that certainly times out (a stalled ledger) is followed by a void with time to spare.
	voidTimeout time.Duration
}

type setting struct {
	env, flag, def, help string
	set                  func(string) error
}

// settings is every setting of the proxy — env var, flag, default, help, parser — as one table,
// read top to bottom by LoadConfig, the usage text and the redacted startup log.
func (c *Config) settings() []setting {
	return []setting{
		{"ESCROW_ADDR", "addr", "127.0.0.1:8080", "listen address", str(&c.Addr)},
		{"REDIS_URL", "redis-url", "", "Redis URL (redis:// or rediss:// with verified TLS); comma-separated URLs mean a Redis Cluster; empty: embedded miniredis (examples/proxy only; required by escrow serve)", str(&c.RedisURL)},
		{"ESCROW_ADMIN_REDIS_URL", "admin-redis-url", "", "Redis URL of the admin plane's user (escrow redis-acl): limits, freezes, model versions, key revocations and the ledger epoch are written through it, REDIS_URL being the data user's; empty: REDIS_URL writes both, except with -role proxy, which writes no admin key (it needs no admin credential)", str(&c.AdminRedisURL)},
		{"DATABASE_URL", "database-url", "", "PostgreSQL URL for the ledger; empty: in-memory ledger (only with embedded Redis, examples/proxy)", str(&c.DatabaseURL)},
		{"UPSTREAM_URL", "upstream-url", "", "OpenAI-compatible upstream base URL (e.g. https://api.openai.com); empty: built-in fake upstream (examples/proxy only; required by escrow serve)", str(&c.UpstreamURL)},
		{"UPSTREAM_API_KEY", "upstream-api-key", "", "API key sent to the upstream (clients' keys are never forwarded)", str(&c.UpstreamAPIKey)},
		{"ESCROW_ANTHROPIC_URL", "anthropic-url", "", "Anthropic Messages API upstream base URL (e.g. https://api.anthropic.com) for /v1/messages: a catch-all anthropic-style route (without ESCROW_ROUTES_FILE); empty: those routes answer 404 (the demo's fake serves them)", str(&c.AnthropicURL)},
		{"ESCROW_ANTHROPIC_API_KEY", "anthropic-api-key", "", "API key sent to the Anthropic upstream as x-api-key (clients' keys are never forwarded)", str(&c.AnthropicAPIKey)},
		{"ESCROW_ROUTES_FILE", "routes-file", "", "JSON file of upstream routes by model ({\"routes\":[{\"model\" or \"prefix\", \"upstream\", \"api_key_env\" or \"api_key\", \"style\": openai|anthropic, \"rename\"}]}); replaces UPSTREAM_URL and ESCROW_ANTHROPIC_URL; empty: UPSTREAM_URL serves every model (and ESCROW_ANTHROPIC_URL every Messages API model)", str(&c.RoutesFile)},
		{"ESCROW_ADMIN_TOKEN", "admin-token", "", "bearer token of the admin API; empty: admin API off (the embedded demo generates one)", str(&c.AdminToken)},
		{"ESCROW_ROLE", "role", "all", "what this process serves: all, proxy (no admin routes; no admin token needed) or admin (the admin API only; no upstream needed)", str(&c.Role)},
		{"ESCROW_CONSOLE", "console", "true", "serve the web console at /console/ (operators log in with the admin token, customers with an API key); false: off", boolean(&c.Console)},
		{"ESCROW_HOLD_TTL", "hold-ttl", "10m", "hold expiry; extended every third of it while a request runs", dur(&c.HoldTTL)},
		{"ESCROW_FAIL_OPEN", "fail-open", "false", "when Redis is down, serve requests without a hold (their usage is still billed)", boolean(&c.FailOpen)},
		{"ESCROW_MAX_IN_FLIGHT", "max-in-flight", "256", "per-org cap on requests in flight (429 rate_limit_exceeded beyond it)", intp(&c.MaxInFlight)},
		{"ESCROW_PREFIX", "prefix", "esc", "Redis key namespace", str(&c.Prefix)},
		{"ESCROW_MIGRATE", "migrate", "true", "apply database migrations at start", boolean(&c.Migrate)},
		{"ESCROW_ALLOW_EVICTION", "allow-eviction", "false", "start even if Redis maxmemory-policy is not noeviction (unsafe: eviction can lose holds)", boolean(&c.AllowEviction)},
		{"ESCROW_MAX_BODY_BYTES", "max-body-bytes", "4194304", "largest request body accepted", integer(&c.MaxBodyBytes, 1)},
		{"ESCROW_DEFAULT_HOLD", "default-hold", "0", "hold (micro-units) for a priced model with nothing better known; 0: the model's own default", integer(&c.DefaultHold, 0)},
		{"ESCROW_JOURNAL_DIR", "journal-dir", JournalAuto, "directory (on persistent storage) of the local usage journal that keeps usage billed while Postgres is down or slow; auto: journal-<ledger id> under $STATE_DIRECTORY, else $XDG_STATE_HOME/escrow, else ~/.local/state/escrow (a temporary one for the in-memory demo ledger); off: none (logged at start)", str(&c.JournalDir)},
		{"ESCROW_JOURNAL_MAX_BYTES", "journal-max-bytes", "67108864", "size cap of the local journal; new holds are refused (503) when less than a tenth of it is free", integer(&c.JournalMaxBytes, 1)},
		{"ESCROW_JOURNAL_REPLAY_INTERVAL", "journal-replay-interval", "1s", "how often a non-empty journal is replayed into the ledger", dur(&c.ReplayInterval)},
		{"ESCROW_REAP_GRACE", "reap-grace", "1m", "a hold past its expiry is reaped only after this grace (keep it above the record timeout)", dur(&c.ReapGrace)},
		{"ESCROW_JOB_LEASE", "job-lease", "1m", "how long a background job claimed by this process is its own; a crashed process's jobs pass to another after it", dur(&c.JobLease)},
		{"ESCROW_JOB_MIN_BACKOFF", "job-min-backoff", "2s", "the first pause between two polls of a background job (doubling)", dur(&c.JobMinBackoff)},
		{"ESCROW_JOB_MAX_BACKOFF", "job-max-backoff", "1m", "the longest pause between two polls of a background job", dur(&c.JobMaxBackoff)},
		{"ESCROW_PIN_TTL", "pin-ttl", "24h", "how far a journaled request's hold is pinned (renewed every quarter of it); at least 4× the hold TTL", dur(&c.PinTTL)},
		{"ESCROW_SWEEP_INTERVAL", "sweep-interval", "2s", "how often the worker looks for unsettled orgs without a notification", dur(&c.SweepInterval)},
		{"ESCROW_PASS_INTERVAL", "pass-interval", "100ms", "the least time between two accounting passes of the worker under load (longer: fewer, larger passes and less CPU per request, a longer settle lag)", dur(&c.PassInterval)},
		{"ESCROW_REAP_INTERVAL", "reap-interval", "5s", "how often the holds of the orgs this process served are reaped", dur(&c.ReapInterval)},
		{"ESCROW_SCAN_INTERVAL", "scan-interval", "1m", "how often a rate-limited SCAN looks for expired holds of dead processes", dur(&c.ScanInterval)},
		{"ESCROW_RECONCILE_INTERVAL", "reconcile-interval", "1m", "how often every warm org is checked against the ledger (drift repair)", dur(&c.ReconcileEvery)},
		{"ESCROW_SHUTDOWN_TIMEOUT", "shutdown-timeout", "30s", "how long shutdown waits for in-flight requests", dur(&c.ShutdownTimeout)},
		{"ESCROW_LOG_LEVEL", "log-level", "info", "debug, info, warn or error", str(&c.LogLevel)},
		{"ESCROW_LOG_FORMAT", "log-format", "text", "text or json", str(&c.LogFormat)},
		{"ESCROW_DEMO_BALANCE", "demo-balance", "10000000", "balance (micro-units) of the demo org created by the embedded default (examples/proxy)", integer(&c.DemoBalance, 0)},
		{"ESCROW_BENCH_BASELINE", "bench-baseline", "false", "benchmarks only: proxy without the middleware (requests pass unbilled)", boolean(&c.BenchBaseline)},
		{"ESCROW_COALESCE", "coalesce", "true", "send reserves that arrive while others are in flight as one Redis pipeline (false: each reserve its own round trip; never with the embedded Redis)", boolean(&c.Coalesce)},
		{"ESCROW_WEBHOOK_TIMEOUT", "webhook-timeout", "10s", "bound on one webhook delivery attempt (connect, send, answer)", dur(&c.WebhookTimeout)},
		{"ESCROW_WEBHOOK_ALLOW_PRIVATE", "webhook-allow-private", "false", "let webhook endpoints be on loopback, link-local (169.254.169.254), private and other non-public addresses; off: refused when created and, after DNS resolution, at every attempt", boolean(&c.WebhookAllowPrivate)},
		{"ESCROW_STRIPE_WEBHOOK_SECRETS", "stripe-webhook-secrets", "", "Stripe webhook signing secrets (whsec_…, comma-separated: several while one is rolled); set: POST /webhooks/stripe turns signed payments into credits (docs/payments.md)", str(&c.StripeWebhookSecrets)},
		{"ESCROW_STRIPE_TOLERANCE", "stripe-tolerance", "5m", "how old a Stripe signature's timestamp may be", dur(&c.StripeTolerance)},
		{"ESCROW_STRIPE_FREEZE_ON_DISPUTE", "stripe-freeze-on-dispute", "false", "freeze an org when a dispute of one of its payments is opened", boolean(&c.StripeFreezeOnDispute)},
		{"ESCROW_STRIPE_API_KEY", "stripe-api-key", "", "Stripe secret key for auto top-ups (PaymentIntents); empty: no auto top-up", str(&c.StripeAPIKey)},
		{"ESCROW_STRIPE_API_URL", "stripe-api-url", "", "Stripe API base URL; empty: Stripe's own (tests point it at a local fake)", str(&c.StripeAPIURL)},
		{"ESCROW_PAYMENT_RATES", "payment-rates", "", "micro-units credited per smallest unit of each currency, comma-separated (usd=10000: a cent is 10,000 micro-units); a payment in a currency not listed is not credited", str(&c.PaymentRates)},
		{"ESCROW_WEBHOOK_MAX_ATTEMPTS", "webhook-max-attempts", "12", "attempts after which a webhook delivery is marked failed (retries back off from 5s, doubling, up to 1h, with jitter)", intp(&c.WebhookMaxAttempts)},
		{"ESCROW_RECORD_TIMEOUT", "record-timeout", "15s", "bound on recording a request's usage; past it the event is voided and the client gets 503, unless it was stored (then the request completes)", dur(&c.RecordTimeout)},
		{"ESCROW_READ_ON", "read-on", "2m", "after a client hangs up, how long the upstream is read on for the real usage; past it the call is cut and the request charged an estimate (a bounded request its hold, any other its input bound plus what was streamed)", dur(&c.ReadOn)},
		{"ESCROW_FIT", "fit", "on", "on: a request whose bound (its output cap, or the model's max output, at the output price) does not fit the balance or a limit's room is served with the largest output cap that fits (x-escrow-output-cap); off: it is refused", onOff(&c.Fit)},
		{"ESCROW_FIT_MIN_OUTPUT", "fit-min-output", "256", "the smallest output cap fit serves; below it the request is refused with the numbers", integer(&c.FitMinOutput, 1)},
		{"ESCROW_FIT_CHAT_FIELD", "fit-chat-field", "max_completion_tokens", "the cap field fit adds to a chat completion that has none: max_completion_tokens, or max_tokens for an upstream that knows only that", oneOf(&c.FitChatField, "max_completion_tokens", "max_tokens")},
		{"ESCROW_END_USER_HEADER", "end-user-header", "", "the request header that names the end user (limits of scope end_user, usage by end user), for a gateway in front of escrow that knows its users; empty: the body's OpenAI user field or Anthropic metadata.user_id", str(&c.EndUserHeader)},
		{"ESCROW_END_USER_FIELDS", "end-user-fields", "100000", "the most limit counters an org keeps in Redis before the lifetime counters of end users who have not come back for a while are evicted (each is loaded again from the ledger on its end user's next request; about 110 bytes a field, docs/limits.md)", intp(&c.EndUserFields)},
		{"ESCROW_REQUIRE_END_USER", "require-end-user", "false", "refuse (400, nothing held) a priced request that names no end user; false: it is served and counted by no end-user limit", boolean(&c.RequireEndUser)},
		{"ESCROW_REDIS_WAIT_REPLICAS", "redis-wait-replicas", "0", "each reserve waits until this many Redis replicas acknowledged its hold (WAIT, in the reserve's pipeline) and is refused with 503 (hold released) when they did not within the wait timeout: no hold a client was told passed is lost by a failover to such a replica, at the cost of a replica round trip per reserve (docs/failover.md); 0: off (replication asynchronous)", integer(&c.RedisWaitReplicas, 0)},
		{"ESCROW_REDIS_WAIT_TIMEOUT", "redis-wait-timeout", "100ms", "with ESCROW_REDIS_WAIT_REPLICAS, how long a reserve waits for the replicas", dur(&c.RedisWaitTimeout)},
		{"ESCROW_RESERVE_TIMEOUT", "reserve-timeout", "1s", "bound on a request's reserve call to Redis; past it the client gets 503 and the hold, if it was taken unseen, is released", dur(&c.ReserveTimeout)},
		{"ESCROW_KEY_CACHE_TTL", "key-cache-ttl", "5s", "how long an API key look-up is trusted; a revoked key stops within it, also while Postgres is down (revocations go through Redis)", dur(&c.KeyCacheTTL)},
		{"ESCROW_KEY_MAX_STALE", "key-max-stale", "10m", "while Postgres is down, a known key keeps working for this long after its last look-up (unless revoked)", dur(&c.KeyMaxStale)},
		{"ESCROW_VIEW_CONNS", "view-conns", "3", "Postgres connections of the customer views' own pool (GET /api/v1/key, /api/v1/credits, /dashboard/billing/…), apart from the request path's", intp(&c.ViewConns)},
		{"ESCROW_VIEW_TIMEOUT", "view-timeout", "2s", "statement timeout of a customer view's read (503 past it)", dur(&c.ViewTimeout)},
		{"ESCROW_VIEW_RATE", "view-rate", "5", "customer view calls per second per API key (token bucket, in each process); beyond the burst 429 rate_limit_exceeded with Retry-After; 0: no limit", integer(&c.ViewRate, 0)},
		{"ESCROW_VIEW_BURST", "view-burst", "10", "customer view calls one API key may make at once before ESCROW_VIEW_RATE applies", intp(&c.ViewBurst)},
		{"ESCROW_KEY_FAILURES_PER_MINUTE", "key-failures-per-minute", "20", "unknown API keys one client IP may present per minute (429 beyond it; a key that exists is always served)", intp(&c.KeyFailures)},
		{"ESCROW_TRUSTED_PROXIES", "trusted-proxies", "", "comma-separated CIDRs (or addresses) of the load balancers and proxies in front of escrow: X-Forwarded-For is read for the client's address only when the connection comes from one of them; empty: the connection's address is the client's", cidrList(&c.TrustedProxies)},
		{"ESCROW_PPROF_ADDR", "pprof-addr", "", "profiling only: serve net/http/pprof on this address (keep it on loopback); empty: off", str(&c.PprofAddr)},
		{"ESCROW_READ_HEADER_TIMEOUT", "read-header-timeout", "10s", "how long a client may take to send a request's headers", dur(&c.ReadHeaderTimeout)},
		{"ESCROW_READ_TIMEOUT", "read-timeout", "60s", "how long a client may take to send a whole request, body included (a slow or missing body is cut off)", dur(&c.ReadTimeout)},
		{"ESCROW_WRITE_TIMEOUT", "write-timeout", "60s", "how long one write to the client may block; renewed at every write, so a stream runs as long as the client reads", dur(&c.WriteTimeout)},
		{"ESCROW_IDLE_TIMEOUT", "idle-timeout", "120s", "how long a keep-alive connection may wait for its next request", dur(&c.IdleTimeout)},
		{"ESCROW_UPSTREAM_REQUEST_HEADERS", "upstream-request-headers", defaultRequestHeaders, "client request headers passed to the upstream besides Content-Type (comma-separated, Name* is a prefix, none: no other); credentials, cookies, OpenAI-Organization/-Project, Expect, X-Escrow-* and hop-by-hop headers never pass", headerList(&c.UpstreamRequestHeaders, neverRequestHeaders)},
		{"ESCROW_UPSTREAM_RATELIMIT", "upstream-ratelimit", "drop", "the upstream's x-ratelimit-* headers (the operator's own quota with the provider): drop — the client sees one set, escrow's (its key's requests and tokens limits) — or rename to x-upstream-ratelimit-*", oneOf(&c.UpstreamRateLimit, "drop", "rename")},
		{"ESCROW_UPSTREAM_RESPONSE_HEADERS", "upstream-response-headers", defaultResponseHeaders, "upstream response headers passed to the client besides Content-Type, -Length and -Encoding (comma-separated, Name* is a prefix, none: no other); Server, Set-Cookie, OpenAI-Organization/-Project, X-Escrow-* and hop-by-hop headers never pass", headerList(&c.UpstreamResponseHeaders, neverResponseHeaders)},
	}
}

// The parsers of the table: each checks a value and stores it in its field.

func str(p *string) func(string) error { return func(v string) error { *p = v; return nil } }

// parsed stores parse(v) in *p, or says what was wanted when parse does not accept v.
func parsed[T any](p *T, want string, parse func(string) (T, bool)) func(string) error {
	return func(v string) error {
		x, ok := parse(v)
		if !ok {
			return fmt.Errorf("want %s, got %q", want, v)
		}
		*p = x
		return nil
	}
}

func dur(p *time.Duration) func(string) error {
	return parsed(p, "a positive Go duration such as 10m", func(v string) (time.Duration, bool) {
		d, err := time.ParseDuration(v)
		return d, err == nil && d > 0
	})
}

// onOff reads on/off (or a boolean).
func onOff(p *bool) func(string) error {
	return parsed(p, "on or off", func(v string) (bool, bool) {
		switch strings.ToLower(v) {
		case "on":
			return true, true
		case "off":
			return false, true
		}
		b, err := strconv.ParseBool(v)
		return b, err == nil
	})
}

// oneOf reads one of the values given.
func oneOf(p *string, values ...string) func(string) error {
	return parsed(p, strings.Join(values, " or "), func(v string) (string, bool) { return v, slices.Contains(values, v) })
}

func boolean(p *bool) func(string) error {
	return parsed(p, "true or false", func(v string) (bool, bool) {
		b, err := strconv.ParseBool(v)
		return b, err == nil
	})
}

func integer(p *int64, min int64) func(string) error {
	return parsed(p, fmt.Sprintf("an integer ≥ %d", min), func(v string) (int64, bool) {
		n, err := strconv.ParseInt(v, 10, 64)
		return n, err == nil && n >= min
	})
}

func intp(p *int) func(string) error {
	return parsed(p, "a positive integer", func(v string) (int, bool) {
		n, err := strconv.Atoi(v)
		return n, err == nil && n >= 1
	})
}

func cidrList(p *string) func(string) error {
	return func(v string) error {
		if _, err := parseCIDRs(v); err != nil {
			return err
		}
		*p = v
		return nil
	}
}

// parseCIDRs reads a comma-separated list of CIDRs; a bare address is a range of one.
func parseCIDRs(v string) ([]*net.IPNet, error) {
	var out []*net.IPNet
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !strings.Contains(f, "/") {
			ip := net.ParseIP(f)
			if ip == nil {
				return nil, fmt.Errorf("want CIDRs such as 10.0.0.0/8 or addresses, got %q", f)
			}
			bits := 128
			if ip.To4() != nil {
				ip, bits = ip.To4(), 32
			}
			out = append(out, &net.IPNet{IP: ip, Mask: net.CIDRMask(bits, bits)})
			continue
		}
		_, n, err := net.ParseCIDR(f)
		if err != nil {
			return nil, fmt.Errorf("want CIDRs such as 10.0.0.0/8 or addresses, got %q", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func headerList(p *string, never []string) func(string) error {
	return func(v string) error {
		if _, err := parseHeaderList(v, never); err != nil {
			return err
		}
		*p = v
		return nil
	}
}

// DefaultConfig returns the documented defaults (what LoadConfig gives with no variable and no
// flag set).
func DefaultConfig() *Config {
	c := &Config{}
	for _, s := range c.settings() {
		if err := s.set(s.def); err != nil {
			panic(fmt.Sprintf("server: default of %s: %v", s.env, err)) // a typo in the table above
		}
	}
	return c
}

// LoadConfig reads the defaults, then the environment (getenv), then the flags in args; usage
// (for -h and flag errors) goes to usageOut under the command name name. -h returns an error
// wrapping flag.ErrHelp.
func LoadConfig(name string, args []string, getenv func(string) string, usageOut io.Writer) (*Config, error) {
	c := DefaultConfig()
	settings := c.settings()
	for _, s := range settings {
		if v, ok := lookup(getenv, s.env); ok {
			if err := s.set(v); err != nil {
				return nil, fmt.Errorf("%w: %s: %w", ErrConfig, s.env, err)
			}
		}
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(usageOut)
	fs.Usage = func() {
		fmt.Fprintf(usageOut, "escrow proxy: an OpenAI-compatible proxy that holds prepaid balance before each request.\n\n")
		fmt.Fprintf(usageOut, "Usage: %s [flags]\n\nEvery flag has an environment variable; a flag beats the variable.\n\n", name)
		for _, s := range settings {
			def := s.def
			if def == "" {
				def = `""`
			}
			fmt.Fprintf(usageOut, "  -%s (%s, default %s)\n      %s\n", s.flag, s.env, def, s.help)
		}
	}
	for _, s := range settings {
		fs.Func(s.flag, s.help, s.set)
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("server: invalid configuration")

// validate checks what no single setting can check alone.
func (c *Config) validate() error {
	if err := c.check(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return nil
}

func (c *Config) check() error {
	if err := c.checkRole(); err != nil {
		return err
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		return fmt.Errorf("ESCROW_LOG_FORMAT: want text or json, got %q", c.LogFormat)
	}
	if _, err := parseLevel(c.LogLevel); err != nil {
		return err
	}
	if c.DatabaseURL == "" && c.RedisURL != "" {
		return errors.New("the in-memory ledger only pairs with the embedded Redis: set DATABASE_URL or unset REDIS_URL")
	}
	if c.RedisURL == "" && c.RedisWaitReplicas > 0 {
		return errors.New("ESCROW_REDIS_WAIT_REPLICAS: the embedded Redis has no replicas to wait for; set REDIS_URL or unset it")
	}
	if c.ReadHeaderTimeout > c.ReadTimeout {
		return fmt.Errorf("ESCROW_READ_HEADER_TIMEOUT (%s) must not exceed ESCROW_READ_TIMEOUT (%s), which bounds the whole request", c.ReadHeaderTimeout, c.ReadTimeout)
	}
	for _, h := range []struct {
		env, v string
		never  []string
	}{
		{"ESCROW_UPSTREAM_REQUEST_HEADERS", c.UpstreamRequestHeaders, neverRequestHeaders},
		{"ESCROW_UPSTREAM_RESPONSE_HEADERS", c.UpstreamResponseHeaders, neverResponseHeaders},
	} {
		if _, err := parseHeaderList(h.v, h.never); err != nil {
			return fmt.Errorf("%s: %w", h.env, err)
		}
	}
	if _, err := parseCIDRs(c.TrustedProxies); err != nil {
		return fmt.Errorf("ESCROW_TRUSTED_PROXIES: %w", err)
	}
	if c.RoutesFile != "" && c.UpstreamURL != "" {
		return errors.New("set ESCROW_ROUTES_FILE or UPSTREAM_URL, not both (a route with \"prefix\": \"\" serves every other model)")
	}
	if c.RoutesFile != "" && c.AnthropicURL != "" {
		return errors.New("set ESCROW_ROUTES_FILE or ESCROW_ANTHROPIC_URL, not both (a route with \"style\": \"anthropic\", \"prefix\": \"\" serves every other Messages API model)")
	}
	if c.UpstreamURL != "" && c.UpstreamAPIKey == "" {
		return errors.New("UPSTREAM_URL is set but UPSTREAM_API_KEY is empty")
	}
	if c.AnthropicURL != "" && c.AnthropicAPIKey == "" {
		return errors.New("ESCROW_ANTHROPIC_URL is set but ESCROW_ANTHROPIC_API_KEY is empty")
	}
	return nil
}

func lookup(getenv func(string) string, k string) (string, bool) {
	v := getenv(k)
	return v, v != ""
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(cmp.Or(s, "info"))); err != nil {
		return l, fmt.Errorf("ESCROW_LOG_LEVEL: %w", err)
	}
	return l, nil
}

// NewLogger returns a logger on w with the configured level and format, which masks the
// secrets of URLs in every line (passwords, tokens in query strings).
func (c *Config) NewLogger(w io.Writer) *slog.Logger {
	lvl, _ := parseLevel(c.LogLevel)
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if c.LogFormat == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(redactingHandler{next: h})
}
