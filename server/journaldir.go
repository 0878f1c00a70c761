package server

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/llmescrow/escrow/accounting"
)

// The special values of ESCROW_JOURNAL_DIR (Config.JournalDir); anything else is a directory.
const (
	// JournalAuto, the default: a directory of its own under the state directory (see
	// journalDir); the embedded demo, whose ledger lives in memory, gets a temporary one.
	JournalAuto = "auto"
	// JournalOff: no journal. Logged at start: while the ledger is down or slow, usage whose
	// content was served is kept only in this process's memory until it is recorded.
	JournalOff = "off"
)

// maxJournalSlots bounds the journal directories one state directory offers to proxies of the
// same ledger on one host (each takes the first one no other process has locked).
const maxJournalSlots = 16

// stateDir is where escrow keeps its state by default: $STATE_DIRECTORY (systemd's
// StateDirectory=), else $XDG_STATE_HOME/escrow, else ~/.local/state/escrow.
func stateDir() (string, error) {
	if d := os.Getenv("STATE_DIRECTORY"); d != "" {
		return strings.Split(d, ":")[0], nil
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "escrow"), nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("%w: no state directory for the journal (set ESCROW_JOURNAL_DIR, or off): %w", ErrConfig, err)
	}
	return filepath.Join(home, ".local", "state", "escrow"), nil
}

// journalDir resolves Config.JournalDir: "" or "off" → no journal (logged); a path → itself;
// "auto" → a temporary directory for the in-memory ledger (removed at Stop), else
// <state dir>/journal-<ledger epoch id>[.<slot>]: named after the ledger it belongs to, so a
// restart finds its journal again and a journal is never replayed into another database, and
// the first slot that no other running proxy has locked.
func (s *Server) journalDir(ctx context.Context) (string, error) {
	switch d := s.cfg.JournalDir; d {
	case "", JournalOff:
		s.log.Warn("local journal off (ESCROW_JOURNAL_DIR=off): while the ledger is down, cold work fails with 503, and " +
			"the usage of a response already served waits in this process's memory until the ledger takes it (lost if the process dies first)")
		return "", nil
	case JournalAuto:
	default:
		return d, nil
	}
	if s.cfg.DatabaseURL == "" {
		dir, err := os.MkdirTemp("", "escrow-journal-")
		if err != nil {
			return "", fmt.Errorf("journal: %w", err)
		}
		s.tempJournal = dir
		return dir, nil
	}
	base, err := stateDir()
	if err != nil {
		return "", err
	}
	ep, err := s.ledger.Epoch(ctx)
	if err != nil {
		// the same words as escrow.New's own check of the ledger, which would come next
		return "", fmt.Errorf("ledger not ready (are the migrations applied? escrow serve applies them unless ESCROW_MIGRATE=false): %w", err)
	}
	name := "journal-" + strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' {
			return r
		}
		return '_'
	}, ep.ID)
	for slot := 1; slot <= maxJournalSlots; slot++ {
		dir := filepath.Join(base, name)
		if slot > 1 {
			dir += "." + strconv.Itoa(slot)
		}
		j, err := accounting.OpenJournal(dir, &accounting.JournalConfig{MaxBytes: s.cfg.JournalMaxBytes})
		if errors.Is(err, accounting.ErrJournalLocked) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("journal: %w", err)
		}
		_ = j.Close() // escrow.New opens it again, for good
		return dir, nil
	}
	return "", fmt.Errorf("%w: the %d journal directories under %s are all in use; set ESCROW_JOURNAL_DIR", ErrConfig, maxJournalSlots, base)
}
