package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/lua"
	"github.com/llmescrow/escrow/migrations"
	"github.com/llmescrow/escrow/pricing"
)

// limits are the machine's own ceilings, measured in the same run as the proxies.
type limits struct {
	conns int // goroutines of the Redis loops

	rawEvalsha   float64 // EVALSHA of the reserve script, one call per round trip
	rawPipelined float64 // the same, 16 calls per pipeline
	reserve      float64 // balance.Store.Reserve with Config.NoCoalesce
	// the same with an end-user, a requests and a tokens limit in scope (DESIGN.md "Limits",
	// third wave), each request with a token bound and one of 1,000 end users
	reserveUnits float64
	coalesced    float64 // balance.Store.Reserve coalesced (the default)

	// one caller at a time (low load): latency of a lone call
	p50Raw, p50Reserve, p50Coalesced, p50Units time.Duration

	pgSingle float64 // usage-event rows/s, one row per transaction (RecordUsage of 1)
	pgBatch  float64 // usage-event rows/s, 100 rows per transaction
	recorder float64 // usage events/s through Recorder (group commit), many callers
	pipeline float64 // events/s recorded, accounted and settled into Redis (Recorder + Worker)
	// The pipeline run's WAL per event, from pg_stat_wal (records) and pg_current_wal_lsn
	// (bytes) read before and after it: the whole cluster's WAL, so other clients of a shared
	// Postgres (and autovacuum) count too.
	walRecords, walBytes float64
	pipelineEvents       int64
}

const evalPipeDepth = 16

// limitRounds is how many rounds each Redis mode runs, in turns with the others.
const limitRounds = 8

// measureLimits runs the Redis and Postgres ceilings. Redis modes are interleaved in short
// rounds so that the other work on this shared machine weighs on each of them alike.
func measureLimits(ctx context.Context, o options, rdbURL, dbURL, prefix string) (*limits, error) {
	lim := &limits{conns: o.redisConns}
	opt, err := redis.ParseURL(rdbURL)
	if err != nil {
		return nil, err
	}
	opt.PoolSize = o.redisConns + 8
	c := redis.NewClient(opt)
	defer c.Close()
	modes, err := redisModes(ctx, c, prefix, lim)
	if err != nil {
		return nil, err
	}
	if err := throughputRounds(modes, o.redisConns, o.limitRound); err != nil {
		return nil, err
	}
	if err := loneLatencies(modes, o.limitRound); err != nil {
		return nil, err
	}
	fmt.Fprintf(os.Stderr, "\r%-70s\r", "")
	if err := pgLimits(ctx, o, lim, dbURL, c, prefix); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return lim, nil
}

// limitMode is one way of putting holds that the Redis limits measure.
type limitMode struct {
	name  string
	perOp int // reserves per call of op
	op    func() error
	out   *float64       // reserves/s under load
	p50   *time.Duration // latency of a lone call; nil: not measured
}

