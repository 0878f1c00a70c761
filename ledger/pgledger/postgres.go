package pgledger

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/grant"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/pricing"
)

// Config configures the Postgres ledger. The zero value is ready to use.
type Config struct {
	// SkipMigrations stops Open from applying the embedded migrations (package
	// migrations) before it returns. Default false: they are applied, under an advisory lock,
	// so several processes may start at once. New never migrates.
	SkipMigrations bool
	// Logger receives the subscription's reconnect warnings. Default slog.Default().
	Logger *slog.Logger
	// ReconnectDelay is the first wait before a lost LISTEN connection is re-made; it doubles up
	// to 30 s while Postgres stays away. Default 250 ms.
	ReconnectDelay time.Duration
	// ViewConns is the size of the pool the customer views read on (Spend: server/view.go), apart
	// from the request path's, so that customers polling them never hold a connection a request
	// waits for (issue 34). Open makes that pool; New uses ViewPool, else the caller's pool.
	// Default 3.
	ViewConns int32
	// ViewTimeout bounds each view read: the view pool's statement_timeout and the read's
	// context deadline. Default 2 s.
	ViewTimeout time.Duration
	// ViewPool is, for New, the pool the views read on (the caller keeps it); nil: New's pool.
	// Open ignores it.
	ViewPool *pgxpool.Pool
}

// Ledger is the ledger in PostgreSQL (the pool's current schema; see package migrations for
// the tables). Every query goes to the primary the pool points at.
//
// Locking. The writers of one org's ledger are serialized by the account row: every entry's
// seq comes from the account's ledger_seq, read or updated under its row lock. On top of that,
// accounting takes the org's advisory lock (key (hashtext(current_schema()), hashtext(org)), so
// two ledgers in two schemas never contend), always after the account row, never before, so
// accounting and Snapshot cannot deadlock: AccountPending takes rows with SKIP LOCKED and
// advisory locks with pg_try_advisory_xact_lock and leaves a busy org for later; Snapshot waits
// for both (a worker's half-done claim must be waited for, never skipped).
//
// Usage events of an org with no account are accounted anyway, creating the account (a
// request that was served is billed); such an account starts at balance 0 and goes negative.
//
// Notifications go to the channel "escrow_" + the first 16 hex digits of md5(current_schema()),
// so ledgers in different schemas of one database do not hear each other. Their payload is the
// org, followed, for an account pass of a ledger made by Open, by a space and that
// ledger's tag (see Subscribe).
type Ledger struct {
	pool   *pgxpool.Pool
	views  *pgxpool.Pool // the customer views' reads (Spend): Config.ViewConns
	owned  bool
	cfg    Config
	log    *slog.Logger
	closed chan struct{}
	// tag is set on every connection of an owned pool (escrow.notify_tag) and names this
	// ledger's account passes in their NOTIFY payloads; "" with a caller's pool.
	tag string
}

var (
	_ ledger.Ledger          = (*Ledger)(nil)
	_ ledger.QuietUsageStore = (*Ledger)(nil)
)

// Config's defaults.
const (
	defaultReconnectDelay = 250 * time.Millisecond
	defaultViewConns      = 3
	defaultViewTimeout    = 2 * time.Second
)

// withDefaults returns the config with every zero field set to its default; c may be nil.
func (c *Config) withDefaults() Config {
	var z Config
	if c != nil {
		z = *c
	}
	z.ReconnectDelay = cmp.Or(z.ReconnectDelay, defaultReconnectDelay)
	z.ViewConns = cmp.Or(z.ViewConns, defaultViewConns)
	z.ViewTimeout = cmp.Or(z.ViewTimeout, defaultViewTimeout)
	z.Logger = cmp.Or(z.Logger, slog.Default())
	return z
}

// validate refuses a negative ReconnectDelay.
func (c *Config) validate() error {
	if c.ReconnectDelay < 0 {
		return fmt.Errorf("%w: postgres ReconnectDelay %v must be ≥ 0", ledger.ErrConfig, c.ReconnectDelay)
	}
	if c.ViewConns < 0 || c.ViewTimeout < 0 {
		return fmt.Errorf("%w: postgres ViewConns %d and ViewTimeout %v must be ≥ 0", ledger.ErrConfig, c.ViewConns, c.ViewTimeout)
	}
	return nil
}

// Open connects to url (a pgx connection string; its search_path selects the schema)
// and, unless cfg says otherwise, applies the migrations; cfg may be nil for the defaults. The
// ledger owns the pool: Close closes it.
func Open(ctx context.Context, url string, cfg *Config) (*Ledger, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, wrapPg("open", err)
	}
	tag := ledger.RandomHex(8)
	pcfg.AfterConnect = tagConn(tag)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, wrapPg("open", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, wrapPg("open", err)
	}
	if !c.SkipMigrations {
		if _, err := migrations.Up(ctx, pool); err != nil {
			pool.Close()
			return nil, wrapPg("migrate", err)
		}
	}
	vcfg := pcfg.Copy()
	vcfg.MaxConns, vcfg.MinConns = c.ViewConns, 0
	vcfg.AfterConnect = viewConn(tag, c.ViewTimeout)
	views, err := pgxpool.NewWithConfig(ctx, vcfg)
	if err != nil {
		pool.Close()
		return nil, wrapPg("open views pool", err)
	}
	p := newPostgres(pool, c)
	p.owned, p.tag, p.views = true, tag, views
	return p, nil
}

// viewConn prepares a view pool's connection: the tag (tagConn) and the statement timeout. A
// session setting, like the tag, so that poolers that refuse unknown startup parameters work.
func viewConn(tag string, timeout time.Duration) func(context.Context, *pgx.Conn) error {
	return func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `SELECT set_config('escrow.notify_tag', $1, false), set_config('statement_timeout', $2, false)`,
			tag, strconv.FormatInt(timeout.Milliseconds(), 10))
		return err
	}
}

// tagConn sets the session's escrow.notify_tag, which an account pass's NOTIFY carries (see
// sqlNotifyAll), so that this ledger's Subscribe can leave out its own passes. A session setting
// rather than a startup parameter: poolers such as PgBouncer refuse startup parameters they do
// not know. A failure is ignored: a pass on an untagged connection is heard by its own worker
// again, as before (one wasted read), whereas a connection refused for it fails the ledger.
func tagConn(tag string) func(context.Context, *pgx.Conn) error {
	return func(ctx context.Context, conn *pgx.Conn) error {
		_, _ = conn.Exec(ctx, `SELECT set_config('escrow.notify_tag', $1, false)`, tag)
		return nil
	}
}

// New returns a ledger on pool, whose schema must be migrated (migrations.Up); cfg may
// be nil for the defaults. The caller keeps the pool: Close does not close it. Its connections
// carry no notification tag, so this ledger's Subscribe also delivers its own account passes'
// notifications (see Subscribe).
func New(pool *pgxpool.Pool, cfg *Config) (*Ledger, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: postgres ledger needs a pool", ledger.ErrConfig)
	}
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	return newPostgres(pool, c), nil
}

func newPostgres(pool *pgxpool.Pool, c Config) *Ledger {
	views := cmp.Or(c.ViewPool, pool)
	return &Ledger{pool: pool, views: views, cfg: c, log: c.Logger, closed: make(chan struct{})}
}

// Close stops the subscriptions and, when Open made the pool, closes it.
func (p *Ledger) Close() {
	select {
	case <-p.closed:
		return
	default:
		close(p.closed)
	}
	if p.owned {
		p.views.Close()
		p.pool.Close()
	}
}

// sqlKeyedPlans begins each transaction of an account pass and of a snapshot (in the same
// round trip as its first statement). Every statement of those transactions finds its rows by
// primary key from arrays it is given, so a sequential scan is never the right plan for them
// once the tables hold more than a page; but the planner may choose one for a plan it makes, and
// caches, while a table is small and has never been analyzed (a new deployment's first minutes,
// every bench run, a table whose autovacuum is off), and then runs it on every pass. The "= ANY"
// filters below make the index usable; this setting makes the planner use it whatever it
// believes about the table's size. It lasts until the transaction ends. It turns JIT off too:
// the setting adds a huge cost to any sequential scan left in a plan (ledger_meta's one row is
// read whole, with no condition for its key to serve), which passes jit_above_cost and had every
// pass compile its statements (100 ms of CPU a pass, measured: the Postgres CPU per request of
// the wrk run doubled).
const sqlKeyedPlans = `SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)`

