package balance

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// ScopeKind is what a limit or a freeze applies to.
type ScopeKind string

// Scope kinds.
const (
	ScopeOrg     ScopeKind = "org"     // every request of the org
	ScopeProject ScopeKind = "project" // the requests of the keys in one project
	ScopeKey     ScopeKind = "key"     // the requests of one API key
	// ScopeEndUser: the requests of one end user (the OpenAI user field, Anthropic
	// metadata.user_id, or a configured header). Without an ID, a limit of this scope applies to
	// each end user apart (one counter per end user and window); with an ID, to that end user.
	ScopeEndUser ScopeKind = "end_user"
)

// Scope is an org (ID ""), one of its projects or keys, or end users (ID "": each apart).
type Scope struct {
	Kind ScopeKind
	ID   string
}

func (s Scope) String() string {
	if s.Kind == ScopeOrg {
		return "org"
	}
	return string(s.Kind) + ":" + s.ID
}

// Window is a limit's period; boundaries are UTC on the Redis clock.
type Window string

// Windows.
const (
	Lifetime Window = "lifetime" // one window, never reset
	Minute   Window = "minute"
	Hour     Window = "hour"
	Day      Window = "day"
	Week     Window = "week"  // starting Monday 00:00
	Month    Window = "month" // calendar month
)

// Bounds returns the start of the window that contains t and the start of the next one, in UTC
// (zero times for Lifetime). The scripts compute the same bounds from the Redis clock
// (lua/lib/limits.lua); this is the Go side of the rule, for a ledger that groups spend by
// window and for reset times.
func (w Window) Bounds(t time.Time) (start, next time.Time) {
	t = t.UTC()
	y, m, d := t.Date()
	switch w {
	case Minute:
		start = t.Truncate(time.Minute)
		return start, start.Add(time.Minute)
	case Hour:
		start = t.Truncate(time.Hour)
		return start, start.Add(time.Hour)
	case Day:
		start = time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
		return start, start.AddDate(0, 0, 1)
	case Week:
		back := (int(t.Weekday()) + 6) % 7 // days since Monday
		start = time.Date(y, m, d-back, 0, 0, 0, 0, time.UTC)
		return start, start.AddDate(0, 0, 7)
	case Month:
		start = time.Date(y, m, 1, 0, 0, 0, 0, time.UTC)
		return start, start.AddDate(0, 1, 0)
	}
	return time.Time{}, time.Time{}
}

// StartMS is the window start of t as a counter field has it: ms since the Unix epoch (0 for
// Lifetime).
func (w Window) StartMS(t time.Time) int64 {
	if w == Lifetime {
		return 0
	}
	s, _ := w.Bounds(t)
	return s.UnixMilli()
}

func (w Window) valid() bool {
	switch w {
	case Lifetime, Minute, Hour, Day, Week, Month:
		return true
	}
	return false
}

// Unit is what a limit counts.
type Unit string

// Units.
const (
	Money    Unit = ""         // micro-units of cost (the default)
	Requests Unit = "requests" // 1 per request served (held at reserve, given back if it fails)
	Tokens   Unit = "tokens"   // input + output tokens (held at the request's token bound)
)

// valid reports whether u is one of the units ("money" is not: Money is "").
func (u Unit) valid() bool { return u == Money || u == Requests || u == Tokens }

// String is "money" for Money.
func (u Unit) String() string {
	if u == Money {
		return "money"
	}
	return string(u)
}

// Count is what one charge of cost (micro-units) and tokens counts in u: the cost, 1 request,
// or the tokens. The scripts apply the same rule to holds and settled entries; a ledger that
// groups spend by window uses it.
func (u Unit) Count(cost, tokens int64) int64 {
	switch u {
	case Requests:
		return 1
	case Tokens:
		return tokens
	}
	return cost
}

// code is the unit's letter in lim's specs and hold records ("" for money: specs keep their
// three-part form).
func (u Unit) code() string {
	switch u {
	case Requests:
		return "r"
	case Tokens:
		return "t"
	}
	return ""
}

func unitOf(code string) Unit {
	switch code {
	case "r":
		return Requests
	case "t":
		return Tokens
	}
	return Money
}

