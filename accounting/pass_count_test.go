package accounting_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
	"github.com/llmescrow/escrow/migrations"
)

// tripCounter counts, while on, the statements a pgx pool sends and its round trips (a Query,
// QueryRow or Exec is one; a SendBatch is one however many statements it holds), and the
// Redis round trips of a client (a command or a pipeline). The prepares of a statement's first
// use are not counted: the counted passes run after warm-up passes that made them.
type tripCounter struct {
	mu                  sync.Mutex
	on                  bool
	stmts               []string
	pgTrips, redisTrips int
	readRows            int64 // rows the reads of unsettled entries returned
}

func (c *tripCounter) add(trips int, sql string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.on {
		return
	}
	c.pgTrips += trips
	if sql != "" {
		c.stmts = append(c.stmts, sql)
	}
}

type sqlKey struct{}

func (c *tripCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.add(1, d.SQL)
	return context.WithValue(ctx, sqlKey{}, d.SQL)
}

func (c *tripCounter) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if ctx.Value(sqlKey{}) != pgledger.SQLUnsettledOf {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.on {
		c.readRows += d.CommandTag.RowsAffected()
	}
}

func (c *tripCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.add(1, "")
	return ctx
}
func (c *tripCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.add(0, d.SQL)
}
func (c *tripCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// go-redis hook: one round trip per command or pipeline.
func (c *tripCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *tripCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.redisTrip()
		return next(ctx, cmd)
	}
}
func (c *tripCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.redisTrip()
		return next(ctx, cmds)
	}
}

func (c *tripCounter) redisTrip() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.on {
		c.redisTrips++
	}
}

// start resets the counts and starts counting; stop stops and returns them.
func (c *tripCounter) start() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.on, c.stmts, c.pgTrips, c.redisTrips, c.readRows = true, nil, 0, 0, 0
}

func (c *tripCounter) stop() (stmts []string, pgTrips, redisTrips int, readRows int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.on = false
	return c.stmts, c.pgTrips, c.redisTrips, c.readRows
}

// TestPassRoundTrips counts the Postgres statements and round trips (and Redis round trips) of
// the worker's pass in two steady states: one client on 10 orgs (every org has usage in every
// pass) and 32 clients on 100 orgs (each pass charges about two thirds of them). Notifications
// are modelled without a listener: the recorder's arrive before the pass, and each pass's own
// NOTIFY comes back after it. The counts are logged (go test -v -run PassRoundTrips): before
// the account pass handed its entries over, a pass read every charged org's entries back.
func TestPassRoundTrips(t *testing.T) {
	t.Parallel()
	for _, sh := range []struct {
		name          string
		orgs, perPass int
	}{
		{"1 client, 10 orgs", 10, 20},
		{"32 clients, 100 orgs", 100, 100},
	} {
		t.Run(sh.name, func(t *testing.T) {
			t.Parallel()
			s := countPasses(t, sh.orgs, sh.perPass, 6)
			t.Logf("per pass of %d requests: %.1f statements, %.1f Postgres round trips, %.1f Redis round trips; "+
				"%.1f reads of unsettled entries returning %.1f rows",
				sh.perPass, s.stmts, s.pgTrips, s.redisTrips, s.unsettledReads, s.readRows)
			t.Logf("statements of the last pass:\n%s", strings.Join(s.last, "\n"))
			// Every org was settled before each pass: its entries are handed over, never read
			// back. With 10 orgs every org has usage in every pass, so nothing is read at all;
			// with 100, the orgs the last pass's NOTIFY marked and this one did not charge are
			// read, and found settled (one row: the epoch, no entry).
			if sh.orgs == 10 && (s.unsettledReads != 0 || s.pgTrips != 5) {
				t.Errorf("%.1f reads of unsettled entries and %.1f round trips per pass, want none and 5", s.unsettledReads, s.pgTrips)
			}
			if s.readRows > s.unsettledReads {
				t.Errorf("%.1f rows read back per pass by %.1f reads: entries the pass handed over were read", s.readRows, s.unsettledReads)
			}
		})
	}
}

type passCounts struct {
	stmts, pgTrips, redisTrips float64
	readRows                   float64  // rows the reads of unsettled entries returned
	last                       []string // the first line of each statement of the last pass
	unsettledReads             float64  // reads of unsettled entries
}

