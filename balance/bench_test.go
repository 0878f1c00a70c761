package balance_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/lua"
)

// benchRig is what a benchmark runs on: a store, its client, a warm org, the key prefix and the
// fake ledger behind the store.
type benchRig struct {
	s      *balance.Store
	c      redis.UniversalClient
	org    string
	prefix string
	l      *balancetest.FakeLedger
}

// benchEnv is a real Redis for benchmarks (skipped without ESCROW_TEST_REDIS_URL), a warm org
// with a balance that never runs out, and a cap that never binds.
// benchEnv is a rig whose store sends each reserve on its own (Config.NoCoalesce), so that the
// benchmarks measure one call's path.
func benchEnv(b *testing.B) benchRig {
	return benchEnvCfg(b, balance.Config{NoCoalesce: true})
}

func benchEnvCfg(b *testing.B, cfg balance.Config) benchRig {
	b.Helper()
	if testutil.RealRedisURL() == "" {
		b.Skip("benchmarks need a real Redis: set ESCROW_TEST_REDIS_URL")
	}
	env := testutil.RealRedis(b)
	opt, _ := redis.ParseURL(env.URL)
	opt.PoolSize = 64
	c := redis.NewClient(opt)
	b.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	l := balancetest.NewFakeLedger(1)
	cfg.Ledger, cfg.Prefix, cfg.MaxInFlight, cfg.Logger = l, env.Prefix, 1<<30, slog.New(slog.DiscardHandler)
	s, err := balance.New(ctx, c, &cfg)
	if err != nil {
		b.Fatal(err)
	}
	org := testutil.RandomName("bench")
	l.Add(org, balance.MaxAmount, "")
	if err := s.Warm(ctx, org); err != nil {
		b.Fatal(err)
	}
	return benchRig{s: s, c: c, org: org, prefix: env.Prefix, l: l}
}

var benchSeq atomic.Int64

// BenchmarkReserve is the hot path without coalescing (Config.NoCoalesce): Store.Reserve on a
// warm org, one EVALSHA each, in parallel.
func BenchmarkReserve(b *testing.B) {
	benchReserve(b, benchEnv(b), "r")
}

// BenchmarkReserveCoalesced is BenchmarkReserve coalesced (the default): reserves that arrive
// while MaxPipelines round trips are in flight go together in one pipeline. Run it with
// -cpu 1,2 and a high -benchtime to see it at several concurrencies; compare with
// BenchmarkReserve and BenchmarkRawEVALSHA, or see BenchmarkCoalesceVsDirect.
func BenchmarkReserveCoalesced(b *testing.B) {
	benchReserve(b, benchEnvCfg(b, balance.Config{}), "c")
}

// benchReserve reserves 1 on the rig's org in parallel, under hold ids starting with idPrefix.
func benchReserve(b *testing.B, r benchRig, idPrefix string) {
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := idPrefix + strconv.FormatInt(benchSeq.Add(1), 10)
			if _, err := r.s.Reserve(ctx, balance.ReserveRequest{Org: r.org, HoldID: id, Amount: 1}); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkRawEVALSHA is the baseline: the same reserve script with the same arguments through
// a plain client.EvalSha, no Go layer. BenchmarkReserve / BenchmarkRawEVALSHA (ns/op inverted)
// is the Go layer's throughput ratio.
func BenchmarkRawEVALSHA(b *testing.B) {
	r := benchEnv(b)
	s, c := r.s, r.c
	ctx := context.Background()
	sha := c.ScriptLoad(ctx, lua.Reserve).Val()
	keys := balance.KeysOf(r.prefix, r.org).ReserveKeys()
	epoch := s.Epoch().String()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := "w" + strconv.FormatInt(benchSeq.Add(1), 10)
			res, err := c.EvalSha(ctx, sha, keys, epoch, id, "1", "600000", "1073741824", "30000", "43200000", "", "0").Slice()
			if err != nil || res[0] != "OK" {
				b.Error(fmt.Sprint(res, err))
				return
			}
		}
	})
}

// BenchmarkReserveVsRaw interleaves the two paths call by call in the same goroutines, so both
// see the same machine load (this machine's other work makes back-to-back runs noisy), and
// reports their mean latencies and raw/reserve, the Go layer's throughput ratio (goal ≥ 0.8).
func BenchmarkReserveVsRaw(b *testing.B) {
	r := benchEnv(b)
	s, c, org := r.s, r.c, r.org
	ctx := context.Background()
	sha := c.ScriptLoad(ctx, lua.Reserve).Val()
	rawOrg := org + "raw"
	// The raw path works on its own org, seeded the same way.
	if _, err := s.Seed(ctx, rawOrg, balance.Snapshot{Epoch: s.Epoch(), Balance: balance.MaxAmount, Seq: 1}); err != nil {
		b.Fatal(err)
	}
	keys := balance.KeysOf(r.prefix, rawOrg).ReserveKeys()
	epoch := s.Epoch().String()
	var rawNs, resNs atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := strconv.FormatInt(benchSeq.Add(1), 10)
			t0 := time.Now()
			res, err := c.EvalSha(ctx, sha, keys, epoch, "w"+n, "1", "600000", "1073741824", "30000", "43200000", "", "0").Slice()
			t1 := time.Now()
			if err != nil || res[0] != "OK" {
				b.Error(fmt.Sprint(res, err))
				return
			}
			if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: org, HoldID: "r" + n, Amount: 1}); err != nil {
				b.Error(err)
				return
			}
			t2 := time.Now()
			rawNs.Add(int64(t1.Sub(t0)))
			resNs.Add(int64(t2.Sub(t1)))
		}
	})
	b.ReportMetric(float64(rawNs.Load())/float64(b.N), "raw-ns/call")
	b.ReportMetric(float64(resNs.Load())/float64(b.N), "reserve-ns/call")
	b.ReportMetric(float64(rawNs.Load())/float64(resNs.Load()), "reserve/raw-throughput")
}