// Limit caps what the requests in Scope may spend (or how many requests or tokens they may use,
// by Unit) in each Window. IDs are never reused; scope, window and unit never change (a change
// is a new limit).
type Limit struct {
	ID     string
	Scope  Scope
	Window Window
	Cap    int64 // in Unit (micro-units for Money), 0 < Cap ≤ MaxAmount
	Unit   Unit
	// RequireEndUser, on a limit of each end user apart (scope end_user without an ID): a
	// request of the org that names no end user is refused (ErrEndUserRequired) instead of being
	// counted by no end-user limit.
	RequireEndUser bool
}

// Limits is an org's limits, freezes and key → project map at one version of the ledger.
type Limits struct {
	Version  int64 // raised by every change; 0: none ever
	Limits   []Limit
	Frozen   []Scope           // frozen scopes: every new hold in them is refused
	Projects map[string]string // key id → project id (a key is in at most one project)
}

// WindowUsed is the ledger's spend in one limit's window: Σ over the entries (seq ≤ the
// snapshot's) attributed to it, grouped by their stored reserve time, of the limit's unit (the
// cost, 1 per charge, or the charge's tokens).
type WindowUsed struct {
	LimitID string
	Start   int64 // window start, ms since the Unix epoch (0 for Lifetime)
	// EndUser: for a limit of scope end_user without an ID (each end user apart), the end user
	// this spend is of; "" for every other limit.
	EndUser string
	Used    int64
}

// LimitSnapshot is the limit part of a Snapshot: the org's limits and the ledger's spend of
// their windows.
type LimitSnapshot struct {
	Limits
	Used []WindowUsed
}

// LimitLedger is a Ledger that keeps limits. Warm uses SnapshotSince instead of Snapshot when
// the ledger implements it.
type LimitLedger interface {
	Ledger
	// SnapshotSince is Snapshot plus the org's Limits and, in Used, the spend of every window
	// starting at or after the window (of each limit) that contains since — a time read from
	// the Redis clock before the snapshot — grouped by each entry's stored reserve time.
	SnapshotSince(ctx context.Context, org string, since time.Time) (Snapshot, error)
}

// Limit and freeze errors. Test for them with errors.Is.
var (
	// ErrLimit: a limit in scope would go over its cap (see *LimitError).
	ErrLimit = errors.New("balance: limit reached")
	// ErrFrozen: the org, the key's project or the key is frozen (see *FrozenError).
	ErrFrozen = errors.New("balance: frozen")
	// ErrInvalidLimits: limits, freezes or the key → project map are malformed.
	ErrInvalidLimits = errors.New("balance: invalid limits")
	// ErrEndUserRequired: the request names no end user, and a limit of each end user apart of
	// its org requires one (Limit.RequireEndUser); nothing was written.
	ErrEndUserRequired = errors.New("balance: end user required")
)

// LimitError is returned by Reserve when a limit in scope refuses the hold: nothing was written.
type LimitError struct {
	Limit    Limit
	Used     int64     // the window's counter when the hold was refused (in Limit.Unit)
	Amount   int64     // the hold asked for (in Limit.Unit: micro-units, 1 request, its tokens)
	ResetsAt time.Time // the next window's start; zero for Lifetime
	// At is when the hold was refused on the clock of the limit windows (the script's reserve
	// time: Redis TIME plus Config.ClockOffset): ResetsAt − At is the wait until the window
	// resets.
	At time.Time
	// Room is the largest hold the balance and every limit in scope would have taken (≤ 0:
	// none). Held is the sum of the unfinished holds counted in this limit's window (they leave
	// it, but for their cost, when they finish), counted only until Used − Held + Amount ≤ Cap,
	// as InsufficientError.Held (0 for a requests or tokens limit).
	Room, Held int64
	// TokenRoom is the largest token hold every tokens limit in scope would have taken (≤ 0:
	// none), valid when HaveTokenRoom (some tokens limit is in scope).
	TokenRoom     int64
	HaveTokenRoom bool
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("balance: limit %s (%s, %s, %s) reached: %d used of %d, %d needed",
		e.Limit.ID, e.Limit.Scope, e.Limit.Window, e.Limit.Unit, e.Used, e.Limit.Cap, e.Amount)
}