// SQL fragments shared by the queries.
const (
	sqlChannel = `'escrow_' || left(md5(current_schema()), 16)`
	sqlNotify  = `SELECT pg_notify(` + sqlChannel + `, $1)`
	// Charges for several orgs at once: $1 orgs, $2 their cost sums, $3 their event counts; then
	// one element per entry: $4 its org, $5 seq, $6 cost, $7 event id (the hold id), $8 key, $9
	// project, $10 end user ('' for none), $11 time (the reserve time, else the record time),
	// $12 tokens; $13 the keys used and $14 the latest time of each (its last use: one row update
	// per key, not per request), $15 the cost sum of each; $16 … $18 each (key, UTC day) of the
	// entries and its cost sum. The sums the customer views read (migration 021: accounts.charged,
	// api_keys.charged, key_days) are added to here, in the rows the pass writes anyway plus one
	// row per key-day: no write per event. Every account row is updated HOT (no index names a
	// column it changes, migration 016), and the entries of every org of the pass are one INSERT.
	//
	// Each joined table is also filtered by "= ANY" of the array it is joined with: that
	// condition is on the primary key, so the plan probes the index whatever the planner
	// believes about the table's size. Without it, a plan cached while a table was small and not
	// yet analyzed (a new deployment's first minute, every bench run) hash-joins a sequential
	// scan of the whole table, on every pass, until autovacuum analyzes it.
	sqlWriteCharges = `
WITH acc AS (
	UPDATE accounts a SET balance = a.balance - x.sum, ledger_seq = a.ledger_seq + x.n, charged = a.charged + x.sum
	FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS x(org, sum, n)
	WHERE a.org_id = x.org AND a.org_id = ANY ($1::text[])
), days AS (
	INSERT INTO key_days AS d (key_id, day, charged)
	SELECT * FROM unnest($16::text[], $17::date[], $18::bigint[])
	ON CONFLICT (key_id, day) DO UPDATE SET charged = d.charged + EXCLUDED.charged
), ins AS (
	INSERT INTO ledger_entries (org_id, seq, delta, kind, hold_id, key_id, project, end_user, reserved_at, tokens)
	SELECT org, seq, -cost, 'charge', id::uuid, NULLIF(k, ''), NULLIF(pr, ''), NULLIF(eu, ''), at, tokens
	FROM unnest($4::text[], $5::bigint[], $6::bigint[], $7::text[], $8::text[], $9::text[], $10::text[], $11::timestamptz[], $12::bigint[])
		AS x(org, seq, cost, id, k, pr, eu, at, tokens)
)
UPDATE api_keys k SET last_used_at = GREATEST(k.last_used_at, x.t), charged = k.charged + x.c
FROM unnest($13::text[], $14::timestamptz[], $15::bigint[]) AS x(key, t, c)
WHERE k.id = x.key AND k.id = ANY ($13::text[])`
	// sqlWriteAccounts is sqlWriteCharges without the entries, for a pass that sent them with COPY
	// (copyEntries): $1 … $3, the keys' $4 … $6 and the key-days' $7 … $9.
	sqlWriteAccounts = `
WITH acc AS (
	UPDATE accounts a SET balance = a.balance - x.sum, ledger_seq = a.ledger_seq + x.n, charged = a.charged + x.sum
	FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS x(org, sum, n)
	WHERE a.org_id = x.org AND a.org_id = ANY ($1::text[])
), days AS (
	INSERT INTO key_days AS d (key_id, day, charged)
	SELECT * FROM unnest($7::text[], $8::date[], $9::bigint[])
	ON CONFLICT (key_id, day) DO UPDATE SET charged = d.charged + EXCLUDED.charged
)
UPDATE api_keys k SET last_used_at = GREATEST(k.last_used_at, x.t), charged = k.charged + x.c
FROM unnest($4::text[], $5::timestamptz[], $6::bigint[]) AS x(key, t, c)
WHERE k.id = x.key AND k.id = ANY ($4::text[])`
	// sqlNotifyAll notifies each org of $1, adding the session's notification tag (a space, then
	// escrow.notify_tag, when set: see tagConn) so that the ledger that sent it knows its own
	// account pass. A seed's charges clear the tag for their transaction (readSnapshot): their
	// entries still wait for a settle, which the seeding process's worker must hear about too.
	sqlNotifyAll = `SELECT pg_notify(` + sqlChannel + `, o || coalesce(' ' || nullif(current_setting('escrow.notify_tag', true), ''), ''))
FROM unnest($1::text[]) AS o`
)

// maxClaim bounds the events one AccountPending call accounts (a cost sum stays in int64).
const maxClaim = 10_000

// minCopy is the fewest rows sent with COPY (a recorder batch's events, an account pass's
// entries); fewer go in the INSERT … SELECT FROM unnest statement. COPY writes a page's worth of
// new rows in one WAL record (a heap multi-insert) where INSERT writes one per row, but costs a
// round trip more: only a batch this large pays for it.
const minCopy = 32

// copyEntries writes the charge entries of cs with COPY, in the caller's transaction.
func copyEntries(ctx context.Context, conn *pgx.Conn, cs []orgCharges) error {
	var rows [][]any
	for _, c := range cs {
		for i, id := range c.ids {
			a := c.attrs[i]
			hold, err := uuid.Parse(id)
			if err != nil {
				return err
			}
			rows = append(rows, []any{c.org, c.base + int64(i) + 1, -c.costs[i], "charge", hold, nullIfEmpty(a.Key), nullIfEmpty(a.Project),
				nullIfEmpty(a.EndUser), a.At, a.Tokens})
		}
	}
	_, err := conn.CopyFrom(ctx, pgx.Identifier{"ledger_entries"},
		[]string{"org_id", "seq", "delta", "kind", "hold_id", "key_id", "project", "end_user", "reserved_at", "tokens"}, pgx.CopyFromRows(rows))
	return err
}

// nullIfEmpty is nil for "" (SQL NULL), else s.
func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// Epoch returns the ledger's epoch.
func (p *Ledger) Epoch(ctx context.Context) (balance.Epoch, error) {
	var e balance.Epoch
	err := p.pool.QueryRow(ctx, `SELECT epoch_gen, epoch_id FROM ledger_meta`).Scan(&e.Gen, &e.ID)
	return e, wrapPg("epoch", err)
}

// RaiseEpoch starts a new epoch with a higher generation.
func (p *Ledger) RaiseEpoch(ctx context.Context) (balance.Epoch, error) {
	var e balance.Epoch
	err := p.pool.QueryRow(ctx, `UPDATE ledger_meta SET epoch_gen = epoch_gen + 1,
		epoch_id = replace(gen_random_uuid()::text, '-', '') RETURNING epoch_gen, epoch_id`).Scan(&e.Gen, &e.ID)
	return e, wrapPg("raise epoch", err)
}

// CreateOrg creates an account with balance 0.
func (p *Ledger) CreateOrg(ctx context.Context, org string) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	tag, err := p.pool.Exec(ctx, `INSERT INTO accounts (org_id) VALUES ($1) ON CONFLICT DO NOTHING`, org)
	if err != nil {
		return wrapPg("create org", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %q", ledger.ErrOrgExists, org)
	}
	return nil
}

// Account returns the org's account.
func (p *Ledger) Account(ctx context.Context, org string) (ledger.Account, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.Account{}, err
	}
	a := ledger.Account{Org: org}
	err := p.pool.QueryRow(ctx, `
SELECT balance, ledger_seq, settled_seq,
       `+sqlPendingOf+`
FROM accounts WHERE org_id = $1`, org).Scan(&a.Balance, &a.LedgerSeq, &a.SettledSeq, &a.Pending)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.Account{}, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	return a, wrapPg("account", err)
}

// Snapshot accounts the org's pending usage events and returns the account's balance and
// ledger sequence with the epoch, in one transaction: it locks the account row, then waits for
// the org's advisory lock and for any event another transaction has claimed (never SKIP
// LOCKED), so the snapshot covers every usage recorded before it. With nothing pending it
// writes nothing.
func (p *Ledger) Snapshot(ctx context.Context, org string) (balance.Snapshot, error) {
	return p.snapshot(ctx, org, nil)
}

// SnapshotSince is Snapshot plus, in the same transaction (after the account row is locked, so
// no entry and no limits change can land in between), the org's limits and the spend of their
// windows from the one that contains since on, for the entries up to the snapshot's seq
// (balance.LimitLedger).
func (p *Ledger) SnapshotSince(ctx context.Context, org string, since time.Time) (balance.Snapshot, error) {
	return p.snapshot(ctx, org, &since)
}

func (p *Ledger) snapshot(ctx context.Context, org string, since *time.Time) (balance.Snapshot, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return balance.Snapshot{}, err
	}
	var s balance.Snapshot
	err := pgx.BeginFunc(ctx, p.pool, func(tx pgx.Tx) error {
		rd, err := readSnapshot(ctx, tx, org, since != nil)
		if err != nil {
			return err
		}
		if err := chargeAtSnapshot(ctx, tx, org, &rd); err != nil {
			return err
		}
		s = balance.Snapshot{Balance: rd.balance, Seq: rd.seq, Epoch: rd.epoch}
		if err := snapshotExpiries(ctx, tx, org, &s); err != nil {
			return err
		}
		if since == nil {
			return nil
		}
		// The charges just written are in the sums (seq ≤ s.Seq).
		used, err := limitUsage(ctx, tx, org, rd.ls.Limits, *since, s.Seq, true)
		if err != nil {
			return err
		}
		s.Limits = &balance.LimitSnapshot{Limits: rd.ls, Used: used}
		return nil
	})
	if err != nil {
		return balance.Snapshot{}, wrapPg("snapshot", err)
	}
	return s, nil
}

// snapRead is what a snapshot reads in its first round trip, under the account row's lock and
// the org's advisory lock.
type snapRead struct {
	found        bool  // the org has an account row
	balance, seq int64 // the account's balance and ledger_seq (0 without a row)
	epoch        balance.Epoch
	// The queue rows that hold the org's pending usage events, claimed (FOR UPDATE, waiting for
	// a worker's claim), with their events (the org's with their limit attribution), the org's
	// limits as the charges see them and the database clock.
	queued []queuedEvent
	limits map[string][]balance.Limit
	now    time.Time
	ls     balance.Limits // the org's limits, read only withLimits
}

// readSnapshot sends the snapshot's reads in one batch: lock the account row, take the org's
// advisory lock (blocking: never skip a worker's half-done claim), claim the pending usage,
// read the epoch, the limits the charges count against and, withLimits, the org's limits.
func readSnapshot(ctx context.Context, tx pgx.Tx, org string, withLimits bool) (snapRead, error) {
	b := &pgx.Batch{}
	b.Queue(sqlKeyedPlans)
	b.Queue(`SELECT balance, ledger_seq FROM accounts WHERE org_id = $1 FOR UPDATE`, org)
	// The seed's charges notify without this ledger's tag (sqlNotifyAll): unlike an account pass,
	// the seeding process does not settle them itself, so its own worker must hear them too.
	b.Queue(`SELECT pg_advisory_xact_lock(hashtext(current_schema()), hashtext($1)), set_config('escrow.notify_tag', '', true)`, org)
	b.Queue(sqlClaimOrg, []string{org}, []string{org})
	b.Queue(`SELECT epoch_gen, epoch_id FROM ledger_meta`)
	b.Queue(sqlChargeLimits, []string{org})
	if withLimits {
		queueLimits(b, org)
	}
	br := tx.SendBatch(ctx, b)
	rd, err := scanSnapshot(br, withLimits)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return rd, err
}