// BenchmarkFinishBatch is the recorder's per-batch finish: one op is one hold finished, in
// batches of 100 holds on one org (one script call) and spread over 10 orgs (a pipeline of ten
// calls). The holds are taken outside the timer.
func BenchmarkFinishBatch(b *testing.B) {
	for _, orgs := range []int{1, 10} {
		b.Run(fmt.Sprintf("orgs=%d", orgs), func(b *testing.B) {
			r := benchEnv(b)
			s, org := r.s, r.org
			ctx := context.Background()
			const batch = 100
			fs := make([]balance.Finish, 0, batch)
			b.ResetTimer()
			for done := 0; done < b.N; done += batch {
				b.StopTimer()
				fs = fs[:0]
				for i := range min(batch, b.N-done) {
					o := org
					if i%orgs != 0 {
						o = org + "-" + strconv.Itoa(i%orgs) // cold orgs: finish touches no balance
					}
					id := "f" + strconv.FormatInt(benchSeq.Add(1), 10)
					if o == org {
						if _, err := s.Reserve(ctx, balance.ReserveRequest{Org: o, HoldID: id, Amount: 100}); err != nil {
							b.Fatal(err)
						}
					}
					fs = append(fs, balance.Finish{Org: o, HoldID: id, Cost: 40})
				}
				b.StartTimer()
				if _, err := s.FinishBatch(ctx, fs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkReserveLimits interleaves, call by call in the same goroutines, a reserve on an org
// with no limits and one on an org with limits in scope (caps that never bind), and reports
// their mean latencies and the throughput ratio of reserve with the limits to reserve with none
// (goal ≥ 0.8), for two sets of limits (sub-benchmarks of the same run):
//
//   - three-money: the org's month, the key's project's day, the key's hour;
//   - enduser-requests-tokens (DESIGN.md "Limits", third wave): a money limit of each end user
//     apart (day), a requests and a tokens limit of the key (minute), each request with a token
//     bound and one of 1,000 end users (so every end user's counter is made once, then moved).
func BenchmarkReserveLimits(b *testing.B) {
	key := balance.Scope{Kind: balance.ScopeKey, ID: "key1"}
	b.Run("three-money", func(b *testing.B) {
		benchReserveVsNone(b, "three", balance.Limits{
			Limits: []balance.Limit{
				{ID: "o", Scope: balance.Scope{Kind: balance.ScopeOrg}, Window: balance.Month, Cap: balance.MaxAmount},
				{ID: "p", Scope: balance.Scope{Kind: balance.ScopeProject, ID: "prod"}, Window: balance.Day, Cap: balance.MaxAmount},
				{ID: "k", Scope: key, Window: balance.Hour, Cap: balance.MaxAmount},
			},
			Projects: map[string]string{"key1": "prod"},
		}, func(r *balance.ReserveRequest, n int64) {})
	})
	b.Run("enduser-requests-tokens", func(b *testing.B) {
		benchReserveVsNone(b, "enduser+requests+tokens", balance.Limits{
			Limits: []balance.Limit{
				{ID: "e", Scope: balance.Scope{Kind: balance.ScopeEndUser}, Window: balance.Day, Cap: balance.MaxAmount},
				{ID: "r", Scope: key, Window: balance.Minute, Unit: balance.Requests, Cap: balance.MaxAmount},
				{ID: "t", Scope: key, Window: balance.Minute, Unit: balance.Tokens, Cap: balance.MaxAmount},
			},
		}, func(r *balance.ReserveRequest, n int64) {
			r.Tokens, r.EndUser = 1_000, "user-"+strconv.FormatInt(n%1000, 10)
		})
	})
}

// benchReserveVsNone is one run of BenchmarkReserveLimits: reserves on a plain org and on an org
// with lim, taking turns, every request of key key1 and shaped by with (its token bound, its end
// user; the plain org's too, where no limit reads them). It reports <name>-limits-ns/call,
// none-ns/call and <name>/none-throughput.
func benchReserveVsNone(b *testing.B, name string, lim balance.Limits, with func(r *balance.ReserveRequest, n int64)) {
	r := benchEnv(b)
	s, plain, l := r.s, r.org, r.l
	ctx := context.Background()
	org := plain + "-lim"
	l.Add(org, balance.MaxAmount, "")
	l.SetLimits(org, lim)
	if err := s.Warm(ctx, org); err != nil {
		b.Fatal(err)
	}
	var noneNs, limNs atomic.Int64
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			n := benchSeq.Add(1)
			id := strconv.FormatInt(n, 10)
			none := balance.ReserveRequest{Org: plain, HoldID: "n" + id, Amount: 1, KeyID: "key1"}
			limited := balance.ReserveRequest{Org: org, HoldID: "l" + id, Amount: 1, KeyID: "key1"}
			with(&none, n)
			with(&limited, n)
			t0 := time.Now()
			if _, err := s.Reserve(ctx, none); err != nil {
				b.Error(err)
				return
			}
			t1 := time.Now()
			if _, err := s.Reserve(ctx, limited); err != nil {
				b.Error(err)
				return
			}
			t2 := time.Now()
			noneNs.Add(int64(t1.Sub(t0)))
			limNs.Add(int64(t2.Sub(t1)))
		}
	})
	b.ReportMetric(float64(noneNs.Load())/float64(b.N), "none-ns/call")
	b.ReportMetric(float64(limNs.Load())/float64(b.N), name+"-limits-ns/call")
	b.ReportMetric(float64(noneNs.Load())/float64(limNs.Load()), name+"/none-throughput")
}