// Is makes errors.Is(err, ErrLimit) true.
func (e *LimitError) Is(target error) bool { return target == ErrLimit }

// FrozenError is returned by Reserve when a scope of the request is frozen.
type FrozenError struct {
	Scope Scope
}

func (e *FrozenError) Error() string { return "balance: frozen: " + e.Scope.String() }

// Is makes errors.Is(err, ErrFrozen) true.
func (e *FrozenError) Is(target error) bool { return target == ErrFrozen }

// validLimitID: ids, project ids and key ids go into lim's fields and counter field names, so
// they are 1..128 printable ASCII bytes without space or the separators , ; : |.
func validLimitID(s string) bool {
	if s == "" || len(s) > maxIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if b <= ' ' || b >= 0x7f || b == ',' || b == ';' || b == ':' || b == '|' {
			return false
		}
	}
	return true
}

// ValidateReserveKey checks a key id as Reserve does (ReserveRequest.KeyID; "" for none is
// valid): 1 to 128 printable ASCII bytes without space, braces or the separators , ; : |, since
// it names fields of the org's limits and counters. The ledgers' key ids ("key_" + hex) pass; a
// custom authenticator's may not (the error wraps ErrInvalidKeyID).
func ValidateReserveKey(id string) error { return checkRequestKey(id) }

// checkRequestKey checks a reserve's key id ("" for none): it names lim fields, so it follows
// validLimitID as well as the key id rule.
func checkRequestKey(id string) error {
	if id == "" {
		return nil
	}
	if err := checkKeyID(id); err != nil {
		return err
	}
	if !validLimitID(id) {
		return fmt.Errorf("%w: %q (no , ; : | in a key id)", ErrInvalidKeyID, id)
	}
	return nil
}

func checkScope(s Scope) error {
	switch s.Kind {
	case ScopeOrg:
		if s.ID != "" {
			return fmt.Errorf("%w: org scope with id %q", ErrInvalidLimits, s.ID)
		}
	case ScopeProject, ScopeKey:
		if !validLimitID(s.ID) {
			return fmt.Errorf("%w: %s id %q", ErrInvalidLimits, s.Kind, s.ID)
		}
	case ScopeEndUser:
		if s.ID != "" && (!validLimitID(s.ID) || strings.ContainsAny(s.ID, "{}")) {
			return fmt.Errorf("%w: end user %q (1 to 128 printable ASCII bytes without space or { } , ; : |)", ErrInvalidLimits, s.ID)
		}
	default:
		return fmt.Errorf("%w: scope %q", ErrInvalidLimits, s.Kind)
	}
	return nil
}

