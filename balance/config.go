package balance

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
)

// Defaults of the Config fields left zero.
const (
	DefaultPrefix           = "esc"
	DefaultHoldTTL          = 10 * time.Minute
	DefaultPinTTL           = 24 * time.Hour
	DefaultMaxInFlight      = 256
	DefaultTombstoneTTL     = 30 * time.Second
	DefaultReapGrace        = time.Minute
	DefaultModelMaxCacheTTL = time.Second
	DefaultScanPause        = 10 * time.Millisecond
	DefaultMaxBatch         = 128
	DefaultMaxPipelines     = 4
)

// defaultEndUserFields is Config.EndUserFields' default.
const defaultEndUserFields = 100_000

// defaultWaitTimeout is Config.WaitTimeout's default.
const defaultWaitTimeout = 100 * time.Millisecond

// Bounds New checks the configuration against.
const (
	// minPinToHold: PinTTL must be at least this many HoldTTLs, so that a pinned hold (expiry
	// more than PinTTL/2 away) is never mistaken for an ordinary one.
	minPinToHold = 4
	maxPinTTL    = 100 * 365 * 24 * time.Hour
	maxBatchWait = time.Second
)

// ErrConfig is wrapped by New's error for a configuration it cannot use. New never corrects a
// field: a value out of range is refused, only a zero value gets its default.
var ErrConfig = errors.New("balance: invalid config")

