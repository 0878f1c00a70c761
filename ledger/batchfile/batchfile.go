// Package batchfile is the ledger's role for the files of batches (DESIGN.md "Async work"): a
// batch input file uploaded through escrow is read as it streams, every line checked and bounded
// at the batch price, and recorded here for its org with the sum of its lines' bounds before the
// client learns its id; the output and error files of a batch are recorded for the batch's org
// when escrow first sees them. Every file route answers only the org recorded here (another
// org's file is unknown: 404). memledger and pgledger implement Store.
package batchfile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/llmescrow/escrow/balance"
	"github.com/llmescrow/escrow/pricing"
)

// Purposes of a file.
const (
	PurposeBatch  = "batch"        // a batch's input, checked and bounded line by line
	PurposeOutput = "batch_output" // a batch's output or error file, written by the upstream
)

// File is one file escrow passed to the upstream (or read from it) for an org.
type File struct {
	ID       string `json:"id"` // the upstream's file id
	Org      string `json:"org"`
	KeyID    string `json:"key_id,omitempty"`
	Purpose  string `json:"purpose"`
	Filename string `json:"filename,omitempty"`
	Bytes    int64  `json:"bytes"`
	// Endpoint and Model are those of every line of an input file (one of each per file).
	Endpoint string `json:"endpoint,omitempty"`
	Model    string `json:"model,omitempty"`
	Lines    int    `json:"lines"`
	// Bound is the sum of the lines' bounds at Prices (the batch prices in force at upload);
	// Estimate the sum of their input bounds (what a lost batch is charged at least).
	Bound    int64          `json:"bound"`
	Estimate int64          `json:"estimate"`
	MaxLine  int64          `json:"max_line"` // the largest line bound: charged for a line whose usage cannot be read
	Prices   pricing.Prices `json:"prices,omitempty"`
	// Batch is the batch (its upstream id) an output or error file belongs to.
	Batch     string    `json:"batch,omitempty"`
	CreatedAt time.Time `json:"created_at"`
}

// Store records files.
type Store interface {
	// RecordFile records f (ErrInvalid). Recording the same id again for the same org changes
	// nothing; for another org it is ErrConflict.
	RecordFile(ctx context.Context, f File) error
	// File returns the file with id (ErrUnknownFile, also after DeleteFile).
	File(ctx context.Context, id string) (File, error)
	// Files lists the org's files, newest first, at most limit (≤ 0: 100; at most 10,000).
	Files(ctx context.Context, org string, limit int) ([]File, error)
	// DeleteFile forgets the file (ErrUnknownFile when it is not recorded).
	DeleteFile(ctx context.Context, id string) error
}

// Sentinel errors of Store.
var (
	ErrUnknownFile = errors.New("batchfile: unknown file")
	ErrInvalid     = errors.New("batchfile: invalid file")
	ErrConflict    = errors.New("batchfile: file id recorded for another org")
)

// Check validates a file to be recorded.
func Check(f File) error {
	if err := balance.ValidateOrg(f.Org); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	switch {
	case f.ID == "" || len(f.ID) > 256:
		return fmt.Errorf("%w: id must be 1-256 bytes", ErrInvalid)
	case f.Purpose != PurposeBatch && f.Purpose != PurposeOutput:
		return fmt.Errorf("%w: purpose %q", ErrInvalid, f.Purpose)
	case f.Bound < 0 || f.Bound > balance.MaxAmount || f.Estimate < 0 || f.Estimate > f.Bound || f.MaxLine < 0 || f.MaxLine > f.Bound:
		return fmt.Errorf("%w: bound %d, estimate %d", ErrInvalid, f.Bound, f.Estimate)
	case f.Lines < 0 || f.Bytes < 0:
		return fmt.Errorf("%w: negative size", ErrInvalid)
	}
	return f.Prices.Check()
}

// ListLimit is q's listing limit clamped as Files says.
func ListLimit(limit int) int {
	if limit <= 0 {
		return 100
	}
	return min(limit, 10_000)
}