// scanSnapshot reads readSnapshot's results, in the order they were queued.
func scanSnapshot(br pgx.BatchResults, withLimits bool) (rd snapRead, err error) {
	if _, err := br.Exec(); err != nil { // sqlKeyedPlans
		return rd, err
	}
	rd.found = true
	if err := br.QueryRow().Scan(&rd.balance, &rd.seq); errors.Is(err, pgx.ErrNoRows) {
		rd.found = false
	} else if err != nil {
		return rd, err
	}
	if _, err := br.Exec(); err != nil {
		return rd, err
	}
	rows, _ := br.Query()
	if rd.queued, err = scanQueued(rows); err != nil {
		return rd, err
	}
	if err := br.QueryRow().Scan(&rd.epoch.Gen, &rd.epoch.ID); err != nil {
		return rd, err
	}
	rows, _ = br.Query()
	if rd.limits, rd.now, err = scanChargeLimits(rows); err != nil {
		return rd, err
	}
	if withLimits {
		if rd.ls, _, err = scanLimits(br); err != nil {
			return rd, err
		}
	}
	return rd, nil
}

// chargeAtSnapshot accounts the org's claimed pending usage (so the snapshot covers every usage
// already recorded) and moves rd's balance and seq past the charges. An org with usage and no
// account gets one (a served request is billed); with neither it is ErrUnknownOrg.
func chargeAtSnapshot(ctx context.Context, tx pgx.Tx, org string, rd *snapRead) error {
	picked, qw := take(rd.queued, func(o string) bool { return o == org }, 0)
	if !rd.found {
		if len(picked) == 0 {
			return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO accounts (org_id) VALUES ($1) ON CONFLICT DO NOTHING`, org); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `SELECT balance, ledger_seq FROM accounts WHERE org_id = $1 FOR UPDATE`, org).Scan(&rd.balance, &rd.seq); err != nil {
			return err
		}
	}
	if len(picked) == 0 {
		if !qw.empty() { // events whose rows are gone leave the queue
			b := &pgx.Batch{}
			qw.queue(b)
			return tx.SendBatch(ctx, b).Close()
		}
		return nil
	}
	c := orgCharges{org: org, balance: rd.balance, base: rd.seq, limits: rd.limits[org]}
	for i := range picked {
		picked[i].addTo(&c)
	}
	if err := c.check(); err != nil {
		return err
	}
	if err := writeCharges(ctx, tx, []orgCharges{c}, rd.now, qw); err != nil {
		return err
	}
	rd.balance -= c.sum()
	rd.seq += int64(len(c.ids))
	return nil
}

// orgCharges are one org's claimed events, to become entries base+1 … base+n.
type orgCharges struct {
	org     string
	balance int64 // before
	base    int64 // ledger_seq before
	ids     []string
	costs   []int64
	attrs   []ledger.ChargeAttr // each charge's attribution, for the limits' windows
	limits  []balance.Limit     // the org's live limits (none: no window is moved)
	// settled: every entry of the org was settled when the pass locked its row (settled_seq =
	// ledger_seq), so the charges' entries will be its unsettled entries (AccountResult.Settle);
	// recorded is each claimed event's created_at, their Recorded time.
	settled  bool
	recorded []time.Time
	// lowAt is the account's low-balance threshold when lowKnown (read with the row lock):
	// then the balance.low check is queued only when the charges cross it.
	lowAt    *int64
	lowKnown bool
}

// crossesLow reports whether the charges may take the balance below its low-balance threshold
// (always true when the threshold was not read).
func (c *orgCharges) crossesLow() bool {
	if !c.lowKnown {
		return true
	}
	if c.lowAt == nil {
		return false
	}
	after := c.balance - c.sum()
	return after < *c.lowAt && c.balance >= *c.lowAt
}

func (c *orgCharges) sum() int64 {
	var sum int64
	for _, x := range c.costs {
		sum += x
	}
	return sum
}

// check refuses charges that would take the balance below -MaxAmount (the table's CHECK would
// fail the whole transaction; this fails only the org).
func (c *orgCharges) check() error {
	if c.balance-c.sum() < -balance.MaxAmount {
		return fmt.Errorf("%w: org %q: balance would leave ±%d", ledger.ErrInvalidAmount, c.org, balance.MaxAmount)
	}
	return nil
}

// writeCharges writes the entries of every org in cs, moves each account once, marks the events
// accounted, notifies, writes the webhook events and moves the limits' windows (at now, the
// transaction's time), in the caller's transaction (which holds the orgs' locks), in one round
// trip.
func writeCharges(ctx context.Context, tx pgx.Tx, cs []orgCharges, now time.Time, qw queueWrites) error {
	b := &pgx.Batch{}
	queueCharges(b, cs, now, qw, false)
	br := tx.SendBatch(ctx, b)
	_, err := readSpend(br)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return err
}

// queueCharges queues writeCharges' statements on b: the entries, the accounts and the keys' last
// use in one statement, the queue rows' deletes and rewrites (qw), the NOTIFY, the balance.low
// check only for the orgs whose charges may cross their threshold, the windows only for orgs
// with limits.
//
// copied: the entries were sent with COPY (copyEntries) in the same transaction.
// The batch's first result is the grants' rests after the charges (readSpend).
func queueCharges(b *pgx.Batch, cs []orgCharges, now time.Time, qw queueWrites, copied bool) {
	var orgs, lowOrgs []string
	var sums, counts, lowChanges []int64
	var eOrgs, eIDs, eKeys, eProjects, eEndUsers []string
	var eSeqs, eCosts, eTokens []int64
	var eAts []time.Time
	lastUse := map[string]time.Time{}
	keyCost, keyDayCost := map[string]int64{}, map[keyDay]int64{}
	for _, c := range cs {
		orgs = append(orgs, c.org)
		sum := c.sum()
		sums = append(sums, sum)
		counts = append(counts, int64(len(c.ids)))
		for i, id := range c.ids {
			a := c.attrs[i]
			eOrgs, eIDs, eSeqs, eCosts = append(eOrgs, c.org), append(eIDs, id), append(eSeqs, c.base+int64(i)+1), append(eCosts, c.costs[i])
			eKeys, eProjects, eEndUsers = append(eKeys, a.Key), append(eProjects, a.Project), append(eEndUsers, a.EndUser)
			eAts, eTokens = append(eAts, a.At), append(eTokens, a.Tokens)
			if a.Key != "" {
				if t, ok := lastUse[a.Key]; !ok || a.At.After(t) {
					lastUse[a.Key] = a.At
				}
				keyCost[a.Key] += c.costs[i]
				keyDayCost[keyDay{a.Key, utcDay(a.At)}] += c.costs[i]
			}
		}
		if c.crossesLow() {
			lowOrgs, lowChanges = append(lowOrgs, c.org), append(lowChanges, -sum)
		}
	}
	keys := slices.Sorted(maps.Keys(lastUse))
	uses, keyCosts := make([]time.Time, len(keys)), make([]int64, len(keys))
	for i, k := range keys {
		uses[i], keyCosts[i] = lastUse[k], keyCost[k]
	}
	kds := slices.SortedFunc(maps.Keys(keyDayCost), func(a, b keyDay) int {
		return cmp.Or(cmp.Compare(a.key, b.key), a.day.Compare(b.day))
	})
	dKeys, dDays, dCosts := make([]string, len(kds)), make([]time.Time, len(kds)), make([]int64, len(kds))
	for i, kd := range kds {
		dKeys[i], dDays[i], dCosts[i] = kd.key, kd.day, keyDayCost[kd]
	}
	b.Queue(sqlSpendGrants, eOrgs, eCosts, eAts) // grants: first, so its rows are the batch's first result (readSpend)
	if copied {
		b.Queue(sqlWriteAccounts, orgs, sums, counts, keys, uses, keyCosts, dKeys, dDays, dCosts)
	} else {
		b.Queue(sqlWriteCharges, orgs, sums, counts, eOrgs, eSeqs, eCosts, eIDs, eKeys, eProjects, eEndUsers, eAts, eTokens, keys, uses, keyCosts,
			dKeys, dDays, dCosts)
	}
	qw.queue(b)
	b.Queue(sqlNotifyAll, orgs)
	if len(lowOrgs) > 0 {
		queueLowBalance(b, lowOrgs, lowChanges) // webhooks: in the same transaction
	}
	queueLimitWindows(b, cs, now)
}

// keyDay is a key and a UTC day (midnight), a row of key_days.
type keyDay struct {
	key string
	day time.Time
}

// utcDay is t's UTC day, as midnight UTC: the start of its balance.Day window.
func utcDay(t time.Time) time.Time {
	start, _ := balance.Day.Bounds(t)
	return start
}

// AccountPending turns up to limit (at most 10,000) pending usage events into charge entries,
// oldest first (see AccountPass).
func (p *Ledger) AccountPending(ctx context.Context, limit int) (int, error) {
	r, err := p.AccountPass(ctx, limit)
	return r.Accounted, err
}

// AccountPass turns up to limit (at most 10,000) pending usage events into charge entries,
// oldest first. One transaction covers the batch: it locks the account rows of the orgs
// of the oldest queue rows with FOR UPDATE SKIP LOCKED and, after each row, the org's advisory
// lock with pg_try_advisory_xact_lock (an org another worker or a snapshot holds is left for
// later, so workers never wait for each other), claims those queue rows FOR UPDATE SKIP LOCKED,
// and writes, in one statement, the entries with each org's next sequence numbers and one
// (HOT) update per account; then takes the charged events out of the queue (deleting the rows it
// emptied, rewriting the ids left in the others: events of orgs it could not lock, past limit)
// and notifies each org. So every org's charges are written
// in one transaction that holds the org's locks, and a batch costs one commit however many
// orgs it spans. An org with no account row gets one (a request that was served is billed).
// The orgs whose settled_seq equalled their ledger_seq under the row lock get their new
// entries back in Settle, with the epoch the locking statement read.
//
// Round trips: the discovery read (outside the transaction), then BEGIN with the locks, the
// claim with the limits, and the writes with COMMIT: four, however many orgs and events.
func (p *Ledger) AccountPass(ctx context.Context, limit int) (ledger.AccountResult, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	limit = min(limit, maxClaim)
	rowIDs, orgs, err := p.pendingRows(ctx, limit)
	if err != nil || len(orgs) == 0 {
		return ledger.AccountResult{}, wrapPg("account pending", err)
	}
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return ledger.AccountResult{}, wrapPg("account pending", err)
	}
	// A connection released inside a transaction (an error below) is closed by the pool, which
	// rolls the transaction back.
	defer conn.Release()
	r, orgErrs, err := accountTx(ctx, conn.Conn(), rowIDs, orgs, limit)
	if err != nil {
		if conn.Conn().PgConn().TxStatus() != 'I' {
			_, _ = conn.Exec(ctx, "ROLLBACK")
		}
		return ledger.AccountResult{}, wrapPg("account pending", err)
	}
	if len(orgErrs) > 0 {
		return r, fmt.Errorf("pgledger: account pending: %w", errors.Join(orgErrs...))
	}
	return r, nil
}

// pendingRows finds the oldest queue rows that hold the next limit pending events, and their
// orgs (in org order).
func (p *Ledger) pendingRows(ctx context.Context, limit int) (rows []int64, orgs []string, err error) {
	err = p.pool.QueryRow(ctx, sqlPendingRows, limit).Scan(&rows, &orgs)
	return rows, orgs, err
}

// sqlLockAccounts locks the account rows of the orgs $1 that no one else holds, in org order,
// and, for each row locked, tries the org's advisory lock (after the row, never before): the
// sixth column says whether it was taken. Each row also says whether the org was fully settled
// (read under the row lock, which MarkSettledMany takes too) and carries the ledger's epoch, so
// the pass hands its entries over with the epoch without a read of its own (AccountResult).
const sqlLockAccounts = `
WITH a AS MATERIALIZED (
	SELECT org_id, balance, ledger_seq, settled_seq, low_balance_threshold FROM accounts
	WHERE org_id = ANY($1::text[]) ORDER BY org_id FOR UPDATE SKIP LOCKED
)
SELECT org_id, balance, ledger_seq, settled_seq = ledger_seq, low_balance_threshold,
	pg_try_advisory_xact_lock(hashtext(current_schema()), hashtext(org_id)), m.epoch_gen, m.epoch_id
FROM a CROSS JOIN ledger_meta m`

// sqlCreateAccounts makes the accounts of the orgs $1 that have none and takes their advisory
// locks. An org whose row exists (the lock skipped it: another transaction holds it) is left
// for later without reaching the insert: ON CONFLICT's unique check waits for a transaction
// that is updating the conflicting row, and that one (a MarkSettledMany) may be waiting for a
// row this pass holds, a deadlock. A row another transaction is inserting is waited for.
const sqlCreateAccounts = `
WITH a AS (
	INSERT INTO accounts (org_id) SELECT o FROM unnest($1::text[]) AS o
	WHERE NOT EXISTS (SELECT 1 FROM accounts x WHERE x.org_id = o) ORDER BY o
	ON CONFLICT DO NOTHING RETURNING org_id, balance, ledger_seq, settled_seq, low_balance_threshold
)
SELECT org_id, balance, ledger_seq, settled_seq = ledger_seq, low_balance_threshold,
	pg_try_advisory_xact_lock(hashtext(current_schema()), hashtext(org_id)), m.epoch_gen, m.epoch_id
FROM a CROSS JOIN ledger_meta m`

// accountTx runs the account pass's transaction on conn (BEGIN is sent with the locks, COMMIT
// with the writes). orgErrs are orgs left out (their charges would break the balance bound).
func accountTx(ctx context.Context, conn *pgx.Conn, rowIDs []int64, orgs []string, limit int) (r ledger.AccountResult, orgErrs []error, err error) {
	accts, got, epoch, err := lockOrgs(ctx, conn, orgs)
	if err != nil || len(got) == 0 {
		if err == nil {
			_, err = conn.Exec(ctx, "COMMIT")
		}
		return r, nil, err
	}
	now, qw, err := claimEvents(ctx, conn, accts, got, rowIDs, limit, &r)
	if err != nil {
		return r, nil, err
	}
	var cs []orgCharges
	for _, o := range got {
		c := accts[o]
		if len(c.ids) == 0 {
			continue
		}
		if err := c.check(); err != nil {
			orgErrs = append(orgErrs, err)
			qw.keep(c.org)
			continue
		}
		cs = append(cs, *c)
		r.Accounted += len(c.ids)
		r.Orgs = append(r.Orgs, o)
	}
	b := &pgx.Batch{}
	if len(cs) > 0 {
		copied := r.Accounted >= minCopy
		if copied {
			if err := copyEntries(ctx, conn, cs); err != nil {
				return ledger.AccountResult{}, nil, err
			}
		}
		queueCharges(b, cs, now, qw, copied)
	} else {
		qw.queue(b)
	}
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	var due map[string]map[int64]int64
	if len(cs) > 0 {
		due, err = readSpend(br)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return ledger.AccountResult{}, nil, err
	}
	if r.Settle = handOver(cs); len(r.Settle) > 0 {
		r.Epoch = epoch
		for org, es := range r.Settle { // grants: the rests after the pass ride on its last entry
			if d, ok := due[org]; ok {
				es[len(es)-1].Expiries = &d
			}
		}
	}
	return r, orgErrs, nil
}

// handOver returns, for each org of cs that was fully settled when its row was locked, the
// entries its charges became: its unsettled entries, exactly as SQLUnsettledOf reads them back
// (seq base+i+1, delta −cost, the event's id as hold id, its created_at as Recorded, its
// attribution), so the worker settles them without that read.
func handOver(cs []orgCharges) map[string][]balance.Entry {
	var out map[string][]balance.Entry
	for _, c := range cs {
		if !c.settled {
			continue
		}
		es := make([]balance.Entry, len(c.ids))
		for i, id := range c.ids {
			a := c.attrs[i]
			es[i] = balance.Entry{Seq: c.base + int64(i) + 1, Delta: -c.costs[i], HoldID: id, Recorded: c.recorded[i]}
			attribute(&es[i], &a.Key, &a.Project, &a.EndUser, &a.At)
			es[i].Tokens = a.Tokens
		}
		if out == nil {
			out = map[string][]balance.Entry{}
		}
		out[c.org] = es
	}
	return out
}

// lockOrgs begins the transaction and locks what it can of orgs' accounts (creating missing
// ones) and advisory locks. got lists the orgs whose locks it holds, in orgs' order; epoch is
// the ledger's, read with the locks (zero when no account row came back).
func lockOrgs(ctx context.Context, conn *pgx.Conn, orgs []string) (accts map[string]*orgCharges, got []string, epoch balance.Epoch, err error) {
	accts = map[string]*orgCharges{}
	seen := map[string]bool{}
	scan := func(rows pgx.Rows) error {
		var c orgCharges
		var locked bool
		_, err := pgx.ForEachRow(rows, []any{&c.org, &c.balance, &c.base, &c.settled, &c.lowAt, &locked, &epoch.Gen, &epoch.ID}, func() error {
			seen[c.org] = true
			if locked {
				cc := c
				cc.lowKnown = true
				accts[c.org] = &cc
			}
			return nil
		})
		return err
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(sqlKeyedPlans)
	b.Queue(sqlLockAccounts, orgs)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		_, err = br.Exec()
	}
	if err == nil {
		rows, _ := br.Query()
		err = scan(rows)
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, nil, epoch, err
	}
	// Not seen: no account (create it) or a row another transaction holds (left for later).
	var missing []string
	for _, o := range orgs {
		if !seen[o] {
			missing = append(missing, o)
		}
	}
	if len(missing) > 0 {
		rows, _ := conn.Query(ctx, sqlCreateAccounts, missing)
		if err := scan(rows); err != nil {
			return nil, nil, epoch, err
		}
	}
	for _, o := range orgs {
		if accts[o] != nil {
			got = append(got, o)
		}
	}
	return accts, got, epoch, nil
}

// claimEvents claims the queue rows rowIDs that no one else holds and reads the events in them
// of the locked orgs got, up to limit of them, oldest first, into accts, and the orgs' live
// limits, in one round trip; it returns the transaction's time (zero when no org has limits)
// and what to write to the claimed queue rows, and learns the events' costs of one choice into
// r.
func claimEvents(ctx context.Context, conn *pgx.Conn, accts map[string]*orgCharges, got []string, rowIDs []int64, limit int, r *ledger.AccountResult) (time.Time, queueWrites, error) {
	b := &pgx.Batch{}
	b.Queue(sqlClaimPass, rowIDs, got)
	b.Queue(sqlChargeLimits, got)
	br := conn.SendBatch(ctx, b)
	rows, _ := br.Query()
	qs, err := scanQueued(rows)
	var qw queueWrites
	if err == nil {
		var picked []queuedEvent
		picked, qw = take(qs, func(o string) bool { return accts[o] != nil }, limit)
		for i := range picked {
			q := &picked[i]
			q.addTo(accts[q.org])
			r.Learn(q.model, q.attr.Cost, q.choices, q.est)
		}
	}
	var now time.Time
	if err == nil {
		var lims map[string][]balance.Limit
		rows, _ := br.Query()
		lims, now, err = scanChargeLimits(rows)
		for o, l := range lims {
			if c := accts[o]; c != nil {
				c.limits = l
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return now, qw, err
}

// EntriesAfter returns up to limit entries of org with Seq > after, in Seq order, and the epoch,
// read in one statement.
func (p *Ledger) EntriesAfter(ctx context.Context, org string, after int64, limit int) ([]balance.Entry, balance.Epoch, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, balance.Epoch{}, err
	}
	return p.entries(ctx, "entries after", `$3::bigint`, org, limit, after)
}

// UnsettledEntries returns up to limit entries of org past its settled_seq, with the epoch.
func (p *Ledger) UnsettledEntries(ctx context.Context, org string, limit int) ([]balance.Entry, balance.Epoch, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, balance.Epoch{}, err
	}
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	// Like entries, plus each entry's Recorded time: a charge's usage event's created_at (the
	// settle-lag clock starts when the usage was recorded, not when it was accounted).
	rows, err := p.pool.Query(ctx, `
SELECT m.epoch_gen, m.epoch_id, e.seq, e.delta, e.hold_id::text, e.recorded, e.key_id, e.project, e.end_user, e.at, e.tokens,
	e.grant_expires_at, e.expire_last, (SELECT grants_expiring FROM accounts WHERE org_id = $1)
FROM ledger_meta m LEFT JOIN LATERAL (
	SELECT l.seq, l.delta, l.hold_id, COALESCE(u.created_at, l.created_at) AS recorded, l.key_id, l.project, l.end_user, l.tokens,
		CASE WHEN l.kind = 'charge' THEN coalesce(l.reserved_at, l.created_at) END AS at, l.grant_expires_at, l.expire_last
	FROM ledger_entries l LEFT JOIN usage_events u ON u.id = l.hold_id AND l.kind = 'charge'
	WHERE l.org_id = $1 AND l.seq > (SELECT settled_seq FROM accounts WHERE org_id = $1)
	ORDER BY l.seq LIMIT $2
) e ON true ORDER BY e.seq`, org, limit)
	if err != nil {
		return nil, balance.Epoch{}, wrapPg("unsettled entries", err)
	}
	defer rows.Close()
	var out []balance.Entry
	var ep balance.Epoch
	var expiring *bool
	for rows.Next() {
		var seq, delta *int64
		var hold *string
		var ids entryAttr
		var rec, at, gx *time.Time
		var tokens *int64
		var last *bool
		if err := rows.Scan(&ep.Gen, &ep.ID, &seq, &delta, &hold, &rec, &ids.key, &ids.project, &ids.endUser, &at, &tokens, &gx, &last, &expiring); err != nil {
			return nil, balance.Epoch{}, wrapPg("unsettled entries", err)
		}
		if seq == nil {
			continue
		}
		e := entryOf(*seq, *delta, hold, rec, ids, at, tokens)
		markGrant(&e, gx, last)
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, balance.Epoch{}, wrapPg("unsettled entries", err)
	}
	if expiring != nil && *expiring && len(out) > 0 {
		if err := p.withExpiries(ctx, map[string][]balance.Entry{org: out}, []string{org}); err != nil {
			return nil, balance.Epoch{}, err
		}
	}
	return out, ep, nil
}

// SQLUnsettledOf reads, for each org of $1, up to $2 entries past its settled_seq (with each
// charge's usage record time, the settle-lag clock), and the epoch, in one statement.
// It is exported for tracers (a pgx QueryTracer that counts a settle pass's reads matches it;
// accounting's pass-count test does).
const SQLUnsettledOf = `
SELECT m.epoch_gen, m.epoch_id, e.org_id, e.seq, e.delta, e.hold_id::text, e.recorded, e.key_id, e.project, e.end_user, e.at, e.tokens,
	e.grant_expires_at, e.expire_last, e.grants_expiring
FROM ledger_meta m LEFT JOIN LATERAL (
	SELECT a.org_id, a.grants_expiring, l.* FROM accounts a CROSS JOIN LATERAL (
		SELECT l.seq, l.delta, l.hold_id, COALESCE(u.created_at, l.created_at) AS recorded, l.key_id, l.project, l.end_user, l.tokens,
			CASE WHEN l.kind = 'charge' THEN coalesce(l.reserved_at, l.created_at) END AS at, l.grant_expires_at, l.expire_last
		FROM ledger_entries l LEFT JOIN usage_events u ON u.id = l.hold_id AND l.kind = 'charge'
		WHERE l.org_id = a.org_id AND l.seq > a.settled_seq
		ORDER BY l.seq LIMIT $2
	) l
	WHERE a.org_id = ANY($1::text[]) AND a.settled_seq < a.ledger_seq
) e ON true ORDER BY e.org_id, e.seq`

// entryOf builds the entry of an entries read from its nullable columns (the read's LEFT
// JOINs leave them NULL where a column does not apply; rec is nil where the read has no
// record time).
func entryOf(seq, delta int64, hold *string, rec *time.Time, ids entryAttr, at *time.Time, tokens *int64) balance.Entry {
	e := balance.Entry{Seq: seq, Delta: delta}
	if tokens != nil {
		e.Tokens = *tokens
	}
	if hold != nil {
		e.HoldID = *hold
	}
	if rec != nil {
		e.Recorded = *rec
	}
	attribute(&e, ids.key, ids.project, ids.endUser, at)
	return e
}

// UnsettledEntriesOf returns, for each of orgs with entries past its settled_seq, up to limit
// of them in Seq order, and the epoch, read in one statement.
func (p *Ledger) UnsettledEntriesOf(ctx context.Context, orgs []string, limit int) (map[string][]balance.Entry, balance.Epoch, error) {
	for _, org := range orgs {
		if err := balance.ValidateOrg(org); err != nil {
			return nil, balance.Epoch{}, err
		}
	}
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	rows, _ := p.pool.Query(ctx, SQLUnsettledOf, orgs, limit)
	out := make(map[string][]balance.Entry, len(orgs))
	var ep balance.Epoch
	var org, hold *string
	var ids entryAttr
	var seq, delta, tokens *int64
	var rec, at, gx *time.Time
	var last, expiring *bool
	flagged := map[string]bool{}
	_, err := pgx.ForEachRow(rows, []any{&ep.Gen, &ep.ID, &org, &seq, &delta, &hold, &rec, &ids.key, &ids.project, &ids.endUser, &at, &tokens, &gx, &last, &expiring}, func() error {
		if seq == nil {
			return nil
		}
		e := entryOf(*seq, *delta, hold, rec, ids, at, tokens)
		markGrant(&e, gx, last)
		out[*org] = append(out[*org], e)
		if expiring != nil && *expiring {
			flagged[*org] = true
		}
		return nil
	})
	if err != nil {
		return nil, balance.Epoch{}, wrapPg("unsettled entries", err)
	}
	if err := p.withExpiries(ctx, out, slices.Sorted(maps.Keys(flagged))); err != nil {
		return nil, balance.Epoch{}, err
	}
	return out, ep, nil
}

// entries reads org ($1)'s entries with seq > the SQL expression after, at most limit ($2),
// and the epoch, in one statement (one snapshot).
func (p *Ledger) entries(ctx context.Context, op, after string, org string, limit int, more ...any) ([]balance.Entry, balance.Epoch, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	rows, err := p.pool.Query(ctx, `
SELECT m.epoch_gen, m.epoch_id, e.seq, e.delta, e.hold_id::text, e.key_id, e.project, e.end_user, e.at, e.tokens,
	e.grant_expires_at, e.expire_last, (SELECT grants_expiring FROM accounts WHERE org_id = $1)
FROM ledger_meta m LEFT JOIN LATERAL (
	SELECT seq, delta, hold_id, key_id, project, end_user, tokens,
		CASE WHEN kind = 'charge' THEN coalesce(reserved_at, created_at) END AS at, grant_expires_at, expire_last
	FROM ledger_entries
	WHERE org_id = $1 AND seq > `+after+` ORDER BY seq LIMIT $2
) e ON true ORDER BY e.seq`, append([]any{org, limit}, more...)...)
	if err != nil {
		return nil, balance.Epoch{}, wrapPg(op, err)
	}
	defer rows.Close()
	var out []balance.Entry
	var ep balance.Epoch
	var expiring *bool
	for rows.Next() {
		var seq, delta *int64
		var hold *string
		var ids entryAttr
		var at, gx *time.Time
		var tokens *int64
		var last *bool
		if err := rows.Scan(&ep.Gen, &ep.ID, &seq, &delta, &hold, &ids.key, &ids.project, &ids.endUser, &at, &tokens, &gx, &last, &expiring); err != nil {
			return nil, balance.Epoch{}, wrapPg(op, err)
		}
		if seq == nil {
			continue
		}
		e := entryOf(*seq, *delta, hold, nil, ids, at, tokens)
		markGrant(&e, gx, last)
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, balance.Epoch{}, wrapPg(op, err)
	}
	if expiring != nil && *expiring && len(out) > 0 {
		if err := p.withExpiries(ctx, map[string][]balance.Entry{org: out}, []string{org}); err != nil {
			return nil, balance.Epoch{}, err
		}
	}
	return out, ep, nil
}

// UnsettledUsage reports, for each of holdIDs, whether the org has usage recorded for it that is
// not settled yet: a pending event (in the queue), or a charge entry past settled_seq. One
// statement, so one snapshot: an event moves from the queue to its entry in one transaction.
func (p *Ledger) UnsettledUsage(ctx context.Context, org string, holdIDs []string) (map[string]bool, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return nil, err
	}
	out := make(map[string]bool, len(holdIDs))
	canon := make(map[string][]string, len(holdIDs)) // canonical id → ids as asked
	var ids []string
	for _, id := range holdIDs {
		out[id] = false
		if u, err := uuid.Parse(id); err == nil {
			c := u.String()
			if canon[c] == nil {
				ids = append(ids, c)
			}
			canon[c] = append(canon[c], id)
		}
	}
	if len(ids) == 0 {
		return out, nil
	}
	rows, err := p.pool.Query(ctx, `
SELECT x.id::text FROM usage_pending p CROSS JOIN LATERAL unnest(p.ids, p.orgs) AS x(id, org)
WHERE p.orgs && ARRAY[$1::text] AND x.org = $1 AND x.id = ANY ($2::text[]::uuid[])
UNION
SELECT l.hold_id::text FROM accounts a JOIN ledger_entries l ON l.org_id = a.org_id AND l.seq > a.settled_seq
WHERE a.org_id = $1 AND l.kind = 'charge' AND l.hold_id = ANY ($2::text[]::uuid[])`+liveJobHolds, org, ids)
	if err != nil {
		return nil, wrapPg("unsettled usage", err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, wrapPg("unsettled usage", err)
	}
	for _, c := range found {
		for _, id := range canon[c] {
			out[id] = true
		}
	}
	return out, nil
}

// Credit adds amount (> 0) to the org, idempotent by ref across all orgs.
func (p *Ledger) Credit(ctx context.Context, org string, amount int64, ref string) (ledger.LedgerEntry, bool, error) {
	return p.CreditGrant(ctx, org, amount, ref, grant.Paid)
}

// Adjust writes a signed correction (delta ≠ 0), idempotent by ref like Credit.
func (p *Ledger) Adjust(ctx context.Context, org string, delta int64, ref string) (ledger.LedgerEntry, bool, error) {
	if delta == 0 || delta > balance.MaxAmount || delta < -balance.MaxAmount {
		return ledger.LedgerEntry{}, false, fmt.Errorf("%w: adjustment %d", ledger.ErrInvalidAmount, delta)
	}
	return p.write(ctx, org, ledger.KindAdjust, delta, ref, grant.Paid)
}

// write inserts one credit or adjust entry in one round trip (the account update, the entry
// and the NOTIFY in one implicit transaction). A used reference shows as a unique violation;
// the original entry is then read and compared.
// A credit is a grant of terms o (the grants row in the same statement); a debit spends the
// grants like a charge reserved now.
func (p *Ledger) write(ctx context.Context, org string, kind ledger.EntryKind, delta int64, ref string, o grant.Options) (ledger.LedgerEntry, bool, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.LedgerEntry{}, false, err
	}
	op := string(kind)
	for range 3 {
		e := ledger.LedgerEntry{Org: org, Delta: delta, Kind: kind, Ref: ref}
		b := &pgx.Batch{}
		b.Queue(sqlWriteEntry, org, delta, string(kind), ref, expiresArg(o.ExpiresAt), o.Priority)
		if delta < 0 {
			b.Queue(sqlSpendGrants, []string{org}, []int64{-delta}, []time.Time{time.Now()})
		}
		b.Queue(sqlNotify, org)
		queueEntryOutbox(b, org, kind, delta, ref) // webhooks: in the same (implicit) transaction
		br := p.pool.SendBatch(ctx, b)
		err := br.QueryRow().Scan(&e.Seq, &e.CreatedAt)
		if err == nil && delta < 0 {
			_, err = readSpend(br)
		}
		if err == nil {
			_, err = br.Exec()
		}
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		var pe *pgconn.PgError
		switch {
		case err == nil:
			return e, true, nil
		case errors.Is(err, pgx.ErrNoRows):
			return ledger.LedgerEntry{}, false, fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
		case errors.As(err, &pe) && pe.Code == "23514": // check_violation: balance bound
			return ledger.LedgerEntry{}, false, fmt.Errorf("%w: balance of %q would leave ±%d", ledger.ErrInvalidAmount, org, balance.MaxAmount)
		case errors.As(err, &pe) && pe.Code == "23505" && ref != "":
			var orig ledger.LedgerEntry
			var prio *int
			var exp *time.Time
			err := p.pool.QueryRow(ctx, `SELECT e.org_id, e.seq, e.delta, e.created_at, g.priority, g.expires_at
FROM ledger_entries e LEFT JOIN grants g ON g.org_id = e.org_id AND g.seq = e.seq
WHERE e.kind = $1 AND e.ref = $2`,
				string(kind), ref).Scan(&orig.Org, &orig.Seq, &orig.Delta, &orig.CreatedAt, &prio, &exp)
			if errors.Is(err, pgx.ErrNoRows) {
				continue // the other writer rolled back: try again
			}
			if err != nil {
				return ledger.LedgerEntry{}, false, wrapPg(op, err)
			}
			if orig.Org != org || orig.Delta != delta || (kind == ledger.KindCredit && !sameTerms(prio, exp, o)) {
				return ledger.LedgerEntry{}, false, fmt.Errorf("%w: %q", ledger.ErrReferenceConflict, ref)
			}
			orig.Kind, orig.Ref = kind, ref
			return orig, false, nil
		default:
			return ledger.LedgerEntry{}, false, wrapPg(op, err)
		}
	}
	return ledger.LedgerEntry{}, false, fmt.Errorf("pgledger: %s: reference %q kept changing", op, ref)
}

// RecordUsage stores the events and queues the ones it inserted (one usage_pending row), and
// notifies the orgs of the new events, in one statement: one round trip. The events' ids make it
// idempotent: the statement first inserts them plainly (no ON CONFLICT: each row costs a heap
// and an index record and no speculative-insertion confirm); when one of them is already stored
// (a retried batch, a journal replay, a voided tombstone) it fails whole, and the batch is sent
// again with ON CONFLICT (id) DO NOTHING, which skips the stored ones.
func (p *Ledger) RecordUsage(ctx context.Context, events []ledger.UsageEvent) error {
	return p.recordUsage(ctx, events, true)
}

// RecordUsageQuiet is RecordUsage without the notification (QuietUsageStore): it wakes no
// listener of the database.
func (p *Ledger) RecordUsageQuiet(ctx context.Context, events []ledger.UsageEvent) error {
	return p.recordUsage(ctx, events, false)
}

// sqlRecord returns the statement that inserts the events given as arrays (skipping the ids
// already stored when onConflict; else failing on them) and queues the inserted ones in one
// usage_pending row, in their created_at order; with notify it also notifies their orgs.
func sqlRecord(onConflict, notify bool) string {
	q := `
WITH ins AS (
	INSERT INTO usage_events (id, org_id, model, key_id, endpoint, prompt_tokens, units,
		completion_tokens, reasoning_tokens, cost, hold_amount, estimated, created_at, project, reserved_at, choices, end_user)
	SELECT id::uuid, org, model, NULLIF(key, ''), NULLIF(endpoint, ''), pt, NULLIF(un, '')::jsonb, cpt, rt, cost, hold, est, at, NULLIF(project, ''), rat, ch,
		NULLIF(eu, '')
	FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[],
		$8::bigint[], $9::bigint[], $10::bigint[], $11::bigint[], $12::bool[], $13::timestamptz[], $14::text[], $15::timestamptz[], $16::bigint[],
		$17::text[])
		AS x(id, org, model, key, endpoint, pt, un, cpt, rt, cost, hold, est, at, project, rat, ch, eu)`
	if onConflict {
		q += `
	ON CONFLICT (id) DO NOTHING`
	}
	q += `
	RETURNING id, org_id, created_at
)`
	queue := `INSERT INTO usage_pending (n, ids, orgs)
SELECT count(*), array_agg(id ORDER BY created_at, id), array_agg(org_id ORDER BY created_at, id) FROM ins HAVING count(*) > 0`
	if !notify {
		return q + `
` + queue
	}
	return q + `, q AS (
` + queue + `
)
SELECT pg_notify(` + sqlChannel + `, org_id) FROM (SELECT DISTINCT org_id FROM ins) d`
}

var (
	sqlRecordQuiet, sqlRecordQuietOnConflict   = sqlRecord(false, false), sqlRecord(true, false)
	sqlRecordNotify, sqlRecordNotifyOnConflict = sqlRecord(false, true), sqlRecord(true, true)
)

// recordUsage runs sqlRecord over the events, in one round trip (two when one of them is already
// stored).
func (p *Ledger) recordUsage(ctx context.Context, events []ledger.UsageEvent, notify bool) error {
	if len(events) == 0 {
		return nil
	}
	args, norm, err := usageArgs(events)
	if err != nil {
		return err
	}
	n := len(events)
	sql, again := sqlRecordQuiet, sqlRecordQuietOnConflict
	if notify {
		sql, again = sqlRecordNotify, sqlRecordNotifyOnConflict
	}
	if n >= minCopy {
		err = p.recordCopy(ctx, norm, notify)
	} else {
		_, err = p.pool.Exec(ctx, sql, args...)
	}
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) && pe.Code == "23505" && pe.TableName == "usage_events" {
		_, err = p.pool.Exec(ctx, again, args...)
	}
	if err != nil && notSent(err) {
		return fmt.Errorf("%w: %w", ledger.ErrNotRecorded, wrapPg("record usage", err))
	}
	return wrapPg("record usage", err)
}

// usageArgs normalizes events and returns them as sqlRecord's arguments (one array per column).
func usageArgs(events []ledger.UsageEvent) ([]any, []ledger.UsageEvent, error) {
	n := len(events)
	var (
		ids, orgs, models, keys, endpoints = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		prompt, completion                 = make([]int64, n), make([]int64, n)
		units                              = make([]string, n)
		reasoning, costs, holds            = make([]int64, n), make([]int64, n), make([]int64, n)
		estimated                          = make([]bool, n)
		created                            = make([]time.Time, n)
		projects, endUsers                 = make([]string, n), make([]string, n)
		reserved                           = make([]*time.Time, n)
		choices                            = make([]int64, n)
	)
	norm := make([]ledger.UsageEvent, n)
	for i, ev := range events {
		ev, err := ledger.NormalizeEvent(ev)
		if err != nil {
			return nil, nil, err
		}
		norm[i] = ev
		ids[i], orgs[i], models[i], keys[i], endpoints[i] = ev.ID, ev.Org, ev.Model, ev.KeyID, ev.Endpoint
		prompt[i], completion[i], reasoning[i] = ev.Usage.Prompt, ev.Usage.Completion, ev.Usage.Reasoning
		units[i] = string(unitsJSON(ev.Usage.Units))
		costs[i], holds[i], estimated[i], created[i] = ev.Cost, ev.HoldAmount, ev.Estimated, ev.CreatedAt
		projects[i], endUsers[i], choices[i] = ev.Project, ev.EndUser, max(ev.Choices, 1)
		if !ev.ReservedAt.IsZero() {
			reserved[i] = &ev.ReservedAt
		}
	}
	return []any{ids, orgs, models, keys, endpoints, prompt, units, completion, reasoning, costs, holds, estimated, created, projects, reserved, choices, endUsers}, norm, nil
}

// recordCopy is recordUsage's statement for a large batch of normalized events: in one
// transaction, the events with COPY (a page of rows in one WAL record), then their queue row
// (in the batch's order: the pass orders what it claims by created_at, see take) and the NOTIFY
// and COMMIT in one round trip; three round trips in all. A stored id fails it (a unique violation, the transaction
// rolled back): the caller then sends the ON CONFLICT statement.
func (p *Ledger) recordCopy(ctx context.Context, events []ledger.UsageEvent, notify bool) error {
	rows := make([][]any, len(events))
	for i, ev := range events {
		var reserved any
		if !ev.ReservedAt.IsZero() {
			reserved = ev.ReservedAt
		}
		rows[i] = []any{uuid.MustParse(ev.ID) /* NormalizeEvent checked it */, ev.Org, ev.Model, nullIfEmpty(ev.KeyID), nullIfEmpty(ev.Endpoint),
			ev.Usage.Prompt, unitsArg(ev.Usage.Units), ev.Usage.Completion, ev.Usage.Reasoning, ev.Cost, ev.HoldAmount, ev.Estimated, ev.CreatedAt,
			nullIfEmpty(ev.Project), reserved, max(ev.Choices, 1), nullIfEmpty(ev.EndUser)}
	}
	ids, orgs := make([]string, len(events)), make([]string, len(events))
	for i, ev := range events {
		ids[i], orgs[i] = ev.ID, ev.Org
	}
	conn, err := p.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A connection released inside a transaction (an error below) is closed by the pool, which
	// rolls the transaction back.
	defer conn.Release()
	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		return err
	}
	if _, err := conn.CopyFrom(ctx, pgx.Identifier{"usage_events"}, sqlRecordColumns, pgx.CopyFromRows(rows)); err != nil {
		_, _ = conn.Exec(ctx, "ROLLBACK")
		return err
	}
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO usage_pending (n, ids, orgs) VALUES ($1, $2::text[]::uuid[], $3)`, len(ids), ids, orgs)
	if notify {
		b.Queue(`SELECT pg_notify(`+sqlChannel+`, o) FROM unnest($1::text[]) AS o`, slices.Compact(slices.Sorted(slices.Values(orgs))))
	}
	b.Queue("COMMIT")
	return conn.SendBatch(ctx, b).Close()
}