// Config configures a Store. A nil *Config, and every zero field, means the documented default.
type Config struct {
	// Ledger is needed for cold orgs (seed, catch-up) and for the reaper's usage check. nil: a
	// cold org returns ErrCold, and Reap releases expired holds without asking anyone.
	Ledger Ledger
	// Prefix is the key namespace (see OrgKeys). Default DefaultPrefix ("esc").
	Prefix string
	// HoldTTL is a hold's lifetime; Extend pushes its expiry to now+HoldTTL. Default 10m.
	HoldTTL time.Duration
	// PinTTL is how far Pin pushes an expiry (now+PinTTL); renew a pin well within it (see
	// Store.PinRenewal). A hold whose expiry is more than PinTTL/2 away counts as pinned. Must
	// be ≥ 4×HoldTTL. Default 24h.
	PinTTL time.Duration
	// SettleDeadline is how long a finished hold (Finish) waits for its settle before a reaper
	// may look at it: its expiry becomes max(current, now+SettleDeadline). The reaper still
	// releases it only once the ledger has no unsettled usage for it. At most PinTTL/2.
	// Default HoldTTL.
	SettleDeadline time.Duration
	// MaxInFlight caps an org's unfinished, unpinned holds: its requests really in flight.
	// Default 256.
	MaxInFlight int
	// TombstoneTTL is how long an ended hold id stays in gone; keep it ≥ twice the Redis
	// client's total timeout including retries. Default 30s.
	TombstoneTTL time.Duration
	// ReapGrace: a hold is reaped only after expiry+ReapGrace. Default 1m.
	ReapGrace time.Duration
	// ModelMaxCacheTTL is how long ModelMax serves a value from memory. Default 1s.
	ModelMaxCacheTTL time.Duration
	// ScanPause is the pause between two SCAN pages of ScanOrgs (its rate limit). Default 10ms.
	ScanPause time.Duration
	// NoCoalesce turns reserve coalescing off. By default, reserves that arrive while
	// MaxPipelines reserve round trips are already in flight go together, as one pipeline,
	// instead of each waiting for a connection of its own; a reserve that finds a free slot goes
	// to Redis at once, alone (nothing waits at low load), and each reserve keeps its own reply.
	// Measured side by side (docs/performance.md), coalescing never lost and wins most on a hot
	// org. Default false (coalescing on).
	NoCoalesce bool
	// BatchWindow, with coalescing: while other pipelines are in flight, how long a batch that is
	// not full waits for more reserves before it is sent; at most 1s. Default 0 (send what is
	// queued).
	BatchWindow time.Duration
	// MaxBatch, with coalescing: the most reserves in one pipeline. Default 128.
	MaxBatch int
	// MaxPipelines, with coalescing: the most reserve round trips (lone calls or pipelines) in
	// flight at once, per master on a Cluster; keep it below the client's pool size (per node).
	// Default 4.
	MaxPipelines int
	// ClockOffset shifts the clock the scripts use for limit windows and grants' expiries (never
	// holds' expiries): for tests only, so rollovers are tested without a sleep. Default 0.
	ClockOffset time.Duration
	// WaitReplicas, when > 0, makes every reserve wait until that many replicas have
	// acknowledged it (Redis WAIT, sent on the reserve's connection right after the script, in
	// the same pipeline: one WAIT per pipeline of coalesced reserves) before the hold is
	// granted. A hold the replicas did not acknowledge within WaitTimeout is refused with an
	// error wrapping ErrRedis that says so (the caller answers 503 and releases it, as for any
	// reserve whose outcome is unknown), so no hold a client was told passed can be lost
	// by a failover to an acknowledging replica. It costs a wait for the replica on every
	// reserve (docs/failover.md), and every reserve is refused while fewer replicas are up.
	// Default 0 (off: replication is asynchronous and a failover may lose the last holds; see
	// docs/failover.md for the bound).
	WaitReplicas int
	// WaitTimeout bounds each WAIT (WaitReplicas > 0); at least 1ms (WAIT 0 would block for
	// ever), and keep it well below the Redis client's read timeout, which bounds the whole
	// pipeline. Default 100ms.
	WaitTimeout time.Duration
	// EndUserFields bounds an org's limit counters (one Redis hash) when the ledger reads one end
	// user's lifetime spend (pgledger and memledger do; DESIGN.md "Lifetime per-end-user
	// counters"): the counters of lifetime limits of each end user apart are then loaded one end
	// user at a time, on the end user's first request after a seed, and past this many fields
	// some of them are evicted (loaded again when their end user comes back), so Redis keeps the
	// recent end users only. Each field costs about 110 bytes (docs/limits.md). 0: 100,000;
	// < 0: no bound.
	EndUserFields int
	// AllowEviction skips the maxmemory-policy noeviction check (and logs a loud warning):
	// eviction can drop a hold and lock money, or drop a watermark.
	AllowEviction bool
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Admin is the Redis client of the admin plane (DESIGN.md "Two planes"): the writes of the
	// keys the data plane only reads — limits (PushLimits), key revocations (RevokeKey), model
	// versions (TouchModel), the learned max an admin resets (SetModelMax) — go through it. nil: the Store's own
	// client writes them too (one Redis user for both planes), unless DataOnly.
	Admin redis.UniversalClient
	// DataOnly: the Store has the data plane's credential only (the proxies of a split
	// deployment). Admin writes fail with errDataPlane, and an org whose limits are not in Redis
	// is errNoLimits (answered 503) until the admin plane pushes them. Not with Admin.
	DataOnly bool
}

// withDefaults returns a copy of c (nil: the zero Config) with every zero field set to its
// default.
func (c *Config) withDefaults() Config {
	var z Config
	if c != nil {
		z = *c
	}
	z.Prefix = cmp.Or(z.Prefix, DefaultPrefix)
	z.HoldTTL = cmp.Or(z.HoldTTL, DefaultHoldTTL)
	z.PinTTL = cmp.Or(z.PinTTL, DefaultPinTTL)
	z.SettleDeadline = cmp.Or(z.SettleDeadline, z.HoldTTL)
	z.MaxInFlight = cmp.Or(z.MaxInFlight, DefaultMaxInFlight)
	z.TombstoneTTL = cmp.Or(z.TombstoneTTL, DefaultTombstoneTTL)
	z.ReapGrace = cmp.Or(z.ReapGrace, DefaultReapGrace)
	z.ModelMaxCacheTTL = cmp.Or(z.ModelMaxCacheTTL, DefaultModelMaxCacheTTL)
	z.ScanPause = cmp.Or(z.ScanPause, DefaultScanPause)
	z.MaxBatch = cmp.Or(z.MaxBatch, DefaultMaxBatch)
	z.EndUserFields = cmp.Or(z.EndUserFields, defaultEndUserFields)
	z.MaxPipelines = cmp.Or(z.MaxPipelines, DefaultMaxPipelines)
	z.WaitTimeout = cmp.Or(z.WaitTimeout, defaultWaitTimeout)
	z.Logger = cmp.Or(z.Logger, slog.Default())
	return z
}

