package ledger

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/llmescrow/escrow/pricing"
)

// The console: what an operator lists and looks up (orgs, keys, ledger entries, usage reports,
// one request), the names they give orgs and keys, and the audit trail of admin writes. Both
// ledgers implement Console and pass the same conformance suite (ledger/ledgertest).
//
// Lists are paged with an opaque cursor: a page's Next is given back as the next query's Cursor,
// and an empty Next means the list is done. A cursor names the last row seen, never an offset,
// so rows written between two pages neither repeat nor vanish from the pages still to come.

// Sentinel errors of the console.
var (
	ErrInvalidCursor  = errors.New("ledger: invalid cursor")
	ErrInvalidQuery   = errors.New("ledger: invalid query")
	ErrUnknownRequest = errors.New("ledger: unknown request")
	ErrModelInUse     = errors.New("ledger: model has usage")
	// ErrModelInFlight: a model with requests in flight (on any process) is not deleted.
	ErrModelInFlight = errors.New("ledger: model has requests in flight")
)

// MaxNameLen is the longest display name of an org or a key, in bytes.
const MaxNameLen = 200

// Page sizes of the lists.
const (
	DefaultPageSize = 100
	MaxPageSize     = 1000
)

// Console is the read side of a ledger and the operator's bookkeeping around it.
type Console interface {
	// ListOrgs lists orgs by id.
	ListOrgs(ctx context.Context, q ListQuery) (Page[OrgInfo], error)
	// Org returns one org (ErrUnknownOrg).
	Org(ctx context.Context, org string) (OrgInfo, error)
	// SetOrgName sets an org's display name (ErrUnknownOrg).
	SetOrgName(ctx context.Context, org, name string) error

	// ListKeys lists an org's keys by creation time, revoked ones included (ErrUnknownOrg).
	ListKeys(ctx context.Context, org string, q ListQuery) (Page[KeyInfo], error)
	// SetKeyName sets a key's display name (ErrUnknownKey).
	SetKeyName(ctx context.Context, id, name string) error

	// ListEntries lists an org's ledger entries, newest first, each charge with its request
	// (ErrUnknownOrg).
	ListEntries(ctx context.Context, org string, q EntryQuery) (Page[EntryInfo], error)
	// UsageReport sums an org's accounted usage (its charge entries) per group. The rows' costs
	// add up to minus the charges of the org's ledger in the range.
	UsageReport(ctx context.Context, org string, q UsageQuery) ([]UsageRow, error)
	// TopSpenders lists the orgs that spent the most in a time range (by each request's record
	// time, like UsageReport): one row per org (Group = the org id) with its accounted usage,
	// by cost descending then org id, at most q.Limit rows.
	TopSpenders(ctx context.Context, q TopQuery) ([]UsageRow, error)
	// Request returns one request's usage by its id (ErrUnknownRequest).
	Request(ctx context.Context, id string) (RequestInfo, error)
	// Spend reads, in one snapshot, the org's ledger balance and the sum of its charges, and
	// the name, project and charges of one of its keys: all of them, and those attributed (by
	// reserve time, as limits count them) on or after the UTC day of each of since
	// (ErrUnknownOrg; an unknown key id reads as a key with no name and no charges). It reads
	// the sums the ledger keeps as it charges (per org, per key, per key and UTC day), never
	// the charges themselves: its cost does not grow with them (issue 34).
	Spend(ctx context.Context, org, keyID string, since []time.Time) (Spend, error)

	// DeleteModel deletes a model no usage event names (ErrUnknownModel, ErrModelInUse).
	DeleteModel(ctx context.Context, name string) error

	// RecordAudit appends an admin write to the audit trail; AuditLog lists it, newest first.
	RecordAudit(ctx context.Context, r AuditRecord) (AuditRecord, error)
	AuditLog(ctx context.Context, q ListQuery) (Page[AuditRecord], error)
}

// ListQuery asks for one page of a list.
type ListQuery struct {
	Cursor string // "" for the first page; else a page's Next
	Limit  int    // rows per page: 0 means DefaultPageSize; at most MaxPageSize
}

