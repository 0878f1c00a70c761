-- Jobs (DESIGN.md "Async work", issue 33): work that bills after its HTTP request ends
-- (background responses, batches). A job is written before the client learns its id; its id is
-- its hold's id. A poller claims due jobs with a lease (FOR UPDATE SKIP LOCKED); a lease that ran
-- out is claimed again by any process. A job is live until settled_at is set, which happens once,
-- in the transaction that writes its usage events; while it is live the reaper's ledger check
-- (UnsettledUsage) reports its hold busy.
CREATE TABLE jobs (
    id           uuid        PRIMARY KEY,
    kind         text        NOT NULL CHECK (kind IN ('background_response', 'openai_batch', 'anthropic_batch')),
    org_id       text        NOT NULL REFERENCES accounts (org_id),
    key_id       text,
    project      text,
    end_user     text,
    model        text        NOT NULL,
    endpoint     text,
    upstream_id  text        NOT NULL,
    hold         bigint      NOT NULL CHECK (hold >= 0),
    reserved_at  timestamptz,
    estimate     bigint      NOT NULL CHECK (estimate >= 0),
    prices       jsonb       NOT NULL,
    data         jsonb,
    status       text        NOT NULL CHECK (status IN ('pending', 'running', 'completed', 'incomplete',
                                                        'failed', 'cancelled', 'expired', 'lost')),
    attempts     integer     NOT NULL DEFAULT 0,
    lease_owner  text,
    lease_until  timestamptz,
    next_poll_at timestamptz NOT NULL DEFAULT now(),
    usage        jsonb,
    cost         bigint      NOT NULL DEFAULT 0,
    unresolved   boolean     NOT NULL DEFAULT false,
    reason       text        NOT NULL DEFAULT '',
    settled_at   timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (kind, upstream_id)
);
-- The poller's claim: live jobs by due time.
CREATE INDEX jobs_due ON jobs (next_poll_at) WHERE settled_at IS NULL;
CREATE INDEX jobs_org ON jobs (org_id, created_at DESC);
