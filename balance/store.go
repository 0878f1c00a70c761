package balance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/singleflight"
)

// Store is the hot balance of every org in Redis. It is safe for concurrent use.
type Store struct {
	c      redis.UniversalClient
	adm    redis.UniversalClient // the admin plane's writes; nil: none (Config.DataOnly)
	cfg    Config
	log    *slog.Logger
	prefix string

	// precomputed script arguments
	holdTTL, pinTTL, pinFloor, tombTTL, grace, capArg, settleDL, clockArg string
	// the same, as the interface values a reserve passes (boxed once, not per call)
	holdTTLArg, capArgArg, tombTTLArg, pinFloorArg any
	fieldsArg                                      any // Config.EndUserFields as reserve's ARGV[13]

	scripts  map[string]*script
	topo     *topology
	co       *coalescer // nil with Config.NoCoalesce; on a Cluster, for keys of no known node
	coNodes  sync.Map   // on a Cluster with coalescing: master address → its *coalescer
	epoch    atomic.Pointer[cachedEpoch]
	warming  singleflight.Group
	warnMu   sync.Mutex
	warnings []string

	heldMu sync.Mutex
	held   map[string]uint64 // org → bumped on every hold this process put on it

	maxCache sync.Map // model → *cachedMax
	maxLoad  singleflight.Group

	keep keepAlives // KeepAlive's queue and goroutine
	uses modelUses  // UseModel's counts and marks
}

type cachedEpoch struct {
	e   Epoch
	s   string // e.String(), computed once
	arg any    // s as a script argument, boxed once
}

// cachedMax is what the store last read of a model (ModelState): served until at+TTL (at is
// pushed on when a refresh fails, so that a dead node is not asked on every request); st.Read
// says how old the state itself is.
type cachedMax struct {
	st ModelState
	at time.Time
}

// maxIDLen bounds hold ids.
const maxIDLen = 128

// New checks conf (nil: every default; a value out of range is refused with an error wrapping
// ErrConfig, never corrected), then the Redis server (version ≥ 6.0, maxmemory-policy
// noeviction unless conf.AllowEviction, AOF — a warning when off), loads every script on every
// master, and returns the Store. On a server that does not answer CONFIG (miniredis) the policy
// and AOF checks are skipped.
func New(ctx context.Context, c redis.UniversalClient, conf *Config) (*Store, error) {
	if c == nil {
		return nil, fmt.Errorf("%w: nil redis client", ErrConfig)
	}
	cfg := conf.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &Store{
		c:        c,
		cfg:      cfg,
		log:      cfg.Logger,
		prefix:   cfg.Prefix,
		holdTTL:  ms(cfg.HoldTTL),
		pinTTL:   ms(cfg.PinTTL),
		pinFloor: ms(cfg.PinTTL / 2),
		tombTTL:  ms(cfg.TombstoneTTL),
		grace:    ms(cfg.ReapGrace),
		capArg:   strconv.Itoa(cfg.MaxInFlight),
		settleDL: ms(cfg.SettleDeadline),
		clockArg: ms(cfg.ClockOffset),
		scripts:  newScripts(),
		topo:     newTopology(c),
		held:     make(map[string]uint64),
	}
	switch {
	case cfg.Admin != nil:
		s.adm = cfg.Admin
	case !cfg.DataOnly:
		s.adm = c
	}
	s.holdTTLArg, s.capArgArg, s.tombTTLArg, s.pinFloorArg = s.holdTTL, s.capArg, s.tombTTL, s.pinFloor
	s.fieldsArg = strconv.Itoa(max(cfg.EndUserFields, 0))
	if !cfg.NoCoalesce {
		s.co = newCoalescer(s, cfg)
	}
	if err := s.eachMaster(ctx, s.checkServer); err != nil {
		return nil, err
	}
	if err := s.loadScripts(ctx); err != nil {
		return nil, err
	}
	for _, w := range s.warnings {
		s.log.Warn(w)
	}
	// Best effort: learn the ledger's epoch now, so the first reserve needs no snapshot.
	if ep, ok := cfg.Ledger.(interface {
		Epoch(context.Context) (Epoch, error)
	}); ok {
		if e, err := ep.Epoch(ctx); err == nil {
			s.ObserveEpoch(e)
		} else {
			s.log.Warn("balance: could not read the ledger epoch at start", "err", err)
		}
	}
	return s, nil
}

func ms(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }

// warningList is what New found worth a warning (AOF off, eviction allowed, unknown version);
// New logs each once.
func (s *Store) warningList() []string {
	s.warnMu.Lock()
	defer s.warnMu.Unlock()
	return append([]string(nil), s.warnings...)
}

// Config returns the configuration with its defaults filled in. (The middleware reads HoldTTL
// from it; nothing else outside the package should need it.)
func (s *Store) Config() Config { return s.cfg }

// PinRenewal is how often a holder of pinned holds should pin them again (Pin): a quarter of
// PinTTL, so that a pin survives a few missed renewals.
func (s *Store) PinRenewal() time.Duration { return s.cfg.PinTTL / 4 }

// Now reads the clock the scripts use for limit windows: the Redis server's TIME shifted by
// Config.ClockOffset, so that Window.StartMS of it names the windows whose counters the scripts
// keep. When Redis does not answer it returns this process's clock, shifted alike, with the
// error (ErrRedis): a caller that can answer without Redis may use it as its best guess.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	t, err := s.c.Time(ctx).Result()
	if err != nil {
		s.noteErr(err)
		return time.Now().Add(s.cfg.ClockOffset), fmt.Errorf("balance: redis TIME: %w: %w", ErrRedis, err)
	}
	return t.Add(s.cfg.ClockOffset), nil
}

// Epoch is the ledger epoch this process last saw (zero before any).
func (s *Store) Epoch() Epoch {
	if e := s.epoch.Load(); e != nil {
		return e.e
	}
	return Epoch{}
}

