package accounting_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/internal/testutil"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/ledger/pgledger"
)

// TestConfigRefusesOutOfRange: a field no default can mend is refused with ErrConfig instead of
// being corrected in silence; a nil config is the defaults.
func TestConfigRefusesOutOfRange(t *testing.T) {
	t.Parallel()
	mem := memledger.New()
	if _, err := accounting.NewRecorder(mem, nil); err != nil {
		t.Fatalf("NewRecorder(nil config): %v", err)
	}
	for name, cfg := range map[string]accounting.RecorderConfig{
		"MaxBatch":       {MaxBatch: -1},
		"Flushers":       {Flushers: -2},
		"Timeout":        {Timeout: -time.Second},
		"QueueSize":      {QueueSize: -1},
		"FlushInterval":  {FlushInterval: -time.Millisecond},
		"JournalReserve": {JournalReserve: 1.5},
		"NegReserve":     {JournalReserve: -0.1},
	} {
		if _, err := accounting.NewRecorder(mem, &cfg); !errors.Is(err, ledger.ErrConfig) {
			t.Errorf("NewRecorder %s: %v; want ErrConfig", name, err)
		}
	}
	if _, err := accounting.NewRecorder(nil, nil); !errors.Is(err, ledger.ErrConfig) {
		t.Errorf("NewRecorder(nil ledger): %v; want ErrConfig", err)
	}

	store := newStore(t, testutil.MiniRedis(t), mem, balance.Config{})
	if _, err := accounting.NewWorker(mem, store, nil); err != nil {
		t.Fatalf("NewWorker(nil config): %v", err)
	}
	for name, cfg := range map[string]accounting.WorkerConfig{
		"SettleConcurrency": {SettleConcurrency: -1},
		"SweepInterval":     {SweepInterval: -time.Second},
		"AccountBatch":      {AccountBatch: -5},
	} {
		if _, err := accounting.NewWorker(mem, store, &cfg); !errors.Is(err, ledger.ErrConfig) {
			t.Errorf("NewWorker %s: %v; want ErrConfig", name, err)
		}
	}
	if _, err := accounting.NewWorker(mem, nil, nil); !errors.Is(err, ledger.ErrConfig) {
		t.Errorf("NewWorker(nil store): %v; want ErrConfig", err)
	}

	if _, err := accounting.OpenJournal(t.TempDir(), &accounting.JournalConfig{MaxBytes: -1}); !errors.Is(err, ledger.ErrConfig) {
		t.Errorf("OpenJournal(-1): %v; want ErrConfig", err)
	}
	j, err := accounting.OpenJournal(t.TempDir(), nil)
	if err != nil {
		t.Fatalf("OpenJournal(nil config): %v", err)
	}
	defer j.Close()
	if j.Max() != 64<<20 {
		t.Errorf("default journal cap %d; want 64 MiB", j.Max())
	}
	if _, err := pgledger.Open(context.Background(), "postgres://unused", &pgledger.Config{ReconnectDelay: -time.Second}); !errors.Is(err, ledger.ErrConfig) {
		t.Errorf("OpenPostgres(negative ReconnectDelay): %v; want ErrConfig", err)
	}
}
