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
	"github.com/llmescrow/escrow/lua"
	"github.com/llmescrow/escrow/migrations"
)

// limits are the machine's own ceilings, measured in the same run as the proxies.
type limits struct {
	conns int // goroutines of the Redis loops

	rawEvalsha   float64 // EVALSHA of the reserve script, one call per round trip
	rawPipelined float64 // the same, 16 calls per pipeline
	reserve      float64 // balance.Store.Reserve
	coalesced    float64 // balance.Store.Reserve with Config.Coalesce

	// one caller at a time (low load): latency of a lone call
	p50Raw, p50Reserve, p50Coalesced time.Duration

	pgSingle float64 // usage-event rows/s, one row per transaction (RecordUsage of 1)
	pgBatch  float64 // usage-event rows/s, 100 rows per transaction
	recorder float64 // usage events/s through Recorder (group commit), many callers
	pipeline float64 // events/s recorded, accounted and settled into Redis (Recorder + Worker)
}

const evalPipeDepth = 16

// measureLimits runs the Redis and Postgres ceilings. Redis modes are interleaved in short
// rounds so that the other work on this shared machine weighs on each of them alike. It is one
// piece because the modes are a table over the clients, orgs and script arguments it sets up.
func measureLimits(ctx context.Context, o options, rdbURL, dbURL, prefix string) (*limits, error) {
	lim := &limits{conns: o.redisConns}
	opt, err := redis.ParseURL(rdbURL)
	if err != nil {
		return nil, err
	}
	opt.PoolSize = o.redisConns + 8
	c := redis.NewClient(opt)
	defer c.Close()
	quiet := slog.New(slog.DiscardHandler)

	ledger := &fixedLedger{}
	direct, err := balance.New(ctx, c, balance.Config{Ledger: ledger, Prefix: prefix, MaxInFlight: 1 << 30, Logger: quiet})
	if err != nil {
		return nil, err
	}
	co, err := balance.New(ctx, c, balance.Config{Ledger: ledger, Prefix: prefix, MaxInFlight: 1 << 30, Logger: quiet, Coalesce: true})
	if err != nil {
		return nil, err
	}
	epoch := balance.Epoch{Gen: 1, ID: "bench"}
	direct.ObserveEpoch(epoch)
	co.ObserveEpoch(epoch)
	// Every mode has its own org, seeded alike (a balance that never runs out).
	orgs := map[string]string{}
	for _, m := range []string{"raw", "pipe", "reserve", "coalesced"} {
		orgs[m] = "lim-" + m
		if _, err := direct.Seed(ctx, orgs[m], balance.Snapshot{Epoch: epoch, Balance: balance.MaxAmount, Seq: 1}); err != nil {
			return nil, err
		}
	}
	sha, err := c.ScriptLoad(ctx, lua.Reserve).Result()
	if err != nil {
		return nil, err
	}
	keysOf := func(org string) []string {
		keys := make([]string, 0, 6)
		for _, kind := range []string{"acct", "holds", "hexp", "gone", "lim", "u"} { // reserve's KEYS
			keys = append(keys, balance.OrgKey(prefix, org, kind))
		}
		return keys
	}
	var seq atomic.Int64
	id := func() string { return "b" + strconv.FormatInt(seq.Add(1), 10) }
	ep := epoch.String()
	rawKeys, pipeKeys := keysOf(orgs["raw"]), keysOf(orgs["pipe"])
	cfg := direct.Config()
	hold, capArg, tomb, pin := strconv.FormatInt(cfg.HoldTTL.Milliseconds(), 10), strconv.Itoa(cfg.MaxInFlight),
		strconv.FormatInt(cfg.TombstoneTTL.Milliseconds(), 10), strconv.FormatInt(cfg.PinTTL.Milliseconds()/2, 10)
	check := func(res []any, err error) error {
		if err != nil {
			return err
		}
		if st, _ := res[0].(string); st != "OK" {
			return fmt.Errorf("reserve script answered %v", res)
		}
		return nil
	}
	modes := []struct {
		name  string
		perOp int // reserves per call of op
		op    func() error
		out   *float64
		p50   *time.Duration
	}{
		{"raw EVALSHA", 1, func() error {
			return check(c.EvalSha(ctx, sha, rawKeys, ep, id(), "1", hold, capArg, tomb, pin, "", "0").Slice())
		}, &lim.rawEvalsha, &lim.p50Raw},
		{"raw EVALSHA pipelined", evalPipeDepth, func() error {
			p := c.Pipeline()
			cmds := make([]*redis.Cmd, evalPipeDepth)
			for i := range cmds {
				cmds[i] = p.EvalSha(ctx, sha, pipeKeys, ep, id(), "1", hold, capArg, tomb, pin, "", "0")
			}
			if _, err := p.Exec(ctx); err != nil {
				return err
			}
			for _, cmd := range cmds {
				if err := check(cmd.Slice()); err != nil {
					return err
				}
			}
			return nil
		}, &lim.rawPipelined, nil},
		{"Store.Reserve", 1, func() error {
			_, err := direct.Reserve(ctx, balance.ReserveRequest{Org: orgs["reserve"], HoldID: id(), Amount: 1})
			return err
		}, &lim.reserve, &lim.p50Reserve},
		{"Store.Reserve coalesced", 1, func() error {
			_, err := co.Reserve(ctx, balance.ReserveRequest{Org: orgs["coalesced"], HoldID: id(), Amount: 1})
			return err
		}, &lim.coalesced, &lim.p50Coalesced},
	}
	const rounds = 8
	round := o.limitRound
	counts := make([]int64, len(modes))
	spent := make([]time.Duration, len(modes))
	for r := range rounds {
		for i, m := range modes {
			fmt.Fprintf(os.Stderr, "\r  limit: %-26s round %d/%d   ", m.name, r+1, rounds)
			n, el, err := closedLoop(o.redisConns, round, m.op)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", m.name, err)
			}
			counts[i] += n * int64(m.perOp)
			spent[i] += el
		}
	}
	for i, m := range modes {
		*m.out = float64(counts[i]) / spent[i].Seconds()
	}
	// Low load: one caller, latency of each call.
	for _, m := range modes {
		if m.p50 == nil {
			continue
		}
		fmt.Fprintf(os.Stderr, "\r  limit: %-26s one caller          ", m.name)
		var lat []time.Duration
		end := time.Now().Add(round)
		for time.Now().Before(end) {
			t0 := time.Now()
			if err := m.op(); err != nil {
				return nil, fmt.Errorf("%s: %w", m.name, err)
			}
			lat = append(lat, time.Since(t0))
		}
		slices.Sort(lat)
		*m.p50 = percentile(lat, 50)
	}
	fmt.Fprintf(os.Stderr, "\r%-70s\r", "")

	if err := pgLimits(ctx, o, lim, dbURL, c, prefix); err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	return lim, nil
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
// pipeline (Recorder → Worker → Redis). One piece: a list of measures, each a few lines over
// the same schema and clients.
func pgLimits(ctx context.Context, o options, lim *limits, dbURL string, rdb *redis.Client, prefix string) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, pool); err != nil {
		pool.Close()
		return err
	}
	pool.Close()
	pg, err := accounting.OpenPostgres(ctx, dbURL, nil)
	if err != nil {
		return err
	}
	defer pg.Close()
	event := func(org string) accounting.UsageEvent {
		return accounting.UsageEvent{ID: uuid.Must(uuid.NewV7()).String(), Org: org, KeyID: "k", Model: "bench-model",
			Endpoint: "/v1/chat/completions", Usage: accounting.Usage{Prompt: 20, Completion: 16}, Cost: 13, HoldAmount: 10_000,
			CreatedAt: time.Now()}
	}
	orgOf := func(i int64) string { return fmt.Sprintf("pg-%03d", i%100) }
	var n atomic.Int64
	d := 5 * o.limitRound

	fmt.Fprintf(os.Stderr, "\r  limit: postgres 1 row/tx   ")
	cnt, el, err := closedLoop(16, d, func() error {
		return pg.RecordUsage(ctx, []accounting.UsageEvent{event(orgOf(n.Add(1)))})
	})
	if err != nil {
		return err
	}
	lim.pgSingle = float64(cnt) / el.Seconds()

	fmt.Fprintf(os.Stderr, "\r  limit: postgres 100 rows/tx ")
	cnt, el, err = closedLoop(4, d, func() error {
		evs := make([]accounting.UsageEvent, 100)
		for i := range evs {
			evs[i] = event(orgOf(n.Add(1)))
		}
		return pg.RecordUsage(ctx, evs)
	})
	if err != nil {
		return err
	}
	lim.pgBatch = float64(cnt*100) / el.Seconds()

	// Account what the two runs left, so the pipeline run starts from an empty queue.
	for {
		k, err := pg.AccountPending(ctx, 5000)
		if err != nil {
			return err
		}
		if k == 0 {
			break
		}
	}

	fmt.Fprintf(os.Stderr, "\r  limit: recorder            ")
	rec, err := accounting.NewRecorder(pg, nil)
	if err != nil {
		return err
	}
	rec.Start(ctx)
	cnt, el, err = closedLoop(256, d, func() error {
		return rec.Record(ctx, event(orgOf(n.Add(1))))
	})
	if err != nil {
		return err
	}
	lim.recorder = float64(cnt) / el.Seconds()

	// The pipeline: the worker accounts and settles what the recorder writes, into Redis.
	fmt.Fprintf(os.Stderr, "\r  limit: record+account+settle ")
	store, err := balance.New(ctx, rdb, balance.Config{Ledger: pg, Prefix: prefix + "p", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	w, err := accounting.NewWorker(pg, store, &accounting.WorkerConfig{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	// Settle what the earlier runs left first, so that the count below is only this run's.
	if err := w.Drain(ctx); err != nil {
		return err
	}
	if err := w.Start(ctx); err != nil {
		return err
	}
	before := w.Stats().Settled
	start := time.Now()
	cnt, _, err = closedLoop(256, d, func() error {
		return rec.Record(ctx, event(orgOf(n.Add(1))))
	})
	if err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for w.Stats().Settled-before < cnt && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	lim.pipeline = float64(w.Stats().Settled-before) / time.Since(start).Seconds()
	_ = rec.Stop(ctx)
	_ = w.Stop(ctx)
	fmt.Fprintf(os.Stderr, "\r%-70s\r", "")
	return nil
}

// fixedLedger is the ledger of the Redis limit runs: their orgs are seeded by hand and never
// cold, so it is never asked for anything but the epoch.
type fixedLedger struct{}

func (fixedLedger) Snapshot(ctx context.Context, org string) (balance.Snapshot, error) {
	return balance.Snapshot{Epoch: balance.Epoch{Gen: 1, ID: "bench"}, Balance: balance.MaxAmount, Seq: 1}, nil
}

func (fixedLedger) EntriesAfter(ctx context.Context, org string, after int64, limit int) ([]balance.Entry, balance.Epoch, error) {
	return nil, balance.Epoch{Gen: 1, ID: "bench"}, nil
}

func (fixedLedger) UnsettledUsage(ctx context.Context, org string, ids []string) (map[string]bool, error) {
	return map[string]bool{}, nil
}