// epochArg is epochString as a script argument.
func (s *Store) epochArg() any {
	if e := s.epoch.Load(); e != nil {
		return e.arg
	}
	return Epoch{}.String()
}

func (s *Store) epochString() string {
	if e := s.epoch.Load(); e != nil {
		return e.s
	}
	return Epoch{}.String()
}

// ObserveEpoch is this process's part of the epoch protocol (DESIGN.md "Redis keys"): whoever
// reads the ledger's epoch — with the entries it settles, in a snapshot, or at start — hands it
// here, and every reserve and settle after it carries it, so that a hot balance written against
// another ledger (a restore, a new memory ledger) answers cold instead of being used. Settle,
// Seed and CatchUp call it themselves; the accounting worker and its operations call it for the
// epochs they read on their own. A lower generation than the cached one is ignored (no process
// goes back to an older ledger); anything else replaces it.
func (s *Store) ObserveEpoch(e Epoch) {
	if e.IsZero() {
		return
	}
	for {
		cur := s.epoch.Load()
		if cur != nil && (cur.e == e || cur.e.Gen > e.Gen) {
			return
		}
		str := e.String()
		if s.epoch.CompareAndSwap(cur, &cachedEpoch{e: e, s: str, arg: str}) {
			return
		}
	}
}

// RevocationTTL is how long RevokeKey's mark stays in Redis. A key cache may serve an entry that
// predates the revocation for at most its stale window while the ledger is unreachable; that
// window must stay below this.
const RevocationTTL = 24 * time.Hour

// RevokeKey marks the API key keyID revoked in Redis (key esc:key:<id>:revoked, for
// RevocationTTL), after the ledger has revoked it. Every process checks the mark before it
// serves a cached key past its TTL while the ledger is unreachable, so a revocation takes
// effect within the cache TTL even during a ledger outage, on every process at once.
func (s *Store) RevokeKey(ctx context.Context, keyID string) error {
	if err := checkKeyID(keyID); err != nil {
		return err
	}
	if s.adm == nil {
		return fmt.Errorf("balance: revoke key: %w", errDataPlane)
	}
	if err := s.adm.Set(ctx, s.revokedKey(keyID), "1", RevocationTTL).Err(); err != nil {
		s.noteErr(err)
		return fmt.Errorf("balance: revoke key: %w: %w", ErrRedis, err)
	}
	return nil
}

// KeyRevoked reports whether RevokeKey marked keyID revoked (within RevocationTTL).
func (s *Store) KeyRevoked(ctx context.Context, keyID string) (bool, error) {
	if err := checkKeyID(keyID); err != nil {
		return false, err
	}
	n, err := s.c.Exists(ctx, s.revokedKey(keyID)).Result()
	if err != nil {
		s.noteErr(err)
		return false, fmt.Errorf("balance: key revoked: %w: %w", ErrRedis, err)
	}
	return n == 1, nil
}

func checkKeyID(id string) error {
	if !validHoldID(id) || strings.ContainsAny(id, "{}") {
		return fmt.Errorf("%w: %q", ErrInvalidKeyID, id)
	}
	return nil
}

// MaxOrgLen is the longest org id, in bytes.
const MaxOrgLen = 128

// orgIDRule is what ValidateOrg's error says is allowed.
const orgIDRule = "an org id is 1 to 128 characters from A-Z, a-z, 0-9, '.', '_' and '-', starting with a letter or digit"

// ValidateOrg checks an org id against escrow's one org-id rule, used by the ledgers, the hot
// balance and the admin routes alike: 1 to MaxOrgLen characters from A-Z, a-z, 0-9, '.', '_'
// and '-', the first a letter or digit. Such an id is path-safe (it goes unescaped into admin
// URLs like /admin/v1/orgs/{org}/credits, and can never be "." or ".."), fits inside a Redis
// hash tag (no braces), and means the same bytes to every layer (ASCII only: no Unicode
// normalization can make two ids look alike). The error wraps ErrInvalidOrg and says what is
// allowed.
func ValidateOrg(org string) error {
	if !validOrg(org) {
		return fmt.Errorf("%w %q: %s", ErrInvalidOrg, org, orgIDRule)
	}
	return nil
}

// validOrg reports whether org passes ValidateOrg.
func validOrg(org string) bool {
	if org == "" || len(org) > MaxOrgLen {
		return false
	}
	for i := 0; i < len(org); i++ {
		switch b := org[i]; {
		case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9':
		case (b == '.' || b == '_' || b == '-') && i > 0:
		default:
			return false
		}
	}
	return true
}

// validHoldID: 1..128 printable ASCII bytes, no space.
func validHoldID(id string) bool {
	if id == "" || len(id) > maxIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		if b := id[i]; b <= ' ' || b >= 0x7f {
			return false
		}
	}
	return true
}

func checkOrg(org string) error { return ValidateOrg(org) }

func checkHold(id string) error {
	if !validHoldID(id) {
		return fmt.Errorf("%w: %q", ErrInvalidHoldID, id)
	}
	return nil
}

// ReserveRequest asks for a hold of Amount on Org's balance, under the id HoldID.
type ReserveRequest struct {
	Org    string
	HoldID string
	Amount int64 // micro-units, 0 < Amount ≤ MaxAmount (0 when Exempt)
	// KeyID is the API key the request came with ("" for none). The limits and freezes of the
	// key, of its project (as the hot state's key → project map says) and of the org apply.
	KeyID string
	// Tokens is the request's token bound (input bound + output cap, × choices × prompts; ≥ 0):
	// what a tokens limit in scope holds. A requests limit holds 1.
	Tokens int64
	// EndUser is the request's end user ("" for none: no end-user limit counts it): the limits
	// of scope end_user apply to it, each end user apart (a limit without an id) or this one (a
	// limit with its id). It follows the key id rule (Scope{Kind: ScopeEndUser, ID: id}.Validate).
	EndUser string
	// Exempt reserves for an exempt org (ledger access.OrgFlags): a zero hold (Amount must be 0), never
	// refused for balance; freezes, the in-flight cap and the limits apply (a money limit counts
	// the cost when the hold finishes). Finish, settle and release treat it like any hold.
	Exempt bool
}