// limFields turns Limits into lim's fields (without v), checking them: see lua/lib/limits.lua.
func (l Limits) limFields() ([]any, error) {
	if l.Version < 0 {
		return nil, fmt.Errorf("%w: version %d", ErrInvalidLimits, l.Version)
	}
	specs := map[string][]string{}
	var order []string
	seen := map[string]bool{}
	for _, x := range l.Limits {
		switch {
		case !validLimitID(x.ID) || seen[x.ID]:
			return nil, fmt.Errorf("%w: limit id %q (empty, malformed or repeated)", ErrInvalidLimits, x.ID)
		case !x.Window.valid():
			return nil, fmt.Errorf("%w: limit %s: window %q", ErrInvalidLimits, x.ID, x.Window)
		case !x.Unit.valid():
			return nil, fmt.Errorf("%w: limit %s: unit %q", ErrInvalidLimits, x.ID, x.Unit)
		case x.Cap <= 0 || x.Cap > MaxAmount:
			return nil, fmt.Errorf("%w: limit %s: cap %d", ErrInvalidLimits, x.ID, x.Cap)
		case x.RequireEndUser && (x.Scope.Kind != ScopeEndUser || x.Scope.ID != ""):
			return nil, fmt.Errorf("%w: limit %s: only a limit of each end user apart requires an end user", ErrInvalidLimits, x.ID)
		}
		if err := checkScope(x.Scope); err != nil {
			return nil, fmt.Errorf("limit %s: %w", x.ID, err)
		}
		seen[x.ID] = true
		f := scopeField("", x.Scope)
		if _, ok := specs[f]; !ok {
			order = append(order, f)
		}
		spec := x.ID + "," + string(x.Window) + "," + strconv.FormatInt(x.Cap, 10)
		switch c := x.Unit.code(); {
		case x.RequireEndUser:
			spec += "," + c + ",q" // the flags after the unit (money: empty)
		case c != "":
			spec += "," + c
		}
		specs[f] = append(specs[f], spec)
	}
	out := make([]any, 0, 2*(len(order)+len(l.Frozen)+len(l.Projects)))
	for _, f := range order {
		out = append(out, f, strings.Join(specs[f], ";"))
	}
	for _, s := range l.Frozen {
		if err := checkScope(s); err != nil {
			return nil, fmt.Errorf("freeze: %w", err)
		}
		if s.Kind == ScopeEndUser {
			return nil, fmt.Errorf("%w: freeze of an end user (freezes are of the org, a project or a key)", ErrInvalidLimits)
		}
		out = append(out, scopeField("f", s), "1")
	}
	keys := make([]string, 0, len(l.Projects))
	for k := range l.Projects {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the same Limits always make the same arguments
	for _, k := range keys {
		p := l.Projects[k]
		if !validLimitID(k) || !validLimitID(p) {
			return nil, fmt.Errorf("%w: key %q in project %q", ErrInvalidLimits, k, p)
		}
		out = append(out, "m:"+k, p)
	}
	return out, nil
}

// scopeField is lim's field of a scope: o, p:<project>, k:<key>, e (each end user apart),
// e:<end user>, after prefix (f for freezes).
func scopeField(prefix string, s Scope) string {
	switch s.Kind {
	case ScopeEndUser:
		if s.ID == "" {
			return prefix + "e"
		}
		return prefix + "e:" + s.ID
	case ScopeProject:
		return prefix + "p:" + s.ID
	case ScopeKey:
		return prefix + "k:" + s.ID
	}
	return prefix + "o"
}

// PushLimits writes the org's limits, freezes and key → project map (ls, as the ledger has them
// at ls.Version) to Redis: the admin plane's one write of them (DESIGN.md "Two planes"; no
// data-plane script writes or deletes them). Unless Redis already has that version or a newer
// one of the store's ledger epoch, it replaces them and drops the org's hot balance and counters
// in the same call, so the next request reseeds them from a snapshot of that version (which
// counts the current windows' spend so far). Freezes take effect at once. The version in Redis is
// also the limits floor: a seed of a snapshot read before the change, written after this push,
// is refused and re-read instead of counting under the old limits. Re-pushing is safe. pushed
// reports whether this call wrote them. On a store of the data plane only (Config.DataOnly) an
// error wrapping ErrConfig.
func (s *Store) PushLimits(ctx context.Context, org string, ls Limits) (pushed bool, err error) {
	return s.pushLimits(ctx, org, s.epochArg(), ls)
}

func (s *Store) pushLimits(ctx context.Context, org string, epoch any, ls Limits) (bool, error) {
	if err := checkOrg(org); err != nil {
		return false, err
	}
	if s.adm == nil {
		return false, fmt.Errorf("balance: push limits: %w", errDataPlane)
	}
	lim, err := ls.limFields()
	if err != nil {
		return false, err
	}
	k := s.keys(org)
	args := make([]any, 0, 3+len(lim))
	args = append(args, strconv.FormatInt(ls.Version, 10), epoch, strconv.Itoa(len(lim)/2))
	args = append(args, lim...)
	n, err := s.runAdmin(ctx, scPushLim, []string{k.Acct, k.Lim, k.U}, args...).Int64()
	if err != nil {
		return false, fmt.Errorf("balance: push limits: %w: %w", ErrRedis, err)
	}
	return n == 1, nil
}

// pushSnapshotLimits pushes the limits of snap (under its epoch) for a seed that found them
// missing in Redis, when this store may: else, or when Redis refuses the admin key to its user
// (NOPERM), errNoLimits.
func (s *Store) pushSnapshotLimits(ctx context.Context, org string, snap Snapshot) error {
	if s.adm == nil {
		return errNoLimits
	}
	var ls Limits
	if snap.Limits != nil {
		ls = snap.Limits.Limits
	}
	_, err := s.pushLimits(ctx, org, snap.Epoch.String(), ls)
	if isNoPerm(err) {
		return fmt.Errorf("%w (%v)", errNoLimits, err) // not ErrRedis: Redis answered (no fail-open)
	}
	return err
}

// isNoPerm reports whether Redis refused a command to this connection's ACL user.
func isNoPerm(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), "NOPERM")
}