// countPasses runs warm-up passes, then passes counted ones, each after perPass usage events on
// random orgs, and returns the mean counts per counted pass.
func countPasses(t *testing.T, norgs, perPass, passes int) passCounts {
	ctx := context.Background()
	c := &tripCounter{}
	l, w, orgs := countedWorker(t, c, norgs)
	rnd := rand.New(rand.NewPCG(1, 2))
	var sum passCounts
	const warm = 3
	for p := range warm + passes {
		evs := make([]ledger.UsageEvent, perPass)
		charged := map[string]bool{}
		for i := range evs {
			o := orgs[(p*perPass+i)%norgs]
			if norgs > perPass/2 {
				o = orgs[rnd.IntN(norgs)]
			}
			charged[o] = true
			evs[i] = ledger.UsageEvent{ID: newID(), Org: o, Model: "m", Cost: int64(1 + i%50), HoldAmount: 100, CreatedAt: time.Now()}
		}
		if err := l.RecordUsage(ctx, evs); err != nil {
			t.Fatal(err)
		}
		for o := range charged { // the recorder's NOTIFY, heard before the pass
			w.Notify(o)
		}
		c.start()
		if err := w.Pass(ctx, false); err != nil {
			t.Fatal(err)
		}
		stmts, trips, rtrips, rows := c.stop()
		for o := range charged { // the pass's own NOTIFY, heard after it
			w.Notify(o)
		}
		if p < warm {
			continue
		}
		sum.stmts += float64(len(stmts))
		sum.pgTrips += float64(trips)
		sum.redisTrips += float64(rtrips)
		sum.readRows += float64(rows)
		sum.last = sum.last[:0]
		for _, s := range stmts {
			if s == pgledger.SQLUnsettledOf {
				sum.unsettledReads++
			}
			sum.last = append(sum.last, "  "+firstLine(s))
		}
	}
	if a := w.Stats(); a.Accounted != int64((warm+passes)*perPass) {
		t.Fatalf("accounted %d events, want %d", a.Accounted, (warm+passes)*perPass)
	}
	n := float64(passes)
	sum.stmts, sum.pgTrips, sum.redisTrips, sum.readRows, sum.unsettledReads = sum.stmts/n, sum.pgTrips/n, sum.redisTrips/n, sum.readRows/n, sum.unsettledReads/n
	return sum
}

// countedWorker returns a Postgres ledger whose pool c traces, a worker over it and a store on
// real Redis whose client c counts, and norgs orgs with a credit, settled and warm.
func countedWorker(t *testing.T, c *tripCounter, norgs int) (*pgledger.Ledger, *accounting.Worker, []string) {
	ctx := context.Background()
	env := testutil.Postgres(t)
	if _, err := migrations.Up(ctx, env.Pool); err != nil {
		t.Fatal(err)
	}
	pc, err := pgxpool.ParseConfig(env.URL)
	if err != nil {
		t.Fatal(err)
	}
	pc.ConnConfig.Tracer = c
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	l, err := pgledger.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	renv := testutil.RealRedis(t)
	renv.Client.AddHook(c)
	store := newStore(t, renv, l, balance.Config{ModelMaxCacheTTL: time.Hour})
	w := newWorker(t, l, store, &accounting.WorkerConfig{Logger: quiet})
	if err := l.PutModel(ctx, ledger.Model{Name: "m", MaxCost: 1000, DefaultHold: 100}); err != nil {
		t.Fatal(err)
	}
	orgs := make([]string, norgs)
	for i := range orgs {
		orgs[i] = fmt.Sprintf("o%03d", i)
		if err := l.CreateOrg(ctx, orgs[i]); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Credit(ctx, orgs[i], 1_000_000_000, "c-"+orgs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Drain(ctx); err != nil { // seeds every org: the counted passes find them warm
		t.Fatal(err)
	}
	return l, w, orgs
}

// firstLine is the first non-blank line of a statement, trimmed to 90 characters.
func firstLine(sql string) string {
	for _, ln := range strings.Split(sql, "\n") {
		if ln = strings.TrimSpace(ln); ln != "" {
			return ln[:min(len(ln), 90)]
		}
	}
	return ""
}