// RateInfo is the requests or the tokens limit in a request's scope with the least left after
// its hold (the x-ratelimit-* headers); zero Cap: none in scope.
type RateInfo struct {
	Cap       int64
	Remaining int64     // Cap − the window's counter after the hold (may be < 0 past an overshoot)
	ResetsAt  time.Time // the next window's start; zero for Lifetime
}

// Reservation is a granted hold.
type Reservation struct {
	Balance   int64 // the available balance after the hold
	Duplicate bool  // the hold already existed (a re-sent call): nothing more was debited
	// ReservedAt is the reserve time on the Redis clock (ms precision; for a duplicate, the
	// original's when its hold was added to limit counters, else this call's). Store it with
	// the usage event: its cost is charged to the windows that contain it (Entry.ReservedAt).
	ReservedAt time.Time
	// Project is the key's project as the hot state's key → project map said at reserve time
	// ("" for none; for a duplicate, the map's answer now). Store it with the usage event:
	// the cost counts against that project's limits (Entry.Project).
	Project string
	// RequestRate and TokenRate: the requests and the tokens limit in scope with the least
	// left after this hold (zero for a duplicate).
	RequestRate, TokenRate RateInfo
}

// maxColdRetries bounds Reserve's warm-and-retry loop.
const maxColdRetries = 3

// Reserve puts a hold on the org's balance, and on every limit in the request's scope, in one
// Redis round trip (on a warm org), all or nothing. Errors: *FrozenError (errors.Is ErrFrozen),
// *LimitError (ErrLimit), *InsufficientError (ErrInsufficient), ErrTooManyHolds, ErrGone,
// ErrInvalidOrg, ErrInvalidHoldID, ErrInvalidAmount, ErrInvalidKeyID,
// ErrCold (cold org and no ledger, or it stayed cold), or a Redis/ledger error. A cold org is
// warmed (Warm) and the reserve retried.
func (s *Store) Reserve(ctx context.Context, r ReserveRequest) (Reservation, error) {
	if err := checkOrg(r.Org); err != nil {
		return Reservation{}, err
	}
	if err := checkHold(r.HoldID); err != nil {
		return Reservation{}, err
	}
	if (r.Exempt && r.Amount != 0) || (!r.Exempt && r.Amount <= 0) || r.Amount > MaxAmount || r.Tokens < 0 || r.Tokens > MaxAmount {
		return Reservation{}, fmt.Errorf("%w: hold of %d (tokens %d)", ErrInvalidAmount, r.Amount, r.Tokens)
	}
	if err := checkRequestKey(r.KeyID); err != nil {
		return Reservation{}, err
	}
	if r.EndUser != "" {
		if err := checkScope(Scope{Kind: ScopeEndUser, ID: r.EndUser}); err != nil {
			return Reservation{}, err
		}
	}
	keys := s.keys(r.Org).ReserveKeys()
	amount := strconv.FormatInt(r.Amount, 10)
	tokens := strconv.FormatInt(r.Tokens, 10)
	exempt := "0"
	if r.Exempt {
		exempt = "1"
	}
	var loads []any // lazy counters read from the ledger (COLD_EU), as reserve's ARGV[14..]
	for attempt, loaded := 0, 0; ; attempt++ {
		args := []any{s.epochArg(), r.HoldID, amount, s.holdTTLArg, s.capArgArg, s.tombTTLArg, s.pinFloorArg, r.KeyID, s.clockArg, tokens, r.EndUser, exempt, s.fieldsArg}
		args = append(args, loads...)
		var res []any
		var err error
		if s.co != nil {
			res, err = s.coalescerFor(ctx, keys[0]).reserve(ctx, keys, args)
		} else {
			res, err = s.reserveOne(ctx, keys, args)
		}
		if err != nil {
			return Reservation{}, fmt.Errorf("balance: reserve: %w: %w", ErrRedis, err)
		}
		status, _ := res[0].(string)
		switch status {
		case "OK":
			s.markHeld(r.Org)
			return Reservation{Balance: toInt(res[1]), ReservedAt: msTime(res[2]), Project: str(res, 3),
				RequestRate: rateInfo(res, 4), TokenRate: rateInfo(res, 7)}, nil
		case "DUP":
			s.markHeld(r.Org)
			return Reservation{Balance: toInt(res[1]), Duplicate: true, ReservedAt: msTime(res[2]), Project: str(res, 3)}, nil
		case "GONE":
			return Reservation{}, ErrGone
		case "FROZEN":
			sc, _ := res[1].(string)
			id, _ := res[2].(string)
			return Reservation{}, &FrozenError{Scope: Scope{Kind: ScopeKind(sc), ID: id}}
		case "LIMIT":
			return Reservation{}, limitError(res, r.Amount, r.Tokens)
		case "TOO_MANY":
			return Reservation{}, ErrTooManyHolds
		case "NO_END_USER":
			return Reservation{}, fmt.Errorf("%w: limit %s", ErrEndUserRequired, str(res, 1))
		case "INSUFFICIENT":
			e := &InsufficientError{Balance: toInt(res[1]), Amount: r.Amount}
			if len(res) > 2 {
				e.Held = toInt(res[2])
			}
			return Reservation{}, e
		case "COLD_EU":
			// The end user's lifetime counters are not complete in Redis (lazy seed, or
			// evicted): read their ledger part up to their placeholders' watermarks and reserve
			// again (another try only if a counter was evicted meanwhile).
			if loaded++; loaded > maxEndUserLoads {
				return Reservation{}, fmt.Errorf("%w: the end user's lifetime counters of %s could not be loaded (evicted as fast as loaded: raise EndUserFields)", ErrCold, r.Org)
			}
			if loads, err = s.loadEndUser(ctx, r.Org, r.EndUser, res); err != nil {
				return Reservation{}, err
			}
			attempt--
		case "COLD":
			loads = nil // read for the hot state that went (maybe of another epoch)
			if s.cfg.Ledger == nil || attempt >= maxColdRetries {
				return Reservation{}, ErrCold
			}
			if err := s.Warm(ctx, r.Org); err != nil {
				return Reservation{}, err
			}
		default:
			return Reservation{}, fmt.Errorf("balance: reserve: unexpected reply %v", res)
		}
	}
}