// sqlRecordColumns are the usage_events columns recordUsage's arguments (and recordCopy's rows)
// fill, in their order.
var sqlRecordColumns = []string{"id", "org_id", "model", "key_id", "endpoint", "prompt_tokens", "units",
	"completion_tokens", "reasoning_tokens", "cost", "hold_amount", "estimated", "created_at", "project", "reserved_at", "choices", "end_user"}

// unitsJSON is a usage's units as stored (usage_events.units): nil when there are none, so that
// a text-only event's row has NULL there.
func unitsJSON(u pricing.Units) []byte {
	if len(u) == 0 {
		return nil
	}
	b, _ := json.Marshal(u) // a map of strings to integers: cannot fail
	return b
}

// unitsArg is unitsJSON as a COPY value: nil (NULL) or the JSON text.
func unitsArg(u pricing.Units) any {
	if b := unitsJSON(u); b != nil {
		return string(b)
	}
	return nil
}

// notSent reports whether err happened before the statement reached Postgres: no connection
// could be made, or pgx guarantees that no byte was sent.
func notSent(err error) bool {
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.SafeToRetry(err)
}

// VoidUsage inserts ev with status voided unless its id is stored (ErrUsageRecorded). The
// INSERT … ON CONFLICT (id) DO NOTHING waits for a RecordUsage of the same id that is still in
// flight (the primary key serializes them), so exactly one of the two stores a row; a second
// statement, with a fresh snapshot, then reads which one it was.
func (p *Ledger) VoidUsage(ctx context.Context, ev ledger.UsageEvent) error {
	ev, err := ledger.NormalizeEvent(ev)
	if err != nil {
		return err
	}
	var inserted bool
	err = p.pool.QueryRow(ctx, `
WITH ins AS (
	INSERT INTO usage_events (id, org_id, model, key_id, endpoint, prompt_tokens, units,
		completion_tokens, reasoning_tokens, cost, hold_amount, estimated, status, created_at)
	VALUES ($1::uuid, $2, $3, NULLIF($4, ''), NULLIF($5, ''), $6, NULLIF($7, '')::jsonb, $8, $9, $10, $11, $12, 'voided', $13)
	ON CONFLICT (id) DO NOTHING RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM ins)`, ev.ID, ev.Org, ev.Model, ev.KeyID, ev.Endpoint, ev.Usage.Prompt, string(unitsJSON(ev.Usage.Units)),
		ev.Usage.Completion, ev.Usage.Reasoning, ev.Cost, ev.HoldAmount, ev.Estimated, ev.CreatedAt).Scan(&inserted)
	if err != nil {
		return wrapPg("void usage", err)
	}
	if inserted {
		return nil
	}
	var status string
	if err := p.pool.QueryRow(ctx, `SELECT status FROM usage_events WHERE id = $1::uuid`, ev.ID).Scan(&status); err != nil {
		return wrapPg("void usage", err)
	}
	if status == "voided" {
		return nil
	}
	return fmt.Errorf("%w: %s", ledger.ErrUsageRecorded, ev.ID)
}