// Counter is one window counter of the hot state.
type Counter struct {
	LimitID string
	Start   int64  // window start, ms since the Unix epoch (0 for Lifetime)
	EndUser string // the end user of a per-end-user counter (a limit of scope end_user without an ID)
}

// Counters reads the org's window counters (u): the current windows' and any past ones still
// kept. While the hot balance exists, a current window's counter is the cost of the entries
// attributed to it up to the watermark plus the live holds added to it.
func (s *Store) Counters(ctx context.Context, org string) (map[Counter]int64, error) {
	if err := checkOrg(org); err != nil {
		return nil, err
	}
	// HSCAN, a thousand fields a call, rather than one HGETALL: an org with a million end users
	// has a million counters, and one reply of them all would block Redis for every other org.
	// Fields are read at slightly different instants (each one exactly); a field seen twice by
	// the scan is read twice.
	m := map[string]string{}
	for cursor := uint64(0); ; {
		kv, next, err := s.c.HScan(ctx, s.keys(org).U, cursor, "", 1000).Result()
		if err != nil {
			return nil, fmt.Errorf("balance: counters: %w: %w", ErrRedis, err)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		if cursor = next; cursor == 0 {
			break
		}
	}
	out := make(map[Counter]int64, len(m))
	for f, v := range m {
		id, start, ok := strings.Cut(f, ":")
		start, eu, _ := strings.Cut(start, ":") // '<id>:<start>:<end user>': a per-end-user counter
		ms, err1 := strconv.ParseInt(start, 10, 64)
		n, err2 := strconv.ParseInt(v, 10, 64)
		if !ok || err1 != nil || err2 != nil {
			return nil, fmt.Errorf("balance: counters: malformed field %q = %q", f, v)
		}
		out[Counter{LimitID: id, Start: ms, EndUser: eu}] = n
	}
	return out, nil
}

// Validate checks a scope by the rule lim applies (ErrInvalidLimits): the org scope has no id; a
// project or key id is 1..128 printable ASCII bytes without space or , ; : |. The ledgers check
// project ids, limits and freezes with it before storing them.
func (s Scope) Validate() error { return checkScope(s) }

// Valid reports whether w is one of the windows.
func (w Window) Valid() bool { return w.valid() }

// wantLimits asks the admin plane to push org's limits (a data-plane store met errNoLimits):
// best effort, the org is added to a set the admin plane's worker takes from.
func (s *Store) wantLimits(ctx context.Context, org string) {
	if err := s.c.SAdd(ctx, s.limWantKey(), org).Err(); err != nil {
		s.log.Warn("balance: asking the admin plane for an org's limits", "org", org, "err", err)
	}
}

// takeWantedLimits takes the orgs that data-plane stores asked limits for (wantLimits), a
// hundred a call, and calls fn for each; nothing on a store of the data plane only.
func (s *Store) takeWantedLimits(ctx context.Context, fn func(org string) error) error {
	if s.adm == nil {
		return nil
	}
	for range 1000 {
		orgs, err := s.adm.SPopN(ctx, s.limWantKey(), 100).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return fmt.Errorf("balance: wanted limits: %w: %w", ErrRedis, err)
		}
		for _, o := range orgs {
			if !validOrg(o) {
				continue
			}
			if err := fn(o); err != nil {
				return err
			}
		}
		if len(orgs) < 100 {
			return nil
		}
	}
	return nil
}
