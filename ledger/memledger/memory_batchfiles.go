package memledger

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/batchfile"
)

var _ batchfile.Store = (*Ledger)(nil)

// memFiles is the memory ledger's batch files; it has its own lock (files touch nothing else).
type memFiles struct {
	byID  map[string]*batchfile.File
	order []*batchfile.File
}

func copyFile(f *batchfile.File) batchfile.File {
	c := *f
	c.Prices = maps.Clone(f.Prices)
	return c
}

// RecordFile records a batch file for its org (idempotent for the same org).
func (m *Ledger) RecordFile(_ context.Context, f batchfile.File) error {
	if err := batchfile.Check(f); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.accounts[f.Org] == nil {
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, f.Org)
	}
	if m.bfiles.byID == nil {
		m.bfiles.byID = map[string]*batchfile.File{}
	}
	if old := m.bfiles.byID[f.ID]; old != nil {
		if old.Org != f.Org {
			return fmt.Errorf("%w: %s", batchfile.ErrConflict, f.ID)
		}
		return nil
	}
	f.CreatedAt = time.Now().UTC().Truncate(time.Microsecond)
	c := copyFile(&f)
	m.bfiles.byID[f.ID] = &c
	m.bfiles.order = append(m.bfiles.order, &c)
	return nil
}

// File returns a recorded batch file.
func (m *Ledger) File(_ context.Context, id string) (batchfile.File, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.bfiles.byID[id]
	if f == nil {
		return batchfile.File{}, fmt.Errorf("%w: %s", batchfile.ErrUnknownFile, id)
	}
	return copyFile(f), nil
}

// Files lists the org's batch files, newest first.
func (m *Ledger) Files(_ context.Context, org string, limit int) ([]batchfile.File, error) {
	limit = batchfile.ListLimit(limit)
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []batchfile.File
	for _, f := range slices.Backward(m.bfiles.order) {
		if len(out) == limit {
			break
		}
		if f.Org == org && m.bfiles.byID[f.ID] == f {
			out = append(out, copyFile(f))
		}
	}
	return out, nil
}

// DeleteFile forgets a batch file.
func (m *Ledger) DeleteFile(_ context.Context, id string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.bfiles.byID[id] == nil {
		return fmt.Errorf("%w: %s", batchfile.ErrUnknownFile, id)
	}
	delete(m.bfiles.byID, id)
	return nil
}
