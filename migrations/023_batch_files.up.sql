-- Batch files (DESIGN.md "Async work", issue 33): a batch input file uploaded through escrow,
-- recorded for its org with the sum of its lines' bounds at the batch price; and the output and
-- error files of a batch, recorded for the batch's org when escrow first sees them. Every file
-- route answers only the org recorded here.
CREATE TABLE batch_files (
    id         text        PRIMARY KEY,
    org_id     text        NOT NULL REFERENCES accounts (org_id),
    key_id     text,
    purpose    text        NOT NULL CHECK (purpose IN ('batch', 'batch_output')),
    filename   text        NOT NULL DEFAULT '',
    bytes      bigint      NOT NULL DEFAULT 0 CHECK (bytes >= 0),
    endpoint   text        NOT NULL DEFAULT '',
    model      text        NOT NULL DEFAULT '',
    lines      integer     NOT NULL DEFAULT 0 CHECK (lines >= 0),
    bound      bigint      NOT NULL DEFAULT 0 CHECK (bound >= 0),
    estimate   bigint      NOT NULL DEFAULT 0 CHECK (estimate >= 0),
    max_line   bigint      NOT NULL DEFAULT 0 CHECK (max_line >= 0),
    prices     jsonb,
    batch      text        NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz
);
CREATE INDEX batch_files_org ON batch_files (org_id, created_at DESC) WHERE deleted_at IS NULL;
