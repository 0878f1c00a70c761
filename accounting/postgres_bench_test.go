package accounting_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/ledgertest"
	"github.com/llmescrow/escrow/pricing"
)

func benchEvents(n, orgs int) []ledger.UsageEvent {
	evs := make([]ledger.UsageEvent, n)
	now := time.Now()
	for i := range evs {
		evs[i] = ledger.UsageEvent{
			ID: ledgertest.NewEventID(), Org: fmt.Sprintf("org%d", i%orgs), KeyID: "key_1", Model: "gpt-test",
			Endpoint: "/v1/chat/completions", Usage: pricing.Usage{Prompt: 900, Completion: 300, Units: pricing.Units{pricing.CachedInput: 100}},
			Cost: 1234, HoldAmount: 5000, CreatedAt: now,
		}
	}
	return evs
}

func reportRate(b *testing.B, events int) {
	b.ReportMetric(float64(events)/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkRecordUsageBatch: one RecordUsage call (one multi-row INSERT) per op. size=1 is the
// baseline: one row per round trip, as without group commit.
func BenchmarkRecordUsageBatch(b *testing.B) {
	for _, size := range []int{1, 10, 100, 500} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			l, _ := testutil.PostgresLedger(b)
			ctx := context.Background()
			evs := benchEvents(b.N*size, 100)
			b.ResetTimer()
			for i := range b.N {
				if err := l.RecordUsage(ctx, evs[i*size:(i+1)*size]); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, b.N*size)
		})
	}
}

// BenchmarkRecorder: many concurrent Record calls (as from many in-flight requests), each
// returning only when its event is durable in Postgres.
func BenchmarkRecorder(b *testing.B) {
	for _, flushers := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("flushers=%d", flushers), func(b *testing.B) {
			l, _ := testutil.PostgresLedger(b)
			r := newRecorder(b, l, accounting.RecorderConfig{Flushers: flushers})
			r.Start(context.Background())
			defer r.Stop(context.Background())
			evs := benchEvents(b.N, 100)
			b.SetParallelism(128) // 128 × GOMAXPROCS callers
			b.ResetTimer()
			idx := make(chan int, 1024)
			go func() {
				for i := range b.N {
					idx <- i
				}
				close(idx)
			}()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := <-idx
					if err := r.Record(context.Background(), evs[i]); err != nil {
						b.Error(err)
						return
					}
				}
			})
			reportRate(b, b.N)
		})
	}
}

// BenchmarkAccountPending: turning recorded events into ledger entries (claim, entries, one
// account update per org per batch), 100 orgs, batches of 1000.
func BenchmarkAccountPending(b *testing.B) {
	for _, orgs := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("orgs=%d", orgs), func(b *testing.B) {
			l, _ := testutil.PostgresLedger(b)
			ctx := context.Background()
			evs := benchEvents(b.N, orgs)
			for i := 0; i < len(evs); i += 500 {
				if err := l.RecordUsage(ctx, evs[i:min(i+500, len(evs))]); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			done := 0
			for done < b.N {
				n, err := l.AccountPending(ctx, 1000)
				if err != nil {
					b.Fatal(err)
				}
				if n == 0 {
					b.Fatalf("accounted %d of %d, then nothing", done, b.N)
				}
				done += n
			}
			reportRate(b, b.N)
		})
	}
}

// BenchmarkRecordUsageConcurrent: 16 callers, each one RecordUsage of one event per op (as
// without group commit, under concurrency), with and without the notification.
func BenchmarkRecordUsageConcurrent(b *testing.B) {
	for _, quiet := range []bool{false, true} {
		b.Run(fmt.Sprintf("quiet=%v", quiet), func(b *testing.B) {
			l, _ := testutil.PostgresLedger(b)
			ctx := context.Background()
			evs := benchEvents(b.N, 100)
			var next atomic.Int64
			b.SetParallelism(8) // 8 × GOMAXPROCS callers
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := next.Add(1) - 1
					ev := evs[i : i+1]
					var err error
					if quiet {
						err = l.RecordUsageQuiet(ctx, ev[:1])
					} else {
						err = l.RecordUsage(ctx, ev[:1])
					}
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			reportRate(b, b.N)
		})
	}
}
