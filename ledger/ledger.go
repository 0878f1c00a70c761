package ledger

import (
	"context"
	"errors"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
)

// ErrUnknownOrg: no account for the org. It is also balance.ErrUnknownOrg (errors.Is), which
// is what balance.Ledger's Snapshot answers for such an org.
var ErrUnknownOrg error = &alsoError{msg: "ledger: unknown org", also: balance.ErrUnknownOrg}

// ErrInvalidAmount: an amount outside the one rule of amounts (balance: a whole number of
// micro-units in (0, balance.MaxAmount], signed for an adjust). It is also
// balance.ErrInvalidAmount (errors.Is), so one test covers an amount refused by either layer.
var ErrInvalidAmount error = &alsoError{msg: "ledger: invalid amount", also: balance.ErrInvalidAmount}

// alsoError is a sentinel of its own that is also another package's (errors.Is matches both).
type alsoError struct {
	msg  string
	also error
}

func (e *alsoError) Error() string { return e.msg }
func (e *alsoError) Unwrap() error { return e.also }

// Sentinel errors of the ledgers. Test for them with errors.Is.
var (
	ErrOrgExists         = errors.New("ledger: org already exists")
	ErrUnknownModel      = errors.New("ledger: unknown model")
	ErrUnknownKey        = errors.New("ledger: unknown api key")
	ErrReferenceConflict = errors.New("ledger: payment reference already used")
	ErrLedgerUnavailable = errors.New("ledger: ledger unavailable")
	ErrLockBusy          = errors.New("ledger: org locked by another worker")
	// ErrUsageRecorded: VoidUsage found the event itself stored first; it is (or will be)
	// charged, so the request it bills must be answered as a success.
	ErrUsageRecorded = errors.New("ledger: usage already recorded")
	// ErrNotRecorded: RecordUsage failed before anything reached the ledger (no connection
	// could be made, or the write was never sent), so the events are certainly not stored.
	ErrNotRecorded = errors.New("ledger: usage not recorded")
	// ErrConfig: a constructor (accounting.NewRecorder, NewWorker, OpenJournal; pgledger.Open, New)
	// was given a config field out of range; nothing was started.
	ErrConfig = errors.New("ledger: invalid config")
)

// Model is a priced model. Its JSON (model_json.go) gives each price class as a member
// "<class>_price" (input_price, cached_input_price, audio_output_price …). The highest price
// any input token of a request to it could be billed at is its Prices' MaxInputFor the classes
// the request can bill.
type Model struct {
	Name            string `json:"model"`
	pricing.Prices         // class → price (pricing.Class; unset classes default, Prices.Price)
	MaxInputTokens  int64  `json:"max_input_tokens"`  // context window; 0 = unknown
	MaxOutputTokens int64  `json:"max_output_tokens"` // 0 = unknown
	MaxCost         int64  `json:"max_cost"`          // learned max cost of one request (micro-units)
	DefaultHold     int64  `json:"default_hold"`      // hold when nothing better is known; > 0
}

// CostBound is CostBoundFor every class: the most one request can cost, whatever it bills.
func (m Model) CostBound() (bound int64, ok bool, err error) { return m.CostBoundFor(nil) }

// CostBoundFor is the most one request that can bill the given classes can cost:
// MaxInputTokens × the highest input price among them (Prices.MaxInputFor) + MaxOutputTokens ×
// the highest output price (Prices.MaxOutputFor). ok is false when either token limit is
// unknown. nil classes: every class.
func (m Model) CostBoundFor(classes []pricing.Class) (bound int64, ok bool, err error) {
	if m.MaxInputTokens <= 0 || m.MaxOutputTokens <= 0 {
		return 0, false, nil
	}
	b, err := m.BoundFor(m.MaxInputTokens, m.MaxOutputTokens, classes)
	return b, err == nil, err
}