// maxEndUserLoads bounds Reserve's loads of an end user's lifetime counters (COLD_EU).
const maxEndUserLoads = 8

// endUserLedger is a Ledger that reads one end user's lifetime spend (pgledger's and memledger's
// EndUserUsed). With it, Warm seeds lazily: the counters of lifetime limits of each end user
// apart are loaded by the end user's requests (reserve's COLD_EU), not all written by the seed.
type endUserLedger interface {
	// EndUserUsed returns, for each of limits (lifetime limits of each end user apart), what
	// the org's charges of endUser with seq ≤ upto count in its unit (WindowUsed.Start 0).
	EndUserUsed(ctx context.Context, org, endUser string, limits []Limit, upto int64) ([]WindowUsed, error)
}

// loadEndUser reads from the ledger the lazy counters a COLD_EU reply names (res: 'COLD_EU', then
// limit id, unit code and placeholder watermark W triples), each up to its W, and returns them
// as reserve's ARGV[14..]: field, W and sum triples.
func (s *Store) loadEndUser(ctx context.Context, org, endUser string, res []any) ([]any, error) {
	el, ok := s.cfg.Ledger.(endUserLedger)
	if !ok || endUser == "" || len(res) < 4 || (len(res)-1)%3 != 0 {
		return nil, fmt.Errorf("balance: reserve: unexpected reply %v", res)
	}
	byWM := map[string][]Limit{} // one ledger read per watermark (almost always one)
	var wms []string
	for i := 1; i+2 < len(res); i += 3 {
		wm := str(res, i+2)
		if _, seen := byWM[wm]; !seen {
			wms = append(wms, wm)
		}
		byWM[wm] = append(byWM[wm], Limit{ID: str(res, i), Scope: Scope{Kind: ScopeEndUser}, Window: Lifetime, Unit: unitOf(str(res, i+1))})
	}
	out := make([]any, 0, len(res))
	for _, wm := range wms {
		upto, err := strconv.ParseInt(wm, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("balance: reserve: unexpected reply %v", res)
		}
		used, err := el.EndUserUsed(ctx, org, endUser, byWM[wm], upto)
		if err != nil {
			return nil, fmt.Errorf("balance: lifetime spend of end user %q of %s: %w: %w", endUser, org, ErrLedger, err)
		}
		for _, u := range used {
			if !validLimitID(u.LimitID) || u.Used < 0 || u.Used > 1<<53 {
				return nil, fmt.Errorf("%w: lifetime spend %+v", ErrInvalidLimits, u)
			}
			out = append(out, u.LimitID+":0:"+endUser, wm, strconv.FormatInt(u.Used, 10))
		}
	}
	return out, nil
}

// coalescerFor returns the coalescer of the master that serves key: one per master on a
// Cluster, so that the round trips stuck on a dead master (each until the client gives up)
// never hold the pipeline slots of reserves for the others.
func (s *Store) coalescerFor(ctx context.Context, key string) *coalescer {
	if s.topo.cc == nil {
		return s.co
	}
	addr, _, err := s.nodeOf(ctx, key)
	if err != nil {
		return s.co
	}
	if co, ok := s.coNodes.Load(addr); ok {
		return co.(*coalescer)
	}
	co, _ := s.coNodes.LoadOrStore(addr, newCoalescer(s, s.cfg))
	return co.(*coalescer)
}

// msTime reads a script's ms timestamp string.
func msTime(v any) time.Time { return time.UnixMilli(toInt(v)).UTC() }

// str returns reply element i as a string ("" when absent or not a string).
func str(res []any, i int) string {
	if i >= len(res) {
		return ""
	}
	s, _ := res[i].(string)
	return s
}

// rateInfo reads the cap, left and resets ms at res[i:i+3] of an OK reply (an empty cap: none).
func rateInfo(res []any, i int) RateInfo {
	if str(res, i) == "" {
		return RateInfo{}
	}
	r := RateInfo{Cap: toInt(str(res, i)), Remaining: toInt(str(res, i+1))}
	if ms := toInt(str(res, i+2)); ms != 0 {
		r.ResetsAt = time.UnixMilli(ms).UTC()
	}
	return r
}

// limitError reads {'LIMIT', id, scope, scope id, window, cap, used, resets ms, room, held,
// unit, token room}.
func limitError(res []any, amount, tokens int64) *LimitError {
	e := &LimitError{
		Limit: Limit{ID: str(res, 1), Scope: Scope{Kind: ScopeKind(str(res, 2)), ID: str(res, 3)}, Window: Window(str(res, 4)), Cap: toInt(str(res, 5))},
		Used:  toInt(str(res, 6)), Amount: amount,
	}
	if e.Limit.Window != Lifetime {
		e.ResetsAt = msTime(str(res, 7))
	}
	if len(res) > 9 {
		e.Room, e.Held = toInt(res[8]), toInt(res[9])
	}
	if len(res) > 11 {
		e.Limit.Unit = unitOf(str(res, 10))
		if tr, ok := res[11].(int64); ok {
			e.TokenRoom, e.HaveTokenRoom = tr, true
		}
	}
	if len(res) > 12 {
		e.At = msTime(str(res, 12))
	}
	e.Amount = e.Limit.Unit.Count(amount, tokens) // what the hold asked of this limit
	return e
}

func toInt(v any) int64 {
	switch x := v.(type) {
	case int64:
		return x
	case string:
		n, _ := strconv.ParseInt(x, 10, 64)
		return n
	}
	return 0
}