// redisModes sets the Redis modes up, each on an org of its own seeded with a balance that
// never runs out: the reserve script called raw (alone and pipelined), Store.Reserve, and
// Store.Reserve with coalescing. Their results go to lim.
func redisModes(ctx context.Context, c *redis.Client, prefix string, lim *limits) ([]limitMode, error) {
	cfg := balance.Config{Ledger: fixedLedger{}, Prefix: prefix, MaxInFlight: 1 << 30, Logger: slog.New(slog.DiscardHandler), NoCoalesce: true,
		HoldTTL: balance.DefaultHoldTTL, PinTTL: balance.DefaultPinTTL, TombstoneTTL: balance.DefaultTombstoneTTL}
	direct, err := balance.New(ctx, c, &cfg)
	if err != nil {
		return nil, err
	}
	coCfg := cfg
	coCfg.NoCoalesce = false
	co, err := balance.New(ctx, c, &coCfg)
	if err != nil {
		return nil, err
	}
	direct.ObserveEpoch(benchEpoch)
	co.ObserveEpoch(benchEpoch)
	orgs := map[string]string{}
	for _, m := range []string{"raw", "pipe", "reserve", "coalesced", "units"} {
		orgs[m] = "lim-" + m
		snap := fixedLedger{}.snapshot()
		if m == "units" {
			snap.Limits = unitLimits()
		}
		if _, err := direct.Seed(ctx, orgs[m], snap); err != nil {
			return nil, err
		}
	}
	raw, err := newRawReserve(ctx, c, cfg)
	if err != nil {
		return nil, err
	}
	rawKeys, pipeKeys := balance.KeysOf(prefix, orgs["raw"]).ReserveKeys(), balance.KeysOf(prefix, orgs["pipe"]).ReserveKeys()
	storeOp := func(s *balance.Store, org string) func() error {
		return func() error {
			_, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: raw.id(), Amount: 1})
			return err
		}
	}
	var endUser atomic.Int64
	unitsOp := func() error {
		_, err := direct.Reserve(ctx, balance.ReserveRequest{Org: orgs["units"], HoldID: raw.id(), Amount: 1, KeyID: unitsKey,
			Tokens: 1_000, EndUser: "user-" + strconv.FormatInt(endUser.Add(1)%1000, 10)})
		return err
	}
	return []limitMode{
		{"raw EVALSHA", 1, func() error { return raw.one(ctx, rawKeys) }, &lim.rawEvalsha, &lim.p50Raw},
		{"raw EVALSHA pipelined", evalPipeDepth, func() error { return raw.pipelined(ctx, pipeKeys) }, &lim.rawPipelined, nil},
		{"Store.Reserve", 1, storeOp(direct, orgs["reserve"]), &lim.reserve, &lim.p50Reserve},
		{"Store.Reserve coalesced", 1, storeOp(co, orgs["coalesced"]), &lim.coalesced, &lim.p50Coalesced},
		{"Store.Reserve, end-user+requests+tokens limits", 1, unitsOp, &lim.reserveUnits, &lim.p50Units},
	}, nil
}

// unitsKey is the key of the reserves with limits in scope.
const unitsKey = "key1"

// unitLimits are the limits in scope of every reserve of the units mode, with caps that never
// bind: a money limit of each end user apart (day), a requests and a tokens limit of the key
// (minute).
func unitLimits() *balance.LimitSnapshot {
	key := balance.Scope{Kind: balance.ScopeKey, ID: unitsKey}
	return &balance.LimitSnapshot{Limits: balance.Limits{Version: 1, Limits: []balance.Limit{
		{ID: "e", Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Day, Cap: balance.MaxAmount},
		{ID: "r", Scope: key, Window: balance.Minute, Unit: balance.Requests, Cap: balance.MaxAmount},
		{ID: "t", Scope: key, Window: balance.Minute, Unit: balance.Tokens, Cap: balance.MaxAmount},
	}}}
}

// throughputRounds runs every mode from conns goroutines in limitRounds rounds of round each,
// taking turns, and writes each one's reserves/s.
func throughputRounds(modes []limitMode, conns int, round time.Duration) error {
	counts := make([]int64, len(modes))
	spent := make([]time.Duration, len(modes))
	for r := range limitRounds {
		for i, m := range modes {
			fmt.Fprintf(os.Stderr, "\r  limit: %-26s round %d/%d   ", m.name, r+1, limitRounds)
			n, el, err := closedLoop(conns, round, m.op)
			if err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			counts[i] += n * int64(m.perOp)
			spent[i] += el
		}
	}
	for i, m := range modes {
		*m.out = float64(counts[i]) / spent[i].Seconds()
	}
	return nil
}

