package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/llmescrow/escrow/ledger"
	"github.com/llmescrow/escrow/ledger/batchfile"
)

var _ batchfile.Store = (*Ledger)(nil)

const fileColumns = `id, org_id, coalesce(key_id, ''), purpose, filename, bytes, endpoint, model, lines, bound, estimate,
	max_line, prices, batch, created_at`

func scanFile(r pgx.Row) (batchfile.File, error) {
	var f batchfile.File
	var prices []byte
	if err := r.Scan(&f.ID, &f.Org, &f.KeyID, &f.Purpose, &f.Filename, &f.Bytes, &f.Endpoint, &f.Model, &f.Lines,
		&f.Bound, &f.Estimate, &f.MaxLine, &prices, &f.Batch, &f.CreatedAt); err != nil {
		return f, err
	}
	if len(prices) > 0 {
		if err := json.Unmarshal(prices, &f.Prices); err != nil {
			return f, fmt.Errorf("file %s prices: %w", f.ID, err)
		}
	}
	return f, nil
}

// RecordFile records a batch file for its org (idempotent for the same org).
func (p *Ledger) RecordFile(ctx context.Context, f batchfile.File) error {
	if err := batchfile.Check(f); err != nil {
		return err
	}
	var prices []byte
	if f.Prices != nil {
		var err error
		if prices, err = json.Marshal(f.Prices); err != nil {
			return err
		}
	}
	var org string
	err := p.pool.QueryRow(ctx, `
WITH ins AS (
  INSERT INTO batch_files (id, org_id, key_id, purpose, filename, bytes, endpoint, model, lines, bound, estimate, max_line, prices, batch)
  SELECT $1, $2, nullif($3, ''), $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14
  WHERE EXISTS (SELECT 1 FROM accounts WHERE org_id = $2)
  ON CONFLICT (id) DO NOTHING
  RETURNING org_id)
SELECT org_id FROM ins
UNION ALL SELECT org_id FROM batch_files WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM ins)`,
		f.ID, f.Org, f.KeyID, f.Purpose, f.Filename, f.Bytes, f.Endpoint, f.Model, f.Lines, f.Bound, f.Estimate, f.MaxLine, prices, f.Batch).Scan(&org)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %q", ledger.ErrUnknownOrg, f.Org)
	case err != nil:
		return wrapPg("record file", err)
	case org != f.Org:
		return fmt.Errorf("%w: %s", batchfile.ErrConflict, f.ID)
	}
	return nil
}

// File returns a recorded batch file.
func (p *Ledger) File(ctx context.Context, id string) (batchfile.File, error) {
	f, err := scanFile(p.pool.QueryRow(ctx, `SELECT `+fileColumns+` FROM batch_files WHERE id = $1 AND deleted_at IS NULL`, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return f, fmt.Errorf("%w: %s", batchfile.ErrUnknownFile, id)
	}
	return f, wrapPg("file", err)
}

// Files lists the org's batch files, newest first.
func (p *Ledger) Files(ctx context.Context, org string, limit int) ([]batchfile.File, error) {
	rows, err := p.pool.Query(ctx, `SELECT `+fileColumns+` FROM batch_files WHERE org_id = $1 AND deleted_at IS NULL
ORDER BY created_at DESC, id DESC LIMIT $2`, org, batchfile.ListLimit(limit))
	if err != nil {
		return nil, wrapPg("files", err)
	}
	defer rows.Close()
	var out []batchfile.File
	for rows.Next() {
		f, err := scanFile(rows)
		if err != nil {
			return nil, wrapPg("files", err)
		}
		out = append(out, f)
	}
	return out, wrapPg("files", rows.Err())
}

// DeleteFile forgets a batch file (the row stays, marked deleted).
func (p *Ledger) DeleteFile(ctx context.Context, id string) error {
	tag, err := p.pool.Exec(ctx, `UPDATE batch_files SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL`, id)
	if err != nil {
		return wrapPg("delete file", err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %s", batchfile.ErrUnknownFile, id)
	}
	return nil
}