// Equal reports whether two models are the same, prices compared as they bill (Prices.Equal).
func (m Model) Equal(o Model) bool {
	return m.Name == o.Name && m.MaxInputTokens == o.MaxInputTokens && m.MaxOutputTokens == o.MaxOutputTokens &&
		m.MaxCost == o.MaxCost && m.DefaultHold == o.DefaultHold && m.Prices.Equal(o.Prices)
}

// Effective is the model with its prices' defaults filled in (Prices.WithDefaults): what the
// admin API shows, and what requests are priced with.
func (m Model) Effective() Model {
	m.Prices = m.Prices.WithDefaults()
	return m
}

// UsageEvent is what one served request consumed. Its ID is the request's hold id (a UUIDv7
// made by the server), which makes recording idempotent.
type UsageEvent struct {
	ID    string `json:"id"`
	Org   string `json:"org"`
	KeyID string `json:"key_id,omitempty"`
	// Project and ReservedAt are the request's limit attribution (balance.Reservation): its
	// cost counts against the limits of the org, of Project and of KeyID in the windows that
	// contain ReservedAt (the Redis clock at reserve). Zero values: none (fail-open requests are
	// attributed to their record time).
	Project    string    `json:"project,omitempty"`
	ReservedAt time.Time `json:"reserved_at,omitzero"`
	// EndUser is the request's end user ("" for none), attribution like KeyID and Project: it
	// counts against the end-user limits and is a usage report's group_by=end_user.
	EndUser    string        `json:"end_user,omitempty"`
	Model      string        `json:"model"`
	Endpoint   string        `json:"endpoint,omitempty"`
	Usage      pricing.Usage `json:"usage"`
	Cost       int64         `json:"cost"`        // priced with the prices in force when the hold was taken
	HoldAmount int64         `json:"hold_amount"` // 0 for fail-open requests (no hold)
	Estimated  bool          `json:"estimated"`   // usage estimated (no usage reported by the upstream)
	// Choices is how many choices the request asked for (n, best_of); 0 counts as 1. The
	// account pass learns the model's max cost of one choice, ⌈Cost / Choices⌉, from it.
	Choices   int64     `json:"choices,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// EntryKind is the kind of a ledger entry.
type EntryKind string

const (
	KindCharge EntryKind = "charge" // a usage event's cost (delta ≤ 0)
	KindCredit EntryKind = "credit" // a recharge (delta > 0), idempotent by Ref across all orgs
	KindAdjust EntryKind = "adjust" // an admin correction (signed)
)

// LedgerEntry is one row of an org's ledger.
type LedgerEntry struct {
	Org       string    `json:"org"`
	Seq       int64     `json:"seq"`
	Delta     int64     `json:"delta"`
	Kind      EntryKind `json:"kind"`
	HoldID    string    `json:"hold_id,omitempty"`
	Ref       string    `json:"reference,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// Account is an org's row in the ledger.
type Account struct {
	Org        string `json:"org"`
	Balance    int64  `json:"balance"`     // after every entry up to LedgerSeq
	LedgerSeq  int64  `json:"ledger_seq"`  // the org's last entry
	SettledSeq int64  `json:"settled_seq"` // entries up to here are known to be in the hot balance
	Pending    int64  `json:"pending"`     // usage events not yet accounted
}

// APIKey is a stored API key; only a hash of the secret is kept.
type APIKey struct {
	ID  string `json:"id"`
	Org string `json:"org"`
	// Models is the key's allow-list (KeyModels): empty for every model.
	Models []string `json:"models,omitempty"`
	// Exempt: the key's org is exempt (OrgFlags): its requests are never held nor refused for
	// balance.
	Exempt bool `json:"exempt,omitempty"`
}

// Ledger is the durable record: Postgres in production, memory for the embedded default. Both
// pass the same conformance suite (ledger/ledgertest). It is made of roles, one interface
// each, so that a part that needs only one of them says so: the Recorder takes a UsageStore,
// the hot balance (package balance) a balance.Ledger, the webhook sender the Webhooks role
// (which both ledgers have, though a Ledger need not), the middleware keys and models (its
// Directory: part of KeyStore and ModelStore).
type Ledger interface {
	balance.Ledger // snapshots, entries after a watermark, the reaper's check (the hot balance's view)
	Console        // the operator's lists, names and audit trail (read.go)
	LimitStore     // limits, projects and freezes (limits.go)
	EpochStore
	Accounts
	UsageStore
	Settlement
	Listener
	ModelStore
	KeyStore

	// EndUserUsed is, for each of limits (lifetime limits of each end user apart), what the
	// org's charges of endUser with seq ≤ upto count in the limit's unit: the hot balance loads
	// those counters one end user at a time with it (balance.Config.EndUserFields), and a
	// wrapper that embeds a Ledger passes it on.
	EndUserUsed(ctx context.Context, org, endUser string, limits []balance.Limit, upto int64) ([]balance.WindowUsed, error)

	// Close releases the ledger's resources.
	Close()
}

// EpochStore holds the ledger's epoch (DESIGN.md "Redis keys").
type EpochStore interface {
	// Epoch returns the ledger's epoch.
	Epoch(ctx context.Context) (balance.Epoch, error)
	// RaiseEpoch starts a new epoch with a higher generation and a new id. Run it after
	// restoring the ledger from a backup: no hot balance written against the old timeline (whose
	// watermarks may be above the restored sequence numbers) is trusted again.
	RaiseEpoch(ctx context.Context) (balance.Epoch, error)
}

// Accounts are the orgs' accounts and the entries an operator writes to them.
type Accounts interface {
	// CreateOrg creates an account with balance 0 (ErrOrgExists when it exists).
	CreateOrg(ctx context.Context, org string) error
	// Account returns the org's account (ErrUnknownOrg).
	Account(ctx context.Context, org string) (Account, error)
	// Credit adds amount (> 0) to the org as a credit entry, idempotent by ref, which is unique
	// across all orgs: the same ref for the same org and amount returns the original entry with
	// created=false; for another org or amount it is ErrReferenceConflict (revealing nothing).
	Credit(ctx context.Context, org string, amount int64, ref string) (e LedgerEntry, created bool, err error)
	// Adjust writes a signed admin correction (delta ≠ 0), idempotent by ref like Credit.
	Adjust(ctx context.Context, org string, delta int64, ref string) (LedgerEntry, bool, error)
}

// UsageStore is where served requests' usage is written: the Recorder's (and its journal
// replay's) whole view of the ledger.
type UsageStore interface {
	// RecordUsage stores usage events durably before it returns, in one round trip for the
	// whole batch. An event whose ID is already stored (or voided) is ignored (never charged
	// twice). An error that wraps ErrNotRecorded means nothing was stored; any other error
	// leaves the outcome unknown (VoidUsage settles it).
	RecordUsage(ctx context.Context, events []UsageEvent) error
	// VoidUsage makes sure the usage event ev.ID is never charged: it stores a tombstone for the
	// id (the event with status voided, kept for the record), in the same table and under the
	// same key as RecordUsage's events, so a RecordUsage of that id that lands later is a
	// no-op. It answers ErrUsageRecorded when the event itself was stored first (a concurrent
	// RecordUsage still in flight is waited for, never raced); voiding twice is fine. A voided
	// event is never pending, accounted, or reported by UnsettledUsage.
	VoidUsage(ctx context.Context, ev UsageEvent) error
}

// QuietUsageStore is a UsageStore that can also store usage without notifying its listeners
// (Subscribe). Both ledgers are one. A Recorder with a Wake uses it: the worker it wakes runs in
// the same process, so a NOTIFY per batch would only wake every listener of the database (every
// other proxy's worker among them, to race for the same events) for nothing. Events stored
// quietly are pending like any other: any worker's pass, or its sweep, accounts them.
type QuietUsageStore interface {
	UsageStore
	// RecordUsageQuiet is RecordUsage without the notification.
	RecordUsageQuiet(ctx context.Context, events []UsageEvent) error
}

// Settlement is the worker's pass over the ledger: pending usage becomes entries, entries reach
// the hot balance and are marked settled.
type Settlement interface {
	// AccountPending turns up to limit pending usage events into charge entries: per org, in one
	// transaction holding the org's advisory lock, the balance drops by the costs and each entry
	// takes the next sequence number. Orgs locked by another worker are left for later. It
	// returns how many events it accounted.
	AccountPending(ctx context.Context, limit int) (int, error)
	// AccountPass is AccountPending that also says which orgs got entries and, per model, the
	// highest cost of one choice among the real (not estimated) costs it accounted; and, for
	// the orgs that were fully settled before it, the entries it wrote with the epoch, which
	// are then what UnsettledEntries would return (AccountResult.Settle).
	AccountPass(ctx context.Context, limit int) (AccountResult, error)
	// UnsettledEntries returns up to limit entries of org with Seq > settled_seq, in Seq order,
	// and the epoch read in the same transaction.
	UnsettledEntries(ctx context.Context, org string, limit int) ([]balance.Entry, balance.Epoch, error)
	// MarkSettled records that the org's entries up to seq are in the hot balance
	// (settled_seq = GREATEST(settled_seq, seq)).
	MarkSettled(ctx context.Context, org string, seq int64) error
	// UnsettledEntriesOf is UnsettledEntries for several orgs in one read: up to limit entries
	// of each org, and the epoch read with them. Orgs with nothing to settle are left out.
	UnsettledEntriesOf(ctx context.Context, orgs []string, limit int) (map[string][]balance.Entry, balance.Epoch, error)
	// MarkSettledMany is MarkSettled for several orgs in one write (org → seq); orgs with no
	// account are skipped.
	MarkSettledMany(ctx context.Context, marks map[string]int64) error
	// OrgsToSettle lists up to limit orgs with settled_seq < ledger_seq or pending usage.
	OrgsToSettle(ctx context.Context, limit int) ([]string, error)
}

// Listener tells the worker which orgs have new work, so that it settles within moments instead
// of on its sweep.
type Listener interface {
	// Subscribe delivers the org of every transaction that writes entries or usage events (NOTIFY
	// for Postgres), best effort: a sweep covers what it misses. The channel closes with ctx.
	// Usage stored with RecordUsageQuiet is not delivered; a ledger may also leave out its own
	// account passes (memledger does, pgledger when pgledger.Open made it), whose caller settles
	// their orgs from the AccountResult.
	Subscribe(ctx context.Context) (<-chan string, error)
}

// ModelStore holds the priced models.
type ModelStore interface {
	// PutModel creates or replaces a model's prices and limits; the max cost it stores is never
	// below the one already stored (what the ledger learned).
	PutModel(ctx context.Context, m Model) error
	// Model returns a model (ErrUnknownModel).
	Model(ctx context.Context, name string) (Model, error)
	// Models lists every model.
	Models(ctx context.Context) ([]Model, error)
	// RaiseMaxCost raises the model's learned max cost to cost if it is higher (never lowers).
	RaiseMaxCost(ctx context.Context, model string, cost int64) error
}

// KeyStore holds the API keys (only a hash of each secret).
type KeyStore interface {
	// CreateKey makes a new API key for org; the secret is returned once and only its hash kept.
	CreateKey(ctx context.Context, org string) (APIKey, string, error)
	// LookupKey resolves a secret key (ErrUnknownKey, also for revoked keys).
	LookupKey(ctx context.Context, secret string) (APIKey, error)
	// RevokeKey revokes a key by id (ErrUnknownKey).
	RevokeKey(ctx context.Context, id string) error
}