// loneLatencies calls each mode that has a p50 from one caller for d (low load) and writes the
// median latency of a call.
func loneLatencies(modes []limitMode, d time.Duration) error {
	for _, m := range modes {
		if m.p50 == nil {
			continue
		}
		fmt.Fprintf(os.Stderr, "\r  limit: %-26s one caller          ", m.name)
		var lat []time.Duration
		end := time.Now().Add(d)
		for time.Now().Before(end) {
			t0 := time.Now()
			if err := m.op(); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
			lat = append(lat, time.Since(t0))
		}
		slices.Sort(lat)
		*m.p50 = percentile(lat, 50)
	}
	return nil
}

// rawReserve calls the reserve script by EVALSHA with the arguments a Store of cfg would pass,
// without the Go layer: the baseline of Store.Reserve.
type rawReserve struct {
	c    *redis.Client
	sha  string
	args []any // the script's ARGV, with a placeholder for the hold id
	seq  atomic.Int64
}

// rawHoldID is the index of the hold id in rawReserve.args.
const rawHoldID = 1

func newRawReserve(ctx context.Context, c *redis.Client, cfg balance.Config) (*rawReserve, error) {
	sha, err := c.ScriptLoad(ctx, lua.Reserve).Result()
	if err != nil {
		return nil, err
	}
	msOf := func(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) }
	// ARGV: epoch, hold id, amount, hold TTL, in-flight cap, tombstone TTL, pin floor (PinTTL/2),
	// key id, clock offset (lua/reserve.lua).
	args := []any{benchEpoch.String(), "", "1", msOf(cfg.HoldTTL), strconv.Itoa(cfg.MaxInFlight), msOf(cfg.TombstoneTTL),
		msOf(cfg.PinTTL / 2), "", "0"}
	return &rawReserve{c: c, sha: sha, args: args}, nil
}

// id is a new hold id.
func (r *rawReserve) id() string { return "b" + strconv.FormatInt(r.seq.Add(1), 10) }

// call sends (or queues, on a pipeline) one reserve with a new hold id.
func (r *rawReserve) call(ctx context.Context, c redis.Cmdable, keys []string) *redis.Cmd {
	args := slices.Clone(r.args)
	args[rawHoldID] = r.id()
	return c.EvalSha(ctx, r.sha, keys, args...)
}

// one is a lone reserve on the org of keys (its ReserveKeys).
func (r *rawReserve) one(ctx context.Context, keys []string) error {
	return checkReserved(r.call(ctx, r.c, keys).Slice())
}

// pipelined is evalPipeDepth reserves on the org of keys in one pipeline.
func (r *rawReserve) pipelined(ctx context.Context, keys []string) error {
	p := r.c.Pipeline()
	cmds := make([]*redis.Cmd, evalPipeDepth)
	for i := range cmds {
		cmds[i] = r.call(ctx, p, keys)
	}
	if _, err := p.Exec(ctx); err != nil {
		return err
	}
	for _, cmd := range cmds {
		if err := checkReserved(cmd.Slice()); err != nil {
			return err
		}
	}
	return nil
}

// checkReserved fails unless the reserve script answered OK.
func checkReserved(res []any, err error) error {
	if err != nil {
		return err
	}
	if st, _ := res[0].(string); st != "OK" {
		return fmt.Errorf("reserve script answered %v", res)
	}
	return nil
}

// closedLoop runs op from n goroutines for d and returns how many calls completed.
func closedLoop(n int, d time.Duration, op func() error) (int64, time.Duration, error) {
	var done atomic.Int64
	var stop atomic.Bool
	var firstErr atomic.Pointer[error]
	var wg sync.WaitGroup
	start := time.Now()
	for range n {
		wg.Go(func() {
			for !stop.Load() {
				if err := op(); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
				done.Add(1)
			}
		})
	}
	time.Sleep(d)
	stop.Store(true)
	wg.Wait()
	if e := firstErr.Load(); e != nil {
		return 0, 0, *e
	}
	return done.Load(), time.Since(start), nil
}