func (s *Store) markHeld(org string) {
	s.heldMu.Lock()
	s.held[org]++
	s.heldMu.Unlock()
}

// HeldOrgs lists the orgs this process put holds on that may still have holds (the reaper's
// round); Reap forgets an org once it has no holds left.
func (s *Store) HeldOrgs() []string {
	s.heldMu.Lock()
	defer s.heldMu.Unlock()
	out := make([]string, 0, len(s.held))
	for o := range s.held {
		out = append(out, o)
	}
	return out
}

// Release ends a hold without a charge. released reports whether this call gave the money back
// (false: the hold was already gone — settled, released or reaped). The id is tombstoned either
// way, so a late re-sent reserve debits nothing.
func (s *Store) Release(ctx context.Context, org, holdID string) (bool, error) {
	if err := checkOrg(org); err != nil {
		return false, err
	}
	if err := checkHold(holdID); err != nil {
		return false, err
	}
	n, err := s.run(ctx, scRelease, s.keys(org).releaseKeys(), holdID, s.tombTTL).Int64()
	if err != nil {
		return false, fmt.Errorf("balance: release: %w: %w", ErrRedis, err)
	}
	return n == 1, nil
}

// Extend pushes an existing hold's expiry to now+HoldTTL; it never lowers an expiry (a pinned
// hold stays pinned) and never touches a finished hold (true: it exists). false: no such hold.
func (s *Store) Extend(ctx context.Context, org, holdID string) (bool, error) {
	return s.expiry(ctx, scExtend, org, holdID, s.holdTTL, "0")
}

// Pin pushes an existing hold's expiry to now+PinTTL (never lowering it), so no reaper releases
// it while its usage waits in a journal. Call it again well within PinTTL to renew. A finished
// hold is pinned too, and stays out of the in-flight count.
func (s *Store) Pin(ctx context.Context, org, holdID string) (bool, error) {
	return s.expiry(ctx, scExtend, org, holdID, s.pinTTL, "1") // pinning is extending far out
}

// Unpin gives an existing hold its normal expiry back: now+HoldTTL, or now+SettleDeadline for a
// finished hold.
func (s *Store) Unpin(ctx context.Context, org, holdID string) (bool, error) {
	return s.expiry(ctx, scUnpin, org, holdID, s.holdTTL, s.settleDL)
}

func (s *Store) expiry(ctx context.Context, sc, org, holdID, ttl, arg3 string) (bool, error) {
	if err := checkOrg(org); err != nil {
		return false, err
	}
	if err := checkHold(holdID); err != nil {
		return false, err
	}
	n, err := s.run(ctx, sc, s.keys(org).expiryKeys(), holdID, ttl, arg3).Int64()
	if err != nil {
		return false, fmt.Errorf("balance: %s: %w: %w", sc, ErrRedis, err)
	}
	return n == 1, nil
}

// settleChunk bounds the entries of one settle script call (a script blocks Redis while it runs).
const settleChunk = 256

// Settle applies the org's ledger entries, in Seq order, to the hot balance, and returns one
// status per entry (NotReached after a gap). Errors: ErrCold (every status Cold; a newer epoch
// than the hot balance's dropped it: seed and settle again), *GapError (statuses still
// returned: re-send the entries after the watermark), ErrInvalidOrg, ErrInvalidEntry.
func (s *Store) Settle(ctx context.Context, org string, epoch Epoch, entries []Entry) ([]SettleStatus, error) {
	if err := checkOrg(org); err != nil {
		return nil, err
	}
	if epoch.IsZero() {
		return nil, fmt.Errorf("%w: zero epoch", ErrInvalidEntry)
	}
	if err := checkSettle(org, entries); err != nil {
		return nil, err
	}
	s.ObserveEpoch(epoch)
	statuses := make([]SettleStatus, len(entries))
	keys := s.keys(org).settleKeys()
	ep := epoch.String()
	for start := 0; start < len(entries); start += settleChunk {
		chunk := entries[start:min(start+settleChunk, len(entries))]
		res, err := s.run(ctx, scSettle, keys, s.settleArgs(ep, chunk)...).Slice()
		if err != nil {
			return statuses, fmt.Errorf("balance: settle: %w: %w", ErrRedis, err)
		}
		if err := settleReply(res, chunk, statuses[start:]); err != nil {
			return statuses, err
		}
	}
	return statuses, nil
}

