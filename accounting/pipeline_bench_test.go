package accounting_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// BenchmarkPipeline measures the whole accounting pipeline on real Redis and Postgres: usage
// events of requests holding money are recorded (group-committed batches), accounted into
// ledger entries and settled into the hot balance (holds given back, costs charged). One op is
// one event; the events/s metric is the pipeline's sustained rate (goal: ≥ 10,000 on 2 cores).
// The holds are taken outside the timer.
func BenchmarkPipeline(b *testing.B) {
	for _, orgs := range []int{10, 100} {
		b.Run(fmt.Sprintf("orgs=%d", orgs), func(b *testing.B) {
			ctx := context.Background()
			env := testutil.RealRedis(b)
			pg := testutil.Postgres(b)
			l, err := pgledger.Open(ctx, pg.URL, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			store, err := balance.New(ctx, env.Client, &balance.Config{Ledger: l, Prefix: env.Prefix, MaxInFlight: 1 << 20, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			w := newWorker(b, l, store, &accounting.WorkerConfig{Logger: quiet})
			for i := 0; i < orgs; i++ {
				o := fmt.Sprintf("org%d", i)
				if err := l.CreateOrg(ctx, o); err != nil {
					b.Fatal(err)
				}
				if _, _, err := w.Credit(ctx, o, 1e13, "seed-"+o); err != nil {
					b.Fatal(err)
				}
			}
			const chunk = 5000
			b.ResetTimer()
			for done := 0; done < b.N; done += chunk {
				n := min(chunk, b.N-done)
				b.StopTimer()
				evs := benchEvents(n, orgs)
				for _, ev := range evs {
					if _, err := store.Reserve(ctx, balance.ReserveRequest{Org: ev.Org, HoldID: ev.ID, Amount: ev.HoldAmount}); err != nil {
						b.Fatal(err)
					}
				}
				b.StartTimer()
				for i := 0; i < n; i += 500 {
					if err := l.RecordUsage(ctx, evs[i:min(i+500, n)]); err != nil {
						b.Fatal(err)
					}
				}
				if err := w.Drain(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			reportRate(b, b.N)
			// Everything settled: no hold left, Redis equal to the ledger.
			for i := 0; i < orgs; i++ {
				o := fmt.Sprintf("org%d", i)
				st, _ := store.State(ctx, o)
				a, _ := l.Account(ctx, o)
				if st.Holds != 0 || st.Balance != a.Balance || a.SettledSeq != a.LedgerSeq {
					b.Fatalf("org %s not settled: redis %+v ledger %+v", o, st, a)
				}
			}
		})
	}
}
