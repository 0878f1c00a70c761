package accounting

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/llmescrow/escrow/ledger"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"sync"
)

// ErrJournalFull is returned by Journal.Append when the events do not fit under the size cap.
var ErrJournalFull = errors.New("accounting: local journal full")

// ErrJournalLocked is returned by OpenJournal when another process (or another Journal of this
// one) has the directory's journal open: each running proxy needs a journal of its own.
var ErrJournalLocked = errors.New("accounting: local journal in use by another process")

// journalFile is the journal's file name inside its directory.
const journalFile = "usage.journal"

// recordHeader is a record's length (uint32) and its payload's CRC-32C (uint32), big endian.
const recordHeader = 8

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Journal is a bounded, append-only, fsynced local file of usage events, used while the ledger is
// unreachable and replayed (idempotently: events keep their ids) when it is back. Each record is
// a length, a CRC-32C and a JSON event; a torn last record (a crash mid-write) is detected on
// open and cut off, so it never blocks the records before it.
type Journal struct {
	path string
	max  int64

	replayMu sync.Mutex // one Replay at a time
	mu       sync.Mutex
	f        *os.File
	size     int64
	count    int
}

// JournalConfig configures a Journal. The zero value of every field means its documented
// default; a negative value is refused (ErrConfig).
type JournalConfig struct {
	// MaxBytes caps the journal file's size: Append refuses (ErrJournalFull) what would take it
	// past the cap. Default 64 MiB.
	MaxBytes int64
}

// defaultJournalMaxBytes is JournalConfig.MaxBytes's default.
const defaultJournalMaxBytes = 64 << 20

// withDefaults returns the config with every zero field set to its default; c may be nil.
func (c *JournalConfig) withDefaults() JournalConfig {
	var z JournalConfig
	if c != nil {
		z = *c
	}
	z.MaxBytes = cmp.Or(z.MaxBytes, defaultJournalMaxBytes)
	return z
}

// validate refuses a negative size cap.
func (c *JournalConfig) validate() error {
	if c.MaxBytes < 0 {
		return fmt.Errorf("%w: journal MaxBytes %d must be ≥ 0", ledger.ErrConfig, c.MaxBytes)
	}
	return nil
}

// OpenJournal opens (or creates) the journal in dir; cfg may be nil for the defaults.
func OpenJournal(dir string, cfg *JournalConfig) (*Journal, error) {
	c := cfg.withDefaults()
	if err := c.validate(); err != nil {
		return nil, err
	}
	maxBytes := c.MaxBytes
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("accounting: journal dir: %w", err)
	}
	path := filepath.Join(dir, journalFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("accounting: open journal: %w", err)
	}
	if err := lockJournal(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("accounting: lock journal %s: %w", path, err)
	}
	j := &Journal{path: path, max: maxBytes, f: f}
	events, good, err := readRecords(f)
	if err != nil {
		f.Close()
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if st.Size() != good { // a torn tail: cut it off
		if err := f.Truncate(good); err != nil {
			f.Close()
			return nil, fmt.Errorf("accounting: truncate torn journal tail: %w", err)
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return nil, err
		}
	}
	if _, err := f.Seek(good, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	j.size, j.count = good, len(events)
	return j, nil
}

// readRecords reads every whole, valid record from the start of f and returns the offset where
// they end.
func readRecords(f *os.File) ([]ledger.UsageEvent, int64, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, 0, err
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, 0, fmt.Errorf("accounting: read journal: %w", err)
	}
	var events []ledger.UsageEvent
	off := 0
	for len(data)-off >= recordHeader {
		n := int(binary.BigEndian.Uint32(data[off:]))
		sum := binary.BigEndian.Uint32(data[off+4:])
		if n <= 0 || len(data)-off-recordHeader < n {
			break // torn: the payload never made it whole
		}
		payload := data[off+recordHeader : off+recordHeader+n]
		if crc32.Checksum(payload, castagnoli) != sum {
			break // torn or corrupt: nothing after it can be trusted
		}
		var ev ledger.UsageEvent
		if err := json.Unmarshal(payload, &ev); err != nil {
			break
		}
		events = append(events, ev)
		off += recordHeader + n
	}
	return events, int64(off), nil
}

// Append writes events and fsyncs before it returns: when it returns nil they survive a crash.
// It refuses (ErrJournalFull) events that would take the file past its cap, writing none.
func (j *Journal) Append(ctx context.Context, events []ledger.UsageEvent) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var buf bytes.Buffer
	for _, ev := range events {
		payload, err := json.Marshal(ev)
		if err != nil {
			return err
		}
		var h [recordHeader]byte
		binary.BigEndian.PutUint32(h[:], uint32(len(payload)))
		binary.BigEndian.PutUint32(h[4:], crc32.Checksum(payload, castagnoli))
		buf.Write(h[:])
		buf.Write(payload)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return errors.New("accounting: journal closed")
	}
	if j.size+int64(buf.Len()) > j.max {
		return ErrJournalFull
	}
	n, err := j.f.Write(buf.Bytes())
	if err == nil {
		err = j.f.Sync()
	}
	if err != nil {
		// Cut a partial write off so the next record starts clean.
		_ = j.f.Truncate(j.size)
		_, _ = j.f.Seek(j.size, io.SeekStart)
		return fmt.Errorf("accounting: journal write: %w", err)
	}
	j.size += int64(n)
	j.count += len(events)
	return nil
}