// Seed writes a cold org's hot balance and window counters from a ledger snapshot, together:
// bal = Balance − Σ holds, wm = Seq; the counter of each limit's current window (on the Redis
// clock) = its group in snap.Used (0 if none) + the live holds added to it. The limits
// themselves are the admin plane's (PushLimits): Seed needs them in Redis at the snapshot's
// version and epoch — errStaleSnapshot when Redis has newer ones, errNoLimits when it has none,
// older ones or another epoch's (Warm pushes them first when it may). seeded is false when the
// org already has a hot balance of this epoch (with limits as new as it was seeded with) or of a
// higher generation. Call CatchUp after it (Warm does both).
func (s *Store) Seed(ctx context.Context, org string, snap Snapshot) (bool, error) {
	if err := checkOrg(org); err != nil {
		return false, err
	}
	if snap.Balance < -MaxAmount || snap.Balance > MaxAmount {
		return false, fmt.Errorf("%w: balance %d outside ±MaxAmount", ErrInvalidAmount, snap.Balance)
	}
	if snap.Seq < 0 || snap.Epoch.IsZero() {
		return false, fmt.Errorf("%w: snapshot seq %d epoch %q", ErrInvalidEntry, snap.Seq, snap.Epoch)
	}
	ls := snap.Limits
	if ls == nil {
		ls = &LimitSnapshot{}
	}
	lim, err := ls.limFields()
	if err != nil {
		return false, err
	}
	args := make([]any, 0, 6+len(lim)+2*len(ls.Used))
	args = append(args, snap.Epoch.String(), strconv.FormatInt(snap.Balance, 10), strconv.FormatInt(snap.Seq, 10),
		s.clockArg, strconv.FormatInt(ls.Version, 10), strconv.Itoa(len(lim)/2))
	args = append(args, lim...)
	for _, u := range ls.Used {
		if !validLimitID(u.LimitID) || u.Used < -MaxAmount || u.Used > MaxAmount || u.Start <= -1e14 || u.Start >= 1e14 {
			return false, fmt.Errorf("%w: window spend %+v", ErrInvalidLimits, u)
		}
		f := u.LimitID + ":" + strconv.FormatInt(u.Start, 10)
		if u.EndUser != "" {
			if err := checkScope(Scope{Kind: ScopeEndUser, ID: u.EndUser}); err != nil {
				return false, fmt.Errorf("window spend %+v: %w", u, err)
			}
			f += ":" + u.EndUser
		}
		args = append(args, f, strconv.FormatInt(u.Used, 10))
	}
	if _, lazy := s.cfg.Ledger.(endUserLedger); lazy {
		args = append(args, "L", "1") // the end users' lifetime counters are loaded by reserve
	}
	if snap.Expiries != nil && len(*snap.Expiries) > 0 {
		x := *snap.Expiries
		if !validExpiries(x) {
			return false, fmt.Errorf("%w: snapshot expiries %v", ErrInvalidEntry, x)
		}
		args = append(args, expiryBlock(x, nil)...)
	}
	s.ObserveEpoch(snap.Epoch)
	k := s.keys(org)
	n, err := s.run(ctx, scSeed, []string{k.Acct, k.Holds, k.Acct, k.U}, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("balance: seed: %w: %w", ErrRedis, err)
	}
	switch n {
	case -1:
		return false, errStaleSnapshot
	case -2:
		return false, errNoLimits
	}
	return n == 1, nil
}

// maxStaleSnapshots bounds the snapshots one warm-up reads while the org's limits keep changing.
const maxStaleSnapshots = 5

// warmTimeout bounds one shared warm-up (snapshot, seed, catch-up).
const warmTimeout = 30 * time.Second