// MarkSettled sets settled_seq = GREATEST(settled_seq, seq), capped at ledger_seq; it writes
// nothing when that changes nothing.
func (p *Ledger) MarkSettled(ctx context.Context, org string, seq int64) error {
	if err := balance.ValidateOrg(org); err != nil {
		return err
	}
	return p.updateExisting(ctx, "mark settled", ledger.ErrUnknownOrg, org, `
WITH u AS (
	UPDATE accounts SET settled_seq = LEAST($2, ledger_seq)
	WHERE org_id = $1 AND settled_seq < LEAST($2, ledger_seq) RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM accounts WHERE org_id = $1)`, org, seq)
}

// updateExisting runs sql, an update that answers whether the row it names (name) exists, and
// turns a missing row into missing.
func (p *Ledger) updateExisting(ctx context.Context, what string, missing error, name, sql string, args ...any) error {
	var ok bool
	if err := p.pool.QueryRow(ctx, sql, args...).Scan(&ok); err != nil {
		return wrapPg(what, err)
	}
	if !ok {
		return fmt.Errorf("%w: %q", missing, name)
	}
	return nil
}

// MarkSettledMany sets, for each org of marks, settled_seq = GREATEST(settled_seq, seq) capped
// at ledger_seq, in one statement that writes only the rows it moves; orgs with no account are
// skipped. The rows are updated in org order, so two such calls never deadlock.
func (p *Ledger) MarkSettledMany(ctx context.Context, marks map[string]int64) error {
	if len(marks) == 0 {
		return nil
	}
	orgs := make([]string, 0, len(marks))
	for org := range marks {
		if err := balance.ValidateOrg(org); err != nil {
			return err
		}
		orgs = append(orgs, org)
	}
	slices.Sort(orgs)
	seqs := make([]int64, len(orgs))
	for i, org := range orgs {
		seqs[i] = marks[org]
	}
	_, err := p.pool.Exec(ctx, sqlMarkSettledMany, orgs, seqs)
	return wrapPg("mark settled", err)
}