// Events returns the events in the journal.
func (j *Journal) Events() ([]ledger.UsageEvent, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil, errors.New("accounting: journal closed")
	}
	events, _, err := readRecords(j.f)
	if _, serr := j.f.Seek(j.size, io.SeekStart); err == nil {
		err = serr
	}
	return events, err
}

// Replay hands the journal's events to record (in batches of at most batch) and, once every
// batch succeeded, removes them from the journal. Appends go on while record runs: the events
// appended meanwhile stay for the next Replay (they are copied into a fresh file that replaces
// the journal atomically, so a crash at any point leaves either the old file or the new one).
// Only one Replay runs at a time. Replaying twice is safe when record is idempotent by event
// id, as the ledgers are. It returns how many events it replayed.
func (j *Journal) Replay(ctx context.Context, batch int, record func(context.Context, []ledger.UsageEvent) error) (int, error) {
	j.replayMu.Lock()
	defer j.replayMu.Unlock()

	events, end, err := j.snapshot()
	if err != nil || len(events) == 0 {
		return 0, err
	}
	batch = max(batch, 1)
	for i := 0; i < len(events); i += batch {
		if err := record(ctx, events[i:min(i+batch, len(events))]); err != nil {
			return i, err
		}
	}
	return len(events), j.dropThrough(end, len(events))
}

// snapshot reads every record in the journal and the offset where they end.
func (j *Journal) snapshot() ([]ledger.UsageEvent, int64, error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil, 0, errors.New("accounting: journal closed")
	}
	if j.count == 0 {
		return nil, 0, nil
	}
	events, end, err := readRecords(j.f)
	if _, serr := j.f.Seek(j.size, io.SeekStart); err == nil {
		err = serr
	}
	return events, end, err
}

// dropThrough removes the first n records, which end at offset end, from the journal: in place
// when nothing was appended since they were read, else by writing what follows them to a new
// file renamed over the old one.
func (j *Journal) dropThrough(end int64, n int) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return errors.New("accounting: journal closed")
	}
	if j.size == end {
		// Nothing was appended meanwhile: empty the file in place.
		if err := j.f.Truncate(0); err != nil {
			return err
		}
		if _, err := j.f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		if err := j.f.Sync(); err != nil {
			return err
		}
		j.size, j.count = 0, 0
		return nil
	}
	// Keep what was appended after the replayed records.
	rest := make([]byte, j.size-end)
	if _, err := j.f.ReadAt(rest, end); err != nil {
		return fmt.Errorf("accounting: journal compaction: %w", err)
	}
	_, _ = j.f.Seek(j.size, io.SeekStart)
	nf, err := j.replaceWith(rest)
	if err != nil {
		return fmt.Errorf("accounting: journal compaction: %w", err)
	}
	j.f.Close()
	j.f = nf
	j.size = int64(len(rest))
	j.count -= n
	return nil
}

// replaceWith writes data to a new file, renames it over the journal (durably) and returns it
// open at its end.
func (j *Journal) replaceWith(data []byte) (*os.File, error) {
	tmp := j.path + ".tmp"
	nf, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, err
	}
	if _, err = nf.Write(data); err == nil {
		err = nf.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, j.path)
	}
	if err == nil {
		err = syncDir(filepath.Dir(j.path))
	}
	if err == nil {
		_, err = nf.Seek(int64(len(data)), io.SeekStart)
	}
	if err != nil {
		nf.Close()
		_ = os.Remove(tmp)
		return nil, err
	}
	return nf, nil
}

// syncDir fsyncs a directory, so that a rename in it survives a crash.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Size is the journal's size in bytes; Len its number of events; Max its cap.
func (j *Journal) Size() int64 { j.mu.Lock(); defer j.mu.Unlock(); return j.size }
func (j *Journal) Len() int    { j.mu.Lock(); defer j.mu.Unlock(); return j.count }
func (j *Journal) Max() int64  { return j.max }

// NearFull reports whether less than the given fraction of the cap is free: new holds should be
// refused then, so the requests already in flight still have room.
func (j *Journal) NearFull(freeFraction float64) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return float64(j.max-j.size) < freeFraction*float64(j.max)
}

// Close closes the file; the events stay on disk for the next OpenJournal.
func (j *Journal) Close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	return err
}