// Warm makes the org's hot balance current: a ledger snapshot (one per org at a time in this
// process), the seed script, then CatchUp. It refreshes the cached epoch.
func (s *Store) Warm(ctx context.Context, org string) error {
	if err := checkOrg(org); err != nil {
		return err
	}
	if s.cfg.Ledger == nil {
		return ErrCold
	}
	ch := s.warming.DoChan(org, func() (any, error) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), warmTimeout)
		defer cancel()
		// A snapshot read just before the org's limits changed is refused by the seed
		// (errStaleSnapshot): the next one has the new limits.
		for attempt := 1; ; attempt++ {
			snap, err := s.snapshot(ctx, org)
			if err != nil {
				return nil, fmt.Errorf("balance: snapshot of %s: %w: %w", org, ErrLedger, err)
			}
			_, err = s.Seed(ctx, org, snap)
			if errors.Is(err, errNoLimits) {
				// The admin plane's limits are not in Redis at this snapshot's version: a store
				// that may write them pushes them (the push's version order keeps a newer
				// push), then seeds again; one that may not asks the admin plane to.
				if err = s.pushSnapshotLimits(ctx, org, snap); err == nil {
					_, err = s.Seed(ctx, org, snap)
				} else if errors.Is(err, errNoLimits) {
					s.wantLimits(ctx, org)
				}
			}
			if errors.Is(err, errStaleSnapshot) && attempt < maxStaleSnapshots {
				continue
			}
			if err != nil {
				return nil, err
			}
			return nil, s.CatchUp(ctx, org)
		}
	})
	select {
	case r := <-ch:
		return r.Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// snapshot reads the ledger's snapshot of org; from a LimitLedger with its limits and the spend
// of the windows from T0's on, T0 being the Redis clock (plus ClockOffset) read first, so the
// windows the seed script finds current are in it.
func (s *Store) snapshot(ctx context.Context, org string) (Snapshot, error) {
	ll, ok := s.cfg.Ledger.(LimitLedger)
	if !ok {
		return s.cfg.Ledger.Snapshot(ctx, org)
	}
	t0, err := s.Now(ctx)
	if err != nil {
		return Snapshot{}, err
	}
	return ll.SnapshotSince(ctx, org, t0)
}

// catchUpBatch is how many entries CatchUp asks the ledger for at a time.
const catchUpBatch = 500

// CatchUp re-sends every ledger entry past the hot balance's watermark through Settle, until
// there are none (re-sending is always safe). ErrCold if the org has no hot balance.
func (s *Store) CatchUp(ctx context.Context, org string) error {
	if err := checkOrg(org); err != nil {
		return err
	}
	if s.cfg.Ledger == nil {
		return ErrCold
	}
	for range 10_000 {
		v, err := s.c.HMGet(ctx, s.keys(org).Acct, "wm").Result()
		if err != nil {
			s.noteErr(err)
			return fmt.Errorf("balance: catch-up: %w: %w", ErrRedis, err)
		}
		if v[0] == nil {
			return ErrCold
		}
		wm := toInt(v[0])
		entries, epoch, err := s.cfg.Ledger.EntriesAfter(ctx, org, wm, catchUpBatch)
		if err != nil {
			return fmt.Errorf("balance: catch-up of %s: %w: %w", org, ErrLedger, err)
		}
		if len(entries) == 0 {
			s.ObserveEpoch(epoch)
			return nil
		}
		if _, err := s.Settle(ctx, org, epoch, entries); err != nil && !errors.Is(err, ErrGap) {
			return err
		}
		if len(entries) < catchUpBatch {
			return nil
		}
	}
	return fmt.Errorf("balance: catch-up of %s did not finish", org)
}

// Invalidate drops the org's hot balance and window counters (acct and u, which exist or vanish
// together): the next request reseeds them, and the holds that stay are subtracted then (and
// added to the counters they name). The limits (lim) are the admin plane's and stay.
func (s *Store) Invalidate(ctx context.Context, org string) error {
	if err := checkOrg(org); err != nil {
		return err
	}
	k := s.keys(org)
	if err := s.c.Del(ctx, k.Acct, k.U).Err(); err != nil {
		s.noteErr(err)
		return fmt.Errorf("balance: invalidate: %w", err)
	}
	return nil
}

// reapBatch is how many expired holds one Reap call looks at.
const reapBatch = 200

// Reap releases the org's holds that expired more than ReapGrace ago, except those the ledger
// reports unsettled usage for (and pinned holds, which have not expired). A hold whose usage is
// already settled is a phantom and is released too. A ledger error reaps nothing. It returns
// how many holds it released.
func (s *Store) Reap(ctx context.Context, org string) (int, error) {
	if err := checkOrg(org); err != nil {
		return 0, err
	}
	s.heldMu.Lock()
	gen, tracked := s.held[org]
	s.heldMu.Unlock()
	k := s.keys(org)
	res, err := s.run(ctx, scExpired, k.expiryKeys(), s.grace, strconv.Itoa(reapBatch)).Slice()
	if err != nil {
		return 0, fmt.Errorf("balance: reap: %w", err)
	}
	total := toInt(res[0])
	raw, _ := res[1].([]any)
	if total == 0 && tracked {
		s.heldMu.Lock()
		if s.held[org] == gen {
			delete(s.held, org)
		}
		s.heldMu.Unlock()
	}
	if len(raw) == 0 {
		return 0, nil
	}
	ids := make([]string, 0, len(raw))
	for _, v := range raw {
		if id, ok := v.(string); ok {
			ids = append(ids, id)
		}
	}
	if s.cfg.Ledger != nil {
		busy, err := s.cfg.Ledger.UnsettledUsage(ctx, org, ids)
		if err != nil {
			return 0, fmt.Errorf("balance: reap %s: ledger: %w", org, err)
		}
		free := ids[:0]
		for _, id := range ids {
			if !busy[id] {
				free = append(free, id)
			}
		}
		ids = free
	}
	if len(ids) == 0 {
		return 0, nil
	}
	args := make([]any, 0, 2+len(ids))
	args = append(args, s.tombTTL, s.grace)
	for _, id := range ids {
		args = append(args, id)
	}
	n, err := s.run(ctx, scReap, k.releaseKeys(), args...).Int64()
	if err != nil {
		return 0, fmt.Errorf("balance: reap: %w", err)
	}
	if n > 0 {
		s.log.Info("balance: reaped expired holds", "org", org, "released", n)
	}
	return int(n), nil
}

// State is an org's hot balance as one script read it.
type State struct {
	Exists    bool  // acct exists
	Balance   int64 // available balance (bal)
	Watermark int64 // highest ledger seq reflected in Balance
	Epoch     Epoch
	Held      int64 // Σ holds
	Holds     int   // holds, finished or not
	Finished  int   // of which finished (their requests are over; they wait for the settle)
	Pinned    int   // of which pinned
	// Expired is what rollovers of expiries took out of Balance and the ledger's expire entries
	// have not yet (docs/grants.md): Balance + Held + Expired = B(Watermark).
	Expired int64
	// Oldest is the earliest reserve time among the holds (the Unix epoch for a hold whose
	// record has none; zero without holds): a grant's expire entry waits for the holds reserved
	// before its expiry.
	Oldest time.Time
}

// InFlight is the number of unfinished holds: the requests still running.
func (st State) InFlight() int { return st.Holds - st.Finished }

// State reads bal, wm, epoch, Σ holds and the hold counts together (the reconciler compares
// Balance+Held with the ledger's balance at Watermark).
func (s *Store) State(ctx context.Context, org string) (State, error) {
	if err := checkOrg(org); err != nil {
		return State{}, err
	}
	k := s.keys(org)
	res, err := s.run(ctx, scState, []string{k.Acct, k.Holds, k.Hexp, k.Hfin}, s.pinFloor).Slice()
	if err != nil {
		return State{}, fmt.Errorf("balance: state: %w", err)
	}
	var st State
	if res[0] != nil {
		st.Exists = true
		st.Balance = toInt(res[0])
		st.Watermark = toInt(res[1])
		if e, ok := res[2].(string); ok {
			if st.Epoch, err = ParseEpoch(e); err != nil {
				return st, err
			}
		}
	}
	vals, _ := res[3].([]any)
	for _, v := range vals {
		st.Held += holdAmount(v)
		rt := time.UnixMilli(holdReserved(v)).UTC()
		if st.Oldest.IsZero() || rt.Before(st.Oldest) {
			st.Oldest = rt
		}
	}
	st.Finished = int(toInt(res[5]))
	st.Holds = int(toInt(res[4])) + st.Finished
	st.Pinned = int(toInt(res[6]))
	if len(res) > 7 {
		rolled, _ := res[7].([]any)
		for _, v := range rolled {
			st.Expired += toInt(v)
		}
	}
	return st, nil
}

// holdReserved reads the reserve time (ms) of a hold record ("<amount>|<reserve ms>|…"; 0 when
// it has none).
func holdReserved(v any) int64 {
	str, _ := v.(string)
	_, rest, _ := strings.Cut(str, "|")
	rt, _, _ := strings.Cut(rest, "|")
	n, _ := strconv.ParseInt(rt, 10, 64)
	return n
}

// holdAmount reads the amount of a hold record ("<amount>" or "<amount>|…", lua/lib/limits.lua).
func holdAmount(v any) int64 {
	str, _ := v.(string)
	a, _, _ := strings.Cut(str, "|")
	return toInt(a)
}

func checkModel(m string) error {
	if m == "" || len(m) > 256 {
		return fmt.Errorf("%w: %q", ErrInvalidModel, m)
	}
	return nil
}

// The learned max's refresh: how long a caller that has a value (expired) waits for the
// refresh before it uses that value, and how long the shared refresh may take.
const (
	modelMaxWait        = 100 * time.Millisecond
	modelMaxLoadTimeout = 2 * time.Second
)

// ModelMax returns the model's learned max cost (0 if none: the key is missing, e.g. lost with
// Redis, and the caller's ledger max cost stands in): ModelState's Max.
func (s *Store) ModelMax(ctx context.Context, model string) (int64, error) {
	st, err := s.ModelState(ctx, model)
	return st.Max, err
}

// ModelState returns what Redis says of the model — its learned max cost and the version of its
// last change (TouchModel) — served from an in-process cache for ModelMaxCacheTTL. Both are
// read in one round trip (a pipeline). An expired value is refreshed by one read shared by
// every caller; a caller waits for it at most modelMaxWait (then, or when the read fails, it is
// served the expired value, whose Read tells its age), so that a model whose keys live on a
// dead or slow node stalls no request: a failed refresh keeps the old value for another
// ModelMaxCacheTTL. Only the first read of a model waits for Redis (within ctx).
func (s *Store) ModelState(ctx context.Context, model string) (ModelState, error) {
	if err := checkModel(model); err != nil {
		return ModelState{}, err
	}
	var old *cachedMax
	if v, ok := s.maxCache.Load(model); ok {
		old = v.(*cachedMax)
		if time.Since(old.at) < s.cfg.ModelMaxCacheTTL {
			return old.st, nil
		}
	}
	// One read per model at a time: the callers that find the entry expired together share it
	// (without this, every request in flight at the moment of expiry sent its own).
	ch := s.maxLoad.DoChan(model, func() (any, error) {
		// Not bound to one caller's cancellation: the others wait for the same answer.
		gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), modelMaxLoadTimeout)
		defer cancel()
		st, err := s.readModelState(gctx, model)
		if err != nil {
			s.noteErr(err)
			if old != nil { // keep serving it, unless a newer value came meanwhile
				s.maxCache.CompareAndSwap(model, old, &cachedMax{st: old.st, at: time.Now()})
			}
			return ModelState{}, err
		}
		s.maxCache.Store(model, &cachedMax{st: st, at: st.Read})
		return st, nil
	})
	var wait <-chan time.Time
	if old != nil {
		t := time.NewTimer(modelMaxWait)
		defer t.Stop()
		wait = t.C
	}
	select {
	case r := <-ch:
		if r.Err == nil {
			return r.Val.(ModelState), nil
		}
		if old != nil {
			return old.st, nil
		}
		return ModelState{}, fmt.Errorf("balance: model state: %w", r.Err)
	case <-wait:
		return old.st, nil
	case <-ctx.Done():
		if old != nil {
			return old.st, nil
		}
		return ModelState{}, fmt.Errorf("balance: model state: %w", ctx.Err())
	}
}