// Page is one page of a list. Next is "" on the last page.
type Page[T any] struct {
	Data []T
	Next string
}

// OrgInfo is an org as the console shows it (its hot balance is added by Ops).
type OrgInfo struct {
	ID         string    `json:"id"`
	Name       string    `json:"name"`
	Balance    int64     `json:"ledger_balance"`
	LedgerSeq  int64     `json:"ledger_seq"`
	SettledSeq int64     `json:"settled_seq"`
	CreatedAt  time.Time `json:"created_at"`
	// Exempt: the org's requests are metered and charged but never held nor refused for balance
	// (OrgFlags; off by default).
	Exempt bool `json:"exempt"`
}

// KeyInfo is an API key as the console shows it; the secret is never kept.
type KeyInfo struct {
	ID        string     `json:"id"`
	Org       string     `json:"org"`
	Name      string     `json:"name"`
	CreatedAt time.Time  `json:"created_at"`
	RevokedAt *time.Time `json:"revoked_at"`
	Project   string     `json:"project"` // "" for none
	Frozen    bool       `json:"frozen"`
	// Models is the key's allow-list of models (names, or prefixes ending in '*'); empty: every
	// model.
	Models []string `json:"models,omitempty"`
	// LastUsedAt is the reserve time of the key's latest accounted request (nil: none yet);
	// the account pass keeps it, so it trails the request by the accounting lag.
	LastUsedAt *time.Time `json:"last_used_at"`
}

// EntryQuery filters an org's ledger entries.
type EntryQuery struct {
	ListQuery
	Kind EntryKind // "" for every kind
	// From, To: entry time in [From, To); a zero bound is open. A charge's time is its
	// request's reserve time (its record time for a fail-open request), as limits and usage
	// reports count it; any other entry's is its creation.
	From, To time.Time
}

// EntryInfo is one ledger entry; a charge carries the request it bills.
type EntryInfo struct {
	LedgerEntry
	Request *EntryRequest `json:"request,omitempty"`
}

// EntryRequest is the usage event behind a charge entry.
type EntryRequest struct {
	ID         string        `json:"id"`
	KeyID      string        `json:"key_id,omitempty"`
	Project    string        `json:"project,omitempty"`  // the key's project when the request was reserved
	EndUser    string        `json:"end_user,omitempty"` // the end user the request named
	Model      string        `json:"model"`
	Usage      pricing.Usage `json:"usage"`
	Cost       int64         `json:"cost"`
	HoldAmount int64         `json:"hold_amount"`
	Estimated  bool          `json:"estimated"`
}

// Usage report groupings.
const (
	GroupByDay   = "day"
	GroupByModel = "model"
	GroupByKey   = "key"
	// GroupByEndUser groups by the request's end user ("" for none), as it was recorded.
	GroupByEndUser = "end_user"
)

// UsageQuery selects and groups an org's usage by the time each request was recorded.
type UsageQuery struct {
	From, To time.Time // [From, To) of the requests' reserve times (see EntryQuery); a zero bound is open
	GroupBy  string    // GroupByDay (UTC, "2006-01-02"), GroupByModel, GroupByKey or GroupByEndUser ("" for none)
}

// TopQuery asks for the orgs that spent the most in [From, To) (a zero bound is open).
type TopQuery struct {
	From, To time.Time
	Limit    int // rows: 0 means DefaultTopSpenders; at most MaxPageSize
}

// DefaultTopSpenders is how many orgs TopSpenders lists when the query does not say.
const DefaultTopSpenders = 10

// Check validates a query and fills its default limit.
func (q *TopQuery) Check() error {
	switch {
	case q.Limit < 0 || q.Limit > MaxPageSize:
		return fmt.Errorf("%w: limit must be between 1 and %d", ErrInvalidQuery, MaxPageSize)
	case q.Limit == 0:
		q.Limit = DefaultTopSpenders
	}
	if !q.From.IsZero() && !q.To.IsZero() && !q.To.After(q.From) {
		return fmt.Errorf("%w: to must be after from", ErrInvalidQuery)
	}
	return nil
}

