package accounting

import (
	"context"
	"errors"
	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/memledger"
	"github.com/llmescrow/escrow/pricing"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

func journalEvents(n int, org string) []ledger.UsageEvent {
	evs := make([]ledger.UsageEvent, n)
	for i := range evs {
		evs[i] = ledger.UsageEvent{ID: "0190f0e0-0000-7000-8000-" + pad12(i), Org: org, Model: "m", Cost: int64(10 + i),
			HoldAmount: 50, Usage: pricing.Usage{Prompt: 3, Completion: int64(i)}, CreatedAt: time.Unix(1700000000, 0).UTC()}
	}
	return evs
}

func pad12(i int) string {
	s := strconv.Itoa(i)
	for len(s) < 12 {
		s = "0" + s
	}
	return s
}

func TestJournalAppendReopen(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	j, err := OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	want := journalEvents(5, "acme")
	if err := j.Append(context.Background(), want[:2]); err != nil {
		t.Fatal(err)
	}
	if err := j.Append(context.Background(), want[2:]); err != nil {
		t.Fatal(err)
	}
	j.Close()
	j, err = OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	got, err := j.Events()
	if err != nil || len(got) != 5 || j.Len() != 5 {
		t.Fatalf("reopened journal: %d events (Len %d), %v", len(got), j.Len(), err)
	}
	for i := range want {
		if got[i].ID != want[i].ID || got[i].Cost != want[i].Cost || !got[i].Usage.Equal(want[i].Usage) {
			t.Fatalf("event %d: got %+v want %+v", i, got[i], want[i])
		}
	}
}

// TestJournalTornWrite cuts the file inside its last record at every byte and checks that the
// records before it survive, the torn one is dropped, and appends continue cleanly after it.
func TestJournalTornWrite(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	j, err := OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	evs := journalEvents(3, "acme")
	if err := j.Append(context.Background(), evs[:2]); err != nil {
		t.Fatal(err)
	}
	good := j.Size()
	if err := j.Append(context.Background(), evs[2:]); err != nil {
		t.Fatal(err)
	}
	full := j.Size()
	j.Close()
	path := filepath.Join(dir, journalFile)
	whole, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for cut := good + 1; cut < full; cut++ {
		if err := os.WriteFile(path, whole[:cut], 0o600); err != nil {
			t.Fatal(err)
		}
		j, err := OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
		if err != nil {
			t.Fatalf("cut at %d: %v", cut, err)
		}
		got, _ := j.Events()
		if len(got) != 2 || j.Size() != good {
			t.Fatalf("cut at %d: %d events, size %d; want 2 events, size %d", cut, len(got), j.Size(), good)
		}
		if err := j.Append(context.Background(), evs[2:]); err != nil {
			t.Fatal(err)
		}
		if got, _ := j.Events(); len(got) != 3 || got[2].ID != evs[2].ID {
			t.Fatalf("cut at %d: append after torn tail: %d events", cut, len(got))
		}
		j.Close()
	}
	// A flipped byte in the last payload is a corrupt record: dropped, not misread.
	bad := append([]byte(nil), whole...)
	bad[full-3] ^= 0xff
	if err := os.WriteFile(path, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	j, err = OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := j.Events(); len(got) != 2 {
		t.Fatalf("corrupt last record: %d events, want 2", len(got))
	}
	j.Close()
}

func TestJournalCap(t *testing.T) {
	t.Parallel()
	j, err := OpenJournal(t.TempDir(), &JournalConfig{MaxBytes: 600})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	evs := journalEvents(10, "acme")
	n := 0
	for _, ev := range evs {
		if err := j.Append(context.Background(), []ledger.UsageEvent{ev}); err != nil {
			if !errors.Is(err, ErrJournalFull) {
				t.Fatal(err)
			}
			break
		}
		n++
	}
	if n == 0 || n == len(evs) || j.Size() > j.Max() || j.Len() != n {
		t.Fatalf("cap 600: appended %d, size %d, len %d", n, j.Size(), j.Len())
	}
	if !j.NearFull(0.5) {
		t.Fatalf("a full journal should be near full")
	}
}

// TestJournalReplayTwice replays into a ledger twice (the second as if the first's emptying was
// lost in a crash): each event is charged once.
func TestJournalReplayTwice(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l := memledger.New()
	if err := l.CreateOrg(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	j, err := OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	evs := journalEvents(7, "acme")
	if err := j.Append(ctx, evs); err != nil {
		t.Fatal(err)
	}
	saved, err := os.ReadFile(filepath.Join(dir, journalFile))
	if err != nil {
		t.Fatal(err)
	}
	// A failing ledger leaves everything in place.
	if _, err := j.Replay(ctx, 3, func(context.Context, []ledger.UsageEvent) error { return ledger.ErrLedgerUnavailable }); err == nil || j.Len() != 7 {
		t.Fatalf("failed replay: err %v, %d left", err, j.Len())
	}
	if n, err := j.Replay(ctx, 3, l.RecordUsage); err != nil || n != 7 || j.Len() != 0 {
		t.Fatalf("replay: %d %v, %d left", n, err, j.Len())
	}
	j.Close()
	if err := os.WriteFile(filepath.Join(dir, journalFile), saved, 0o600); err != nil {
		t.Fatal(err)
	}
	j, err = OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	if n, err := j.Replay(ctx, 3, l.RecordUsage); err != nil || n != 7 {
		t.Fatalf("second replay: %d %v", n, err)
	}
	if _, err := l.AccountPending(ctx, 100); err != nil {
		t.Fatal(err)
	}
	acct, err := l.Account(ctx, "acme")
	if err != nil {
		t.Fatal(err)
	}
	var want int64
	for _, ev := range evs {
		want -= ev.Cost
	}
	if acct.Balance != want || acct.LedgerSeq != 7 {
		t.Fatalf("after two replays: balance %d seq %d, want %d and 7", acct.Balance, acct.LedgerSeq, want)
	}
}

// TestJournalAppendDuringReplay: events appended while a replay's ledger call runs are neither
// lost nor replayed by it; they stay for the next replay, and survive a reopen.
func TestJournalAppendDuringReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	j, err := OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	first, second := journalEvents(5, "a"), journalEvents(3, "b")
	if err := j.Append(ctx, first); err != nil {
		t.Fatal(err)
	}
	var got []ledger.UsageEvent
	n, err := j.Replay(ctx, 2, func(ctx context.Context, evs []ledger.UsageEvent) error {
		if len(got) == 0 { // appends do not wait for the ledger call
			if err := j.Append(ctx, second); err != nil {
				return err
			}
		}
		got = append(got, evs...)
		return nil
	})
	if err != nil || n != 5 || len(got) != 5 || got[4].Org != "a" {
		t.Fatalf("replay: %d %v, got %d events", n, err, len(got))
	}
	if j.Len() != 3 {
		t.Fatalf("%d events left, want the 3 appended during the replay", j.Len())
	}
	// One more append after the compaction lands after the kept ones.
	third := journalEvents(1, "c")
	if err := j.Append(ctx, third); err != nil {
		t.Fatal(err)
	}
	j.Close()
	j, err = OpenJournal(dir, &JournalConfig{MaxBytes: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	evs, err := j.Events()
	if err != nil || len(evs) != 4 || evs[0].Org != "b" || evs[2].Org != "b" || evs[3].Org != "c" {
		t.Fatalf("after reopen: %d events (%v)", len(evs), err)
	}
	if n, err := j.Replay(ctx, 10, func(context.Context, []ledger.UsageEvent) error { return nil }); n != 4 || err != nil || j.Len() != 0 || j.Size() != 0 {
		t.Fatalf("second replay: %d %v, left %d (%d bytes)", n, err, j.Len(), j.Size())
	}
}