// sqlMarkSettledMany raises the settled marks of the orgs $1 to $2 (each capped at the org's
// ledger_seq), locking the rows in org order. The "= ANY" keeps the plan on the primary key
// whatever the planner believes about the table (see sqlWriteCharges).
const sqlMarkSettledMany = `
WITH x AS (
	SELECT a.org_id, LEAST(m.seq, a.ledger_seq) AS seq
	FROM unnest($1::text[], $2::bigint[]) AS m(org, seq) JOIN accounts a ON a.org_id = m.org
	WHERE a.org_id = ANY ($1::text[]) AND a.settled_seq < LEAST(m.seq, a.ledger_seq)
	ORDER BY a.org_id FOR UPDATE OF a
)
UPDATE accounts a SET settled_seq = GREATEST(a.settled_seq, x.seq) FROM x WHERE a.org_id = x.org_id`

// OrgsToSettle lists up to limit orgs with settled_seq < ledger_seq or pending usage (the
// accounts table, one row per org, read whole: no index names a column the account pass
// updates, so its updates are HOT; and the queue).
func (p *Ledger) OrgsToSettle(ctx context.Context, limit int) ([]string, error) {
	if limit <= 0 {
		limit = ledger.DefaultLimit
	}
	rows, err := p.pool.Query(ctx, `
(SELECT org_id FROM accounts WHERE settled_seq < ledger_seq LIMIT $1)
UNION
(SELECT DISTINCT o FROM usage_pending, unnest(orgs) AS o LIMIT $1)
LIMIT $1`, limit)
	if err != nil {
		return nil, wrapPg("orgs to settle", err)
	}
	orgs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return orgs, wrapPg("orgs to settle", err)
}

