package balance

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// MaxAmount bounds every amount, balance and hold, in micro-units: |x| ≤ 10^14. Redis turns Lua
// numbers into strings with %.14g, so scripts stay exact only below this bound; the Go layer
// checks it before any script call.
const MaxAmount int64 = 100_000_000_000_000

// Epoch identifies one ledger's lifetime: a generation (raised by an admin after a restore from
// backup) and a random id (new for every ledger created). A watermark is meaningful only against
// the epoch it was written with.
type Epoch struct {
	Gen int64
	ID  string
}

// String is the form stored in Redis: "<gen>:<id>".
func (e Epoch) String() string { return strconv.FormatInt(e.Gen, 10) + ":" + e.ID }

// IsZero reports whether the epoch is unset.
func (e Epoch) IsZero() bool { return e.Gen == 0 && e.ID == "" }

// ParseEpoch parses the String form.
func ParseEpoch(s string) (Epoch, error) {
	g, id, ok := strings.Cut(s, ":")
	if !ok || id == "" {
		return Epoch{}, fmt.Errorf("balance: malformed epoch %q", s)
	}
	n, err := strconv.ParseInt(g, 10, 64)
	if err != nil || n < 0 {
		return Epoch{}, fmt.Errorf("balance: malformed epoch %q", s)
	}
	return Epoch{Gen: n, ID: id}, nil
}

// Snapshot is an org's account as the ledger has it: the balance after every entry up to Seq.
type Snapshot struct {
	Epoch   Epoch
	Balance int64
	Seq     int64
	// With a LimitLedger: the org's limits and the spend of their current windows (see
	// LimitLedger.SnapshotSince). nil: no limits. (A pointer keeps Snapshot comparable.)
	Limits *LimitSnapshot
	// Expiries: the unspent rest of the org's grants that expire (and have no expire entry yet),
	// by expiry time (unix ms, the Redis clock), after every entry up to Seq (docs/grants.md).
	// nil: the org has never had a grant that expires. (A pointer keeps Snapshot comparable;
	// no type of its own keeps the package's names few.)
	Expiries *map[int64]int64
}

// Entry is one ledger entry as the hot balance applies it. Delta < 0 is a charge, > 0 a credit
// or positive adjustment. HoldID is the hold the entry settles ("" for credits and adjustments).
type Entry struct {
	Seq    int64
	Delta  int64
	HoldID string
	// Recorded is when the entry's cause was recorded, for the settle-lag measure: a charge's
	// usage event's created_at, else the entry's own. Filled by UnsettledEntries; zero when
	// unknown. The scripts never see it.
	Recorded time.Time
	// Attribution, for limits (a charge's usage; zero values: none). The cost (−Delta) counts
	// against the limits of the org, of Project and of KeyID in the windows that contain
	// ReservedAt (the reserve time Reserve returned).
	KeyID      string
	Project    string
	ReservedAt time.Time
	// EndUser is the charge's end user ("" for none): its cost counts against the end-user
	// limits that apply to it (each end user apart, or this one).
	EndUser string
	// Tokens is the charge's input + output tokens: what it counts against tokens limits (a
	// charge with a reserve time counts 1 against requests limits).
	Tokens int64

	// Grants (docs/grants.md). GrantExpiry: the entry is a credit of a grant that expires then
	// (its amount joins that expiry's rest). Expired: the entry is the expire entry of a grant
	// that expired then (Delta = −its unspent rest); LastOfExpiry on the last of that time's
	// expire entries (it gives back what the rollover took out). Expiries: the ledger's rests
	// per expiry (as Snapshot.Expiries) after this entry, read with it: set only on the last
	// entry of a read that is the org's latest, applied when the watermark ends at it (an empty,
	// non-nil map: nothing left to expire). Entries with any of these have no HoldID.
	GrantExpiry  time.Time
	Expired      time.Time
	LastOfExpiry bool
	Expiries     *map[int64]int64
}

// Ledger is what the hot balance needs from the ledger (implemented by package accounting).
// Every read goes to the primary.
type Ledger interface {
	// Snapshot first accounts the org's pending usage events (waiting for any half-done claim),
	// then returns the account's balance and ledger sequence, all in one transaction. An org
	// with no account: an error that is ErrUnknownOrg.
	Snapshot(ctx context.Context, org string) (Snapshot, error)
	// EntriesAfter returns up to limit entries of org with Seq > after, in Seq order, settled or
	// not, and the ledger epoch read in the same transaction.
	EntriesAfter(ctx context.Context, org string, after int64, limit int) ([]Entry, Epoch, error)
	// UnsettledUsage reports which of holdIDs have usage recorded that is not yet settled
	// (a pending usage event, or a ledger entry not yet marked settled).
	UnsettledUsage(ctx context.Context, org string, holdIDs []string) (map[string]bool, error)
}

// SettleStatus is the outcome of settling one entry.
type SettleStatus int

const (
	// NotReached: the script stopped before this entry (after a gap or a cold answer).
	NotReached SettleStatus = iota
	// Applied: the entry moved the balance and the watermark.
	Applied
	// Already: the entry was already in the balance (seq ≤ watermark); only its hold came back.
	Already
	// Gap: the entry is past watermark+1; entries watermark+1 … seq must be re-sent first.
	Gap
	// Cold: no hot balance for the org (or one of another ledger epoch); seed and settle again.
	Cold
)