// validate checks a Config with its defaults filled in; its errors wrap ErrConfig.
func (c *Config) validate() error {
	switch {
	case c.MaxBatch < 1 || c.MaxPipelines < 1 || c.BatchWindow < 0 || c.BatchWindow > maxBatchWait:
		return fmt.Errorf("%w: MaxBatch (%d) and MaxPipelines (%d) must be ≥ 1, BatchWindow (%v) within 0..%v",
			ErrConfig, c.MaxBatch, c.MaxPipelines, c.BatchWindow, maxBatchWait)
	case c.HoldTTL < time.Millisecond || c.TombstoneTTL < time.Millisecond || c.ReapGrace < 0:
		return fmt.Errorf("%w: HoldTTL (%v) and TombstoneTTL (%v) must be ≥ 1ms, ReapGrace (%v) ≥ 0",
			ErrConfig, c.HoldTTL, c.TombstoneTTL, c.ReapGrace)
	case c.PinTTL < minPinToHold*c.HoldTTL:
		return fmt.Errorf("%w: PinTTL (%v) must be at least %d×HoldTTL (%v)", ErrConfig, c.PinTTL, minPinToHold, c.HoldTTL)
	case c.PinTTL > maxPinTTL:
		return fmt.Errorf("%w: PinTTL (%v) above %v", ErrConfig, c.PinTTL, maxPinTTL)
	case c.SettleDeadline < time.Millisecond || c.SettleDeadline > c.PinTTL/2:
		// Above PinTTL/2 a finished hold would count as pinned.
		return fmt.Errorf("%w: SettleDeadline (%v) must be within 1ms..PinTTL/2 (%v)", ErrConfig, c.SettleDeadline, c.PinTTL/2)
	case c.MaxInFlight < 1:
		return fmt.Errorf("%w: MaxInFlight (%d) must be ≥ 1", ErrConfig, c.MaxInFlight)
	case c.ModelMaxCacheTTL < 0 || c.ScanPause < 0:
		return fmt.Errorf("%w: ModelMaxCacheTTL (%v) and ScanPause (%v) must be ≥ 0", ErrConfig, c.ModelMaxCacheTTL, c.ScanPause)
	case c.WaitReplicas < 0 || c.WaitTimeout < time.Millisecond:
		return fmt.Errorf("%w: WaitReplicas (%d) must be ≥ 0 and WaitTimeout (%v) ≥ 1ms", ErrConfig, c.WaitReplicas, c.WaitTimeout)
	case c.DataOnly && c.Admin != nil:
		return fmt.Errorf("%w: DataOnly with an Admin client", ErrConfig)
	case !validPrefix(c.Prefix):
		return fmt.Errorf("%w: prefix %q: 1 to 64 printable ASCII bytes, none of {}*?[]\\ or space", ErrConfig, c.Prefix)
	}
	return nil
}

// validPrefix: a prefix may not contain a hash-tag brace, a SCAN pattern character or a space.
func validPrefix(p string) bool {
	for i := 0; i < len(p); i++ {
		b := p[i]
		if b <= ' ' || b >= 0x7f || b == '{' || b == '}' || b == '*' || b == '?' || b == '[' || b == ']' || b == '\\' {
			return false
		}
	}
	return p != "" && len(p) <= 64
}