// Subscribe LISTENs on its own connection and delivers the org of every NOTIFY until ctx ends
// or the ledger is closed, then closes the channel. A lost connection is re-made (with
// backoff); what was sent meanwhile is lost, which the worker's sweep covers. A slow reader
// loses notifications (the channel holds 1024) rather than slowing Postgres.
//
// The notifications of this ledger's own account passes are left out (when it was made by
// Open, which tags its connections): the caller of AccountPass has their orgs in the
// AccountResult and settles them itself, so hearing them again would only make its next pass
// read entries it has just settled. Other ledgers (other processes) hear them, as they hear
// every credit, adjust, seed and usage notification.
func (p *Ledger) Subscribe(ctx context.Context) (<-chan string, error) {
	conn, err := p.listen(ctx)
	if err != nil {
		return nil, wrapPg("subscribe", err)
	}
	ch := make(chan string, ledger.SubscriptionBuffer)
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(contextOf(p.closed), cancel)
	go func() {
		defer close(ch)
		defer cancel()
		defer stop()
		delay := p.cfg.ReconnectDelay
		for {
			for conn != nil {
				n, err := conn.WaitForNotification(ctx)
				if err != nil {
					cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
					_ = conn.Close(cctx)
					ccancel()
					conn = nil
					if ctx.Err() == nil {
						p.log.Warn("pgledger: ledger subscription lost; reconnecting", "err", err)
					}
					break
				}
				delay = p.cfg.ReconnectDelay
				org, own := p.notifiedOrg(n.Payload)
				if own {
					continue
				}
				select {
				case ch <- org:
				default:
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(delay):
			}
			delay = min(2*delay, 30*time.Second)
			if conn, err = p.listen(ctx); err != nil && ctx.Err() == nil {
				p.log.Warn("pgledger: ledger subscription: reconnect failed", "err", err)
			}
		}
	}()
	return ch, nil
}

// notifiedOrg parses a NOTIFY payload: the org, then (an account pass's) a space and the tag of
// the ledger that sent it. own: this ledger sent it.
func (p *Ledger) notifiedOrg(payload string) (org string, own bool) {
	org, tag, tagged := strings.Cut(payload, " ")
	return org, tagged && p.tag != "" && tag == p.tag
}

func (p *Ledger) listen(ctx context.Context) (*pgx.Conn, error) {
	cc := p.pool.Config().ConnConfig.Copy()
	cc.RuntimeParams["application_name"] = "escrow-listen"
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, err
	}
	var channel string
	if err := conn.QueryRow(ctx, `SELECT `+sqlChannel).Scan(&channel); err != nil {
		_ = conn.Close(ctx)
		return nil, err
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		_ = conn.Close(ctx)
		return nil, err
	}
	return conn, nil
}