// readModelState reads the model's learned max and version in one round trip.
func (s *Store) readModelState(ctx context.Context, model string) (ModelState, error) {
	st := ModelState{Read: time.Now()}
	var maxCmd, verCmd *redis.StringCmd
	_, err := s.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		maxCmd = p.Get(ctx, s.modelKey(model))
		verCmd = p.Get(ctx, s.modelVerKey(model))
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return st, err
	}
	n, err := maxCmd.Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		return st, err
	}
	ver, err := verCmd.Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return st, err
	}
	st.Max = n
	st.Version, st.Deleting = strings.CutPrefix(ver, deletingMark)
	return st, nil
}

// setCachedMax puts a learned max the store wrote into the cached state of the model, if it has
// one (its version and age stay: only a read tells them).
func (s *Store) setCachedMax(model string, v int64) {
	for {
		cur, ok := s.maxCache.Load(model)
		if !ok {
			return
		}
		old := cur.(*cachedMax)
		st := old.st
		st.Max = v
		if s.maxCache.CompareAndSwap(model, old, &cachedMax{st: st, at: old.at}) {
			return
		}
	}
}

// RaiseModelMax raises the model's learned max cost to cost, capped at ceiling (> 0), and to
// at least floor (≥ 0): the ledger's max cost for the model, so that a key lost with Redis is
// never rebuilt below what the ledger learned (the floor is not capped: the ledger's value
// stands). It never lowers the stored max. It returns the max now stored.
func (s *Store) RaiseModelMax(ctx context.Context, model string, cost, floor, ceiling int64) (int64, error) {
	if err := checkModel(model); err != nil {
		return 0, err
	}
	if cost <= 0 || cost > MaxAmount || ceiling <= 0 || ceiling > MaxAmount || floor < 0 || floor > MaxAmount {
		return 0, fmt.Errorf("%w: cost %d floor %d ceiling %d", ErrInvalidAmount, cost, floor, ceiling)
	}
	v, err := s.run(ctx, scRaiseMax, []string{s.modelKey(model)},
		strconv.FormatInt(cost, 10), strconv.FormatInt(ceiling, 10), strconv.FormatInt(floor, 10)).Text()
	if err != nil {
		return 0, fmt.Errorf("balance: raise model max: %w", err)
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("balance: raise model max: %w", err)
	}
	s.setCachedMax(model, n)
	return n, nil
}

// SetModelMax sets the model's learned max cost (an admin may lower it); 0 deletes it. An
// admin write (through Config.Admin; errDataPlane with DataOnly), of a data-plane key.
func (s *Store) SetModelMax(ctx context.Context, model string, v int64) error {
	if err := checkModel(model); err != nil {
		return err
	}
	if v < 0 || v > MaxAmount {
		return fmt.Errorf("%w: model max %d", ErrInvalidAmount, v)
	}
	if s.adm == nil {
		return fmt.Errorf("balance: set model max: %w", errDataPlane)
	}
	var err error
	if v == 0 {
		err = s.adm.Del(ctx, s.modelKey(model)).Err()
	} else {
		err = s.adm.Set(ctx, s.modelKey(model), v, 0).Err()
	}
	if err != nil {
		s.noteErr(err)
		return fmt.Errorf("balance: set model max: %w", err)
	}
	s.setCachedMax(model, v)
	return nil
}