func (s SettleStatus) String() string {
	switch s {
	case Applied:
		return "applied"
	case Already:
		return "already"
	case Gap:
		return "gap"
	case Cold:
		return "cold"
	default:
		return "not_reached"
	}
}

// Settled reports whether the entry may be marked settled in the ledger.
func (s SettleStatus) Settled() bool { return s == Applied || s == Already }

// The two ways Seed refuses a snapshot, leaving the org cold (both wrap ErrCold): the limits in
// Redis (lim, the admin plane's) are newer than the snapshot's (a change after it was read:
// read a new one), or they are missing, older or of another ledger epoch (the admin plane must
// push them first: a Redis data loss, an org never pushed; Warm pushes them when the store may
// write the admin plane, else the org stays cold until the admin plane does).
var (
	errStaleSnapshot = fmt.Errorf("%w: snapshot older than the org's pushed limits", ErrCold)
	errNoLimits      = fmt.Errorf("%w: the org's limits are not pushed to redis", ErrCold)
)

// errDataPlane: an admin-plane write (limits, revocations, model versions) on a store of the
// data plane only (Config.DataOnly): a configuration error.
var errDataPlane = fmt.Errorf("%w: an admin-plane write on a data-only store (Config.DataOnly)", ErrConfig)

// Sentinel errors. Test for them with errors.Is.
var (
	// ErrCold: the org has no hot balance of the current ledger epoch.
	ErrCold = errors.New("balance: org is cold")
	// ErrInsufficient: the balance does not cover the hold (see *InsufficientError).
	ErrInsufficient = errors.New("balance: insufficient balance")
	// ErrTooManyHolds: the org has as many requests in flight as its cap allows.
	ErrTooManyHolds = errors.New("balance: too many holds in flight")
	// ErrGone: the hold id was already settled or released (a late re-send); nothing was debited.
	ErrGone = errors.New("balance: hold already ended")
	// ErrGap: an entry arrived before the ones it follows (see *GapError).
	ErrGap = errors.New("balance: ledger gap")
	// ErrInvalidOrg: the org id breaks the org-id rule (see ValidateOrg).
	ErrInvalidOrg = errors.New("balance: invalid org id")
	// ErrInvalidAmount: an amount is ≤ 0 where it must be positive, or outside ±MaxAmount.
	ErrInvalidAmount = errors.New("balance: invalid amount")
	// ErrUnsupportedRedis: the Redis server is too old or misconfigured for escrow.
	ErrUnsupportedRedis = errors.New("balance: unsupported redis")
	// ErrRedis: a call to Redis failed or timed out, so whether it took effect is unknown. It is
	// the only failure for which a caller may let a request pass without a hold (fail-open):
	// availability is traded for the overdraft bound only while the hot balance cannot answer.
	ErrRedis = errors.New("balance: redis call failed")
	// ErrLedger: the ledger failed while a cold org was being warmed (snapshot or catch-up). The
	// org has no trustworthy hot balance, so no request of it may pass, fail-open or not.
	ErrLedger = errors.New("balance: ledger failed")
	// ErrUnknownOrg: the ledger has no account for the org (a cold org's snapshot found none).
	// Ledgers return an error that is ErrUnknownOrg for such an org; Reserve and Warm pass it
	// on (wrapped with ErrLedger).
	ErrUnknownOrg = errors.New("balance: org has no account")
)

// InsufficientError is returned by Reserve when the balance does not cover the hold.
type InsufficientError struct {
	Balance int64 // available balance when the hold was refused
	Amount  int64 // the hold asked for
	// Held is the sum of the org's unfinished holds when the hold was refused — money held by
	// requests in flight, whose unused part comes back when they finish — counted only until it
	// covers what the hold is missing: Balance + Held ≥ Amount exactly when the holds would
	// cover it (the refusal is "held", not "gone"); below that, Held is their whole sum.
	Held int64
}

func (e *InsufficientError) Error() string {
	return fmt.Sprintf("balance: insufficient balance: %d available, %d needed", e.Balance, e.Amount)
}

// Is makes errors.Is(err, ErrInsufficient) true.
func (e *InsufficientError) Is(target error) bool { return target == ErrInsufficient }

// GapError is returned by Settle when an entry is past watermark+1.
type GapError struct {
	Watermark int64 // the hot balance's watermark
	Seq       int64 // the entry that did not fit
}

func (e *GapError) Error() string {
	return fmt.Sprintf("balance: ledger gap: watermark %d, entry %d", e.Watermark, e.Seq)
}

// Is makes errors.Is(err, ErrGap) true.
func (e *GapError) Is(target error) bool { return target == ErrGap }

// More sentinel errors. Test for them with errors.Is.
var (
	// ErrInvalidHoldID: the hold id is empty, too long, or holds characters a hold id cannot take.
	ErrInvalidHoldID = errors.New("balance: invalid hold id")
	// ErrInvalidEntry: a settle entry is malformed (seq ≤ 0, out of order, delta outside ±MaxAmount).
	ErrInvalidEntry = errors.New("balance: invalid ledger entry")
	// ErrInvalidKeyID: an API key id is empty, too long, or holds spaces, control bytes or braces.
	ErrInvalidKeyID = errors.New("balance: invalid api key id")
	// ErrInvalidModel: the model name is empty or too long.
	ErrInvalidModel = errors.New("balance: invalid model name")
)