// contextOf is a context canceled when done closes.
func contextOf(done <-chan struct{}) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-done
		cancel()
	}()
	return ctx
}

// PutModel creates or replaces a model; its max cost never goes below the one stored (what the
// ledger learned).
func (p *Ledger) PutModel(ctx context.Context, m ledger.Model) error {
	if err := ledger.ValidateModel(m); err != nil {
		return err
	}
	prices := m.Prices
	if prices == nil {
		prices = pricing.Prices{}
	}
	// The legacy price columns (migrations 001, 006, 011) are kept up to date for a process of
	// the previous release during a rolling upgrade (docs/price-classes.md); nothing reads them.
	_, err := p.pool.Exec(ctx, `
INSERT INTO models (model, prices, max_input_tokens, max_output_tokens, max_cost, default_hold,
	input_price, cached_input_price, output_price, cache_write_input_price, cache_write_1h_input_price)
SELECT $1, x.p, $3, $4, $5, $6, coalesce((x.p->>'input')::bigint, 0), coalesce((x.p->>'cached_input')::bigint, 0),
	coalesce((x.p->>'output')::bigint, 0), coalesce((x.p->>'cache_write_input')::bigint, 0), coalesce((x.p->>'cache_write_1h_input')::bigint, 0)
FROM (SELECT $2::jsonb AS p) x
ON CONFLICT (model) DO UPDATE SET prices = EXCLUDED.prices, input_price = EXCLUDED.input_price,
	cached_input_price = EXCLUDED.cached_input_price, output_price = EXCLUDED.output_price,
	cache_write_input_price = EXCLUDED.cache_write_input_price, cache_write_1h_input_price = EXCLUDED.cache_write_1h_input_price,
	max_input_tokens = EXCLUDED.max_input_tokens, max_output_tokens = EXCLUDED.max_output_tokens,
	max_cost = GREATEST(models.max_cost, EXCLUDED.max_cost), default_hold = EXCLUDED.default_hold, updated_at = now()`,
		m.Name, prices, m.MaxInputTokens, m.MaxOutputTokens, m.MaxCost, m.DefaultHold)
	return wrapPg("put model", err)
}

const sqlModelColumns = `model, prices, max_input_tokens, max_output_tokens, max_cost, default_hold`

func scanModel(r pgx.CollectableRow) (ledger.Model, error) {
	var m ledger.Model
	err := r.Scan(&m.Name, &m.Prices, &m.MaxInputTokens, &m.MaxOutputTokens, &m.MaxCost, &m.DefaultHold)
	if len(m.Prices) == 0 {
		m.Prices = nil
	}
	return m, err
}

// Model returns a model.
func (p *Ledger) Model(ctx context.Context, name string) (ledger.Model, error) {
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlModelColumns+` FROM models WHERE model = $1`, name)
	m, err := pgx.CollectExactlyOneRow(rows, scanModel)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.Model{}, fmt.Errorf("%w: %q", ledger.ErrUnknownModel, name)
	}
	return m, wrapPg("model", err)
}

// Models lists every model, by name.
func (p *Ledger) Models(ctx context.Context) ([]ledger.Model, error) {
	rows, _ := p.pool.Query(ctx, `SELECT `+sqlModelColumns+` FROM models ORDER BY model`)
	ms, err := pgx.CollectRows(rows, scanModel)
	return ms, wrapPg("models", err)
}

// RaiseMaxCost raises the model's learned max cost to cost when that is higher (writing nothing
// otherwise). Capping it at the model's bound is the caller's business.
func (p *Ledger) RaiseMaxCost(ctx context.Context, model string, cost int64) error {
	if cost < 0 || cost > balance.MaxAmount {
		return fmt.Errorf("%w: max cost %d", ledger.ErrInvalidAmount, cost)
	}
	return p.updateExisting(ctx, "raise max cost", ledger.ErrUnknownModel, model, `
WITH u AS (UPDATE models SET max_cost = $2, updated_at = now() WHERE model = $1 AND max_cost < $2 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM models WHERE model = $1)`, model, cost)
}

// CreateKey makes a new API key for org; only the SHA-256 of the secret is stored.
func (p *Ledger) CreateKey(ctx context.Context, org string) (ledger.APIKey, string, error) {
	if err := balance.ValidateOrg(org); err != nil {
		return ledger.APIKey{}, "", err
	}
	k := ledger.APIKey{ID: ledger.NewKeyID(), Org: org}
	secret := ledger.NewSecret()
	h := sha256.Sum256([]byte(secret))
	_, err := p.pool.Exec(ctx, `INSERT INTO api_keys (id, hash, org_id) VALUES ($1, $2, $3)`, k.ID, h[:], org)
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23503" { // foreign_key_violation
		return ledger.APIKey{}, "", fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, org)
	}
	if err != nil {
		return ledger.APIKey{}, "", wrapPg("create key", err)
	}
	return k, secret, nil
}

// LookupKey resolves a secret; revoked and unknown keys are ErrUnknownKey.
func (p *Ledger) LookupKey(ctx context.Context, secret string) (ledger.APIKey, error) {
	h := sha256.Sum256([]byte(secret))
	var k ledger.APIKey
	err := p.pool.QueryRow(ctx, `SELECT k.id, k.org_id, k.models, a.exempt FROM api_keys k JOIN accounts a ON a.org_id = k.org_id
WHERE k.hash = $1 AND k.revoked_at IS NULL`, h[:]).Scan(&k.ID, &k.Org, &k.Models, &k.Exempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return ledger.APIKey{}, ledger.ErrUnknownKey
	}
	return k, wrapPg("lookup key", err)
}

// RevokeKey revokes a key by id (revoking twice is fine).
func (p *Ledger) RevokeKey(ctx context.Context, id string) error {
	var ok bool
	if err := p.pool.QueryRow(ctx, sqlRevokeKey, id).Scan(&ok); err != nil {
		return wrapPg("revoke key", err)
	}
	if !ok {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownKey, id)
	}
	return nil
}

// wrapPg names the operation and, when err means Postgres could not be reached (or stopped
// answering), also wraps ErrLedgerUnavailable.
func wrapPg(op string, err error) error {
	if err == nil {
		return nil
	}
	if ledger.Unavailable(err) {
		return fmt.Errorf("pgledger: %s: %w: %w", op, ledger.ErrLedgerUnavailable, err)
	}
	return fmt.Errorf("pgledger: %s: %w", op, err)
}