// UsageRow is one group of a usage report: its token totals, and Units the sum of each class's
// units (pricing.Usage.Units) over its requests.
type UsageRow struct {
	Group      string        `json:"group"`
	Requests   int64         `json:"requests"`
	Cost       int64         `json:"cost"`
	Prompt     int64         `json:"prompt_tokens"`
	Cached     int64         `json:"cached_tokens"` // Units[pricing.CachedInput], kept for the clients of earlier releases
	Completion int64         `json:"completion_tokens"`
	Reasoning  int64         `json:"reasoning_tokens"`
	Units      pricing.Units `json:"units,omitempty"`
}

// Add adds one request's usage and cost to the row.
func (r *UsageRow) Add(cost int64, u pricing.Usage) {
	r.Requests++
	r.Cost += cost
	r.Prompt += u.Prompt
	r.Completion += u.Completion
	r.Reasoning += u.Reasoning
	for c, n := range u.Units {
		if r.Units == nil {
			r.Units = pricing.Units{}
		}
		r.Units[c] += n
	}
	r.Fill()
}

// Fill sets the fields derived from Units (Cached); a row with no units has nil Units.
func (r *UsageRow) Fill() {
	if len(r.Units) == 0 {
		r.Units = nil
	}
	r.Cached = r.Units[pricing.CachedInput]
}

// Spend is an org's money as its ledger has it (Console.Spend): Balance is the ledger balance,
// Charged the sum of its charges (micro-units ≥ 0), so Balance + Charged is every credit and
// adjustment it got. Key is one of its keys.
type Spend struct {
	Balance int64    `json:"ledger_balance"`
	Charged int64    `json:"charged"`
	Key     KeySpend `json:"key"`
}

// KeySpend is one key's charges: all of them, and Since[i] those attributed at or after the
// i-th instant asked for.
type KeySpend struct {
	ID      string  `json:"id"`
	Name    string  `json:"name"`
	Project string  `json:"project"` // "" for none
	Charged int64   `json:"charged"`
	Since   []int64 `json:"since"`
}

// Request statuses.
const (
	RequestPending   = "pending"   // recorded, not yet a ledger entry
	RequestAccounted = "accounted" // charged by ledger entry Seq
	RequestVoided    = "voided"    // its record timed out and the client was told it failed: never charged
)

// RequestInfo is one request's usage as the ledger holds it.
type RequestInfo struct {
	UsageEvent
	Status string `json:"status"`
	Seq    int64  `json:"seq,omitempty"` // its charge entry once accounted
}

