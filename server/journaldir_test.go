package server

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmescrow/escrow/accounting"
	"github.com/llmescrow/escrow/ledger/memledger"
)

// TestJournalOnByDefault (issue 34): the default configuration journals (served ⇒ billed
// through a ledger outage): "auto" is a directory named after the ledger under the state
// directory, a second proxy of the same ledger on the host gets the next slot, the demo's
// in-memory ledger a temporary directory removed at close, and "off" is said at start.
func TestJournalOnByDefault(t *testing.T) {
	if d := DefaultConfig().JournalDir; d != JournalAuto {
		t.Fatalf("default ESCROW_JOURNAL_DIR %q, want %q", d, JournalAuto)
	}
	ctx := context.Background()
	l := memledger.New()
	t.Cleanup(l.Close)
	var logs bytes.Buffer
	srv := func(dir, db string) *Server {
		c := DefaultConfig()
		c.JournalDir, c.DatabaseURL = dir, db
		return &Server{cfg: *c, ledger: l, log: slog.New(slog.NewTextHandler(&logs, nil))}
	}
	first, err := srv(JournalAuto, "postgres://db").journalDir(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ep, _ := l.Epoch(ctx)
	if want := filepath.Join(os.Getenv("XDG_STATE_HOME"), "escrow", "journal-"+ep.ID); first != want {
		t.Fatalf("auto journal %q, want %q", first, want)
	}
	j, err := accounting.OpenJournal(first, nil) // the first proxy runs
	if err != nil {
		t.Fatal(err)
	}
	if _, err := accounting.OpenJournal(first, nil); !errors.Is(err, accounting.ErrJournalLocked) {
		t.Fatalf("a second open of a journal in use: %v, want ErrJournalLocked", err)
	}
	second, err := srv(JournalAuto, "postgres://db").journalDir(ctx)
	if err != nil || second != first+".2" {
		t.Fatalf("second proxy's journal %q (%v), want %q", second, err, first+".2")
	}
	_ = j.Close()

	demo := srv(JournalAuto, "")
	tmp, err := demo.journalDir(ctx)
	if err != nil || tmp == "" {
		t.Fatalf("demo journal %q %v", tmp, err)
	}
	if _, err := os.Stat(tmp); err != nil {
		t.Fatal(err)
	}
	demo.close()
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatalf("the demo's temporary journal %s outlived close: %v", tmp, err)
	}

	if d, err := srv(JournalOff, "postgres://db").journalDir(ctx); d != "" || err != nil {
		t.Fatalf("off: %q %v", d, err)
	}
	if !strings.Contains(logs.String(), "local journal off") {
		t.Fatalf("turning the journal off is not logged:\n%s", logs.String())
	}
}