// pgLimits measures Postgres on the usage-event shape, in a schema of its own: RecordUsage of
// one event per transaction and of 100, the Recorder's group commit, and the whole accounting
// pipeline (Recorder → Worker → Redis, under prefix+"p").
func pgLimits(ctx context.Context, o options, lim *limits, dbURL string, rdb *redis.Client, prefix string) error {
	pg, err := openBenchLedger(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pg.Close()
	b := &pgBench{pg: pg, d: 5 * o.limitRound}
	if err := b.rowRates(ctx, lim); err != nil {
		return err
	}
	// Account what the two runs left, so the pipeline run starts from an empty queue.
	if err := b.accountAll(ctx); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "\r  limit: recorder            ")
	rec, err := accounting.NewRecorder(pg, nil)
	if err != nil {
		return err
	}
	rec.Start(ctx)
	cnt, el, err := b.record(ctx, rec)
	_ = rec.Stop(ctx)
	if err != nil {
		return err
	}
	lim.recorder = float64(cnt) / el.Seconds()
	if err := b.accountAll(ctx); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "\r  limit: record+account+settle ")
	pg.Close() // its backends exit and report their WAL statistics before the pipeline's are read
	if err := b.pipelineRate(ctx, dbURL, lim, rdb, prefix+"p"); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "\r%-70s\r", "")
	return nil
}

// walNow reads the cluster's WAL records written so far (pg_stat_wal) and its insert position.
func walNow(ctx context.Context, pool *pgxpool.Pool) (records int64, lsn string, err error) {
	err = pool.QueryRow(ctx, `SELECT wal_records, pg_current_wal_lsn()::text FROM pg_stat_wal`).Scan(&records, &lsn)
	return records, lsn, err
}

// openBenchLedger applies the migrations and opens the ledger at dbURL.
func openBenchLedger(ctx context.Context, dbURL string) (*pgledger.Ledger, error) {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	_, err = migrations.Up(ctx, pool)
	pool.Close()
	if err != nil {
		return nil, err
	}
	return pgledger.Open(ctx, dbURL, nil)
}

// pgBench writes usage events of 100 orgs into one ledger, each run for d.
type pgBench struct {
	pg *pgledger.Ledger
	d  time.Duration
	n  atomic.Int64 // events made so far: the next one's org
}

// event is a new usage event, of the next org in turn.
func (b *pgBench) event() ledger.UsageEvent {
	return ledger.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: fmt.Sprintf("pg-%03d", b.n.Add(1)%100), KeyID: "k",
		Model: "bench-model", Endpoint: "/v1/chat/completions", Usage: pricing.Usage{Prompt: 20, Completion: 16}, Cost: 13,
		HoldAmount: 10_000, CreatedAt: time.Now()}
}

// rowRates measures RecordUsage with one event per transaction and with 100.
func (b *pgBench) rowRates(ctx context.Context, lim *limits) error {
	fmt.Fprintf(os.Stderr, "\r  limit: postgres 1 row/tx   ")
	cnt, el, err := closedLoop(16, b.d, func() error {
		return b.pg.RecordUsage(ctx, []ledger.UsageEvent{b.event()})
	})
	if err != nil {
		return err
	}
	lim.pgSingle = float64(cnt) / el.Seconds()
	fmt.Fprintf(os.Stderr, "\r  limit: postgres 100 rows/tx ")
	cnt, el, err = closedLoop(4, b.d, func() error {
		evs := make([]ledger.UsageEvent, 100)
		for i := range evs {
			evs[i] = b.event()
		}
		return b.pg.RecordUsage(ctx, evs)
	})
	if err != nil {
		return err
	}
	lim.pgBatch = float64(cnt*100) / el.Seconds()
	return nil
}

// accountAll accounts every pending usage event.
func (b *pgBench) accountAll(ctx context.Context) error {
	for {
		k, err := b.pg.AccountPending(ctx, 5000)
		if err != nil || k == 0 {
			return err
		}
	}
}