// AuditRecord is one admin write: who did what to what, when.
type AuditRecord struct {
	ID     int64     `json:"id"`
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`
	Token  string    `json:"token,omitempty"`  // the id of the admin token used ("" for the bootstrap token)
	Action string    `json:"action"`           // e.g. "POST /admin/v1/orgs/:org/credits"
	Target string    `json:"target,omitempty"` // the org, key or model written
	Status int       `json:"status"`           // the answer's HTTP status
	Detail string    `json:"detail,omitempty"` // the request body (JSON), secrets never included
}

// Check validates a query: a known grouping, To after From.
func (q UsageQuery) Check() error {
	switch q.GroupBy {
	case GroupByDay, GroupByModel, GroupByKey, GroupByEndUser:
	default:
		return fmt.Errorf("%w: group_by must be day, model, key or end_user, not %q", ErrInvalidQuery, q.GroupBy)
	}
	if !q.From.IsZero() && !q.To.IsZero() && !q.To.After(q.From) {
		return fmt.Errorf("%w: to must be after from", ErrInvalidQuery)
	}
	return nil
}

// Check validates an entry query.
func (q EntryQuery) Check() error {
	switch q.Kind {
	case "", KindCharge, KindCredit, KindAdjust:
	default:
		return fmt.Errorf("%w: kind must be charge, credit or adjust, not %q", ErrInvalidQuery, q.Kind)
	}
	return nil
}

func CheckName(name string) error {
	if len(name) > MaxNameLen {
		return fmt.Errorf("%w: a name is at most %d bytes", ErrInvalidQuery, MaxNameLen)
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f {
			return fmt.Errorf("%w: a name has no control characters", ErrInvalidQuery)
		}
	}
	return nil
}

// PageOf makes a page from rows read with one more than limit: the extra row only tells that
// a next page exists, and the cursor names the last row kept.
func PageOf[T any](rows []T, limit int, cursor func(T) string) Page[T] {
	if len(rows) <= limit {
		return Page[T]{Data: rows}
	}
	rows = rows[:limit]
	return Page[T]{Data: rows, Next: cursor(rows[limit-1])}
}

func PageLimit(n int) int {
	if n <= 0 {
		return DefaultPageSize
	}
	return min(n, MaxPageSize)
}

// A cursor is base64url("v1" NUL kind NUL field NUL field …): opaque to clients, typed so a
// cursor of one list is refused by another.
func makeCursor(kind string, fields ...string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strings.Join(append([]string{"v1", kind}, fields...), "\x00")))
}

func readCursor(c, kind string, n int) ([]string, error) {
	b, err := base64.RawURLEncoding.DecodeString(c)
	if err != nil {
		return nil, fmt.Errorf("%w: not base64url", ErrInvalidCursor)
	}
	parts := strings.Split(string(b), "\x00")
	if len(parts) != n+2 || parts[0] != "v1" || parts[1] != kind {
		return nil, fmt.Errorf("%w: not a cursor of this list", ErrInvalidCursor)
	}
	return parts[2:], nil
}

func cursorInt(s string) (int64, error) {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalidCursor, err)
	}
	return v, nil
}

// Cursors of each list.
func OrgCursor(id string) string { return makeCursor("org", id) }
func KeyCursor(created time.Time, id string) string {
	return makeCursor("key", strconv.FormatInt(created.UnixMicro(), 10), id)
}
func EntryCursor(seq int64) string { return makeCursor("entry", strconv.FormatInt(seq, 10)) }
func AuditCursor(id int64) string  { return makeCursor("audit", strconv.FormatInt(id, 10)) }
func EndUserCursor(endUser string) string {
	return makeCursor("end_user", endUser)
}

// ParseEndUserCursor returns the end user an end-user cursor names ("" for no cursor).
func ParseEndUserCursor(c string) (string, error) {
	if c == "" {
		return "", nil
	}
	f, err := readCursor(c, "end_user", 1)
	if err != nil {
		return "", err
	}
	return f[0], nil
}

// ParseOrgCursor returns the org id an org cursor names ("" for no cursor: from the start).
func ParseOrgCursor(c string) (string, error) {
	if c == "" {
		return "", nil
	}
	f, err := readCursor(c, "org", 1)
	if err != nil {
		return "", err
	}
	return f[0], nil
}

// ParseKeyCursor returns the (created, id) a key cursor names.
func ParseKeyCursor(c string) (time.Time, string, error) {
	f, err := readCursor(c, "key", 2)
	if err != nil {
		return time.Time{}, "", err
	}
	us, err := cursorInt(f[0])
	if err != nil {
		return time.Time{}, "", err
	}
	return time.UnixMicro(us).UTC(), f[1], nil
}

func ParseSeqCursor(c, kind string) (int64, error) {
	f, err := readCursor(c, kind, 1)
	if err != nil {
		return 0, err
	}
	return cursorInt(f[0])
}

// Equal reports whether two rows are the same (nil and empty Units alike).
func (r UsageRow) Equal(o UsageRow) bool {
	return r.Group == o.Group && r.Requests == o.Requests && r.Cost == o.Cost && r.Prompt == o.Prompt && r.Cached == o.Cached &&
		r.Completion == o.Completion && r.Reasoning == o.Reasoning && maps.Equal(r.Units, o.Units)
}