// record has 256 callers record events through rec for d; it returns how many were recorded and
// in how long.
func (b *pgBench) record(ctx context.Context, rec *accounting.Recorder) (int64, time.Duration, error) {
	return closedLoop(256, b.d, func() error { return rec.Record(ctx, b.event()) })
}

// pipelineRate measures the events/s recorded through a Recorder and accounted and settled into
// Redis (under prefix) by a Worker, counted until the worker has settled them all (or for at
// most a minute), on a ledger of its own (so that its connections end with the run and report
// their WAL statistics), and the WAL written meanwhile per event.
func (b *pgBench) pipelineRate(ctx context.Context, dbURL string, lim *limits, rdb *redis.Client, prefix string) error {
	quiet := slog.New(slog.DiscardHandler)
	pg, err := pgledger.Open(ctx, dbURL, &pgledger.Config{SkipMigrations: true})
	if err != nil {
		return err
	}
	defer pg.Close()
	stat, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer stat.Close()
	store, err := balance.New(ctx, rdb, &balance.Config{Ledger: pg, Prefix: prefix, Logger: quiet})
	if err != nil {
		return err
	}
	w, err := accounting.NewWorker(pg, store, &accounting.WorkerConfig{Logger: quiet})
	if err != nil {
		return err
	}
	rec, err := accounting.NewRecorder(pg, &accounting.RecorderConfig{Wake: w.Wake})
	if err != nil {
		return err
	}
	// Settle what the earlier runs left first, so that the count below is only this run's.
	if err := w.Drain(ctx); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond) // the closed ledger's backends have reported their WAL
	if err := w.Start(ctx); err != nil {
		return err
	}
	rec.Start(ctx)
	pb := &pgBench{pg: pg, d: b.d, n: atomic.Int64{}}
	pb.n.Store(b.n.Load())
	recs0, lsn0, err := walNow(ctx, stat)
	if err != nil {
		return err
	}
	before := w.Stats().Settled
	start := time.Now()
	cnt, _, err := pb.record(ctx, rec)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for w.Stats().Settled-before < cnt && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	settled := w.Stats().Settled - before
	lim.pipeline = float64(settled) / time.Since(start).Seconds()
	lim.pipelineEvents = settled
	_ = rec.Stop(ctx)
	_ = w.Stop(ctx)
	pg.Close() // its backends exit and flush their WAL statistics
	time.Sleep(300 * time.Millisecond)
	recs1, lsn1, err := walNow(ctx, stat)
	if err != nil {
		return err
	}
	var bytes float64
	if err := stat.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)`, lsn1, lsn0).Scan(&bytes); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "\r  pipeline WAL: %s – %s (pg_waldump --stats=record -s %s -e %s)\n", lsn0, lsn1, lsn0, lsn1)
	if settled > 0 {
		lim.walRecords = float64(recs1-recs0) / float64(settled)
		lim.walBytes = bytes / float64(settled)
	}
	return nil
}

// benchEpoch is the epoch of the Redis limit runs' ledger.
var benchEpoch = balance.Epoch{Gen: 1, ID: "bench"}

// fixedLedger is the ledger of the Redis limit runs: their orgs are seeded by hand and never
// cold, so it is never asked for anything but the epoch.
type fixedLedger struct{}

// snapshot is every org's account: a balance that never runs out.
func (fixedLedger) snapshot() balance.Snapshot {
	return balance.Snapshot{Epoch: benchEpoch, Balance: balance.MaxAmount, Seq: 1}
}

func (l fixedLedger) Snapshot(ctx context.Context, org string) (balance.Snapshot, error) {
	return l.snapshot(), nil
}

func (fixedLedger) EntriesAfter(ctx context.Context, org string, after int64, limit int) ([]balance.Entry, balance.Epoch, error) {
	return nil, benchEpoch, nil
}

func (fixedLedger) UnsettledUsage(ctx context.Context, org string, ids []string) (map[string]bool, error) {
	return map[string]bool{}, nil
}
