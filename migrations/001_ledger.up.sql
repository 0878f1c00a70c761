-- The ledger: accounts, prices, API keys, usage events and ledger entries. See docs/DESIGN.md
-- "Postgres" and "Money". Every amount is an int64 count of micro-units within ±10^14.

-- The ledger's epoch: (generation, random id), one row, made once with the ledger. An admin
-- raises gen after a restore from backup, so a hot balance of the old ledger never matches.
CREATE TABLE ledger_meta (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    epoch_gen  bigint      NOT NULL DEFAULT 1 CHECK (epoch_gen > 0),
    epoch_id   text        NOT NULL DEFAULT replace(gen_random_uuid()::text, '-', ''),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO ledger_meta DEFAULT VALUES;

CREATE TABLE accounts (
    org_id      text        PRIMARY KEY CHECK (octet_length(org_id) BETWEEN 1 AND 128),
    balance     bigint      NOT NULL DEFAULT 0 CHECK (abs(balance) <= 100000000000000),
    ledger_seq  bigint      NOT NULL DEFAULT 0 CHECK (ledger_seq >= 0),
    settled_seq bigint      NOT NULL DEFAULT 0 CHECK (settled_seq >= 0 AND settled_seq <= ledger_seq),
    created_at  timestamptz NOT NULL DEFAULT now()
);
-- OrgsToSettle: only the (few) accounts behind on settling are in this index.
CREATE INDEX accounts_unsettled ON accounts (org_id) WHERE settled_seq < ledger_seq;

CREATE TABLE models (
    model              text   PRIMARY KEY CHECK (model <> ''),
    input_price        bigint NOT NULL DEFAULT 0 CHECK (input_price BETWEEN 0 AND 100000000000000),
    cached_input_price bigint NOT NULL DEFAULT 0 CHECK (cached_input_price BETWEEN 0 AND 100000000000000),
    output_price       bigint NOT NULL DEFAULT 0 CHECK (output_price BETWEEN 0 AND 100000000000000),
    max_input_tokens   bigint NOT NULL DEFAULT 0 CHECK (max_input_tokens >= 0),
    max_output_tokens  bigint NOT NULL DEFAULT 0 CHECK (max_output_tokens >= 0),
    max_cost           bigint NOT NULL DEFAULT 0 CHECK (max_cost BETWEEN 0 AND 100000000000000),
    default_hold       bigint NOT NULL DEFAULT 0 CHECK (default_hold BETWEEN 0 AND 100000000000000),
    updated_at         timestamptz NOT NULL DEFAULT now()
);

-- Only the SHA-256 of a key's secret is stored.
CREATE TABLE api_keys (
    id         text        PRIMARY KEY,
    hash       bytea       NOT NULL UNIQUE CHECK (octet_length(hash) = 32),
    org_id     text        NOT NULL REFERENCES accounts (org_id),
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX api_keys_org ON api_keys (org_id);

-- One row per served request; id is the request's hold id (a UUIDv7), which makes recording
-- idempotent. status goes pending → accounted once, when its charge entry (seq) is written.
-- No foreign key to accounts: a request that was served is billed even if its org row is
-- missing (accounting creates the account).
CREATE TABLE usage_events (
    id                uuid        PRIMARY KEY,
    org_id            text        NOT NULL CHECK (octet_length(org_id) BETWEEN 1 AND 128),
    model             text        NOT NULL,
    key_id            text,
    endpoint          text,
    prompt_tokens     bigint      NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    cached_tokens     bigint      NOT NULL DEFAULT 0 CHECK (cached_tokens >= 0),
    completion_tokens bigint      NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    reasoning_tokens  bigint      NOT NULL DEFAULT 0 CHECK (reasoning_tokens >= 0),
    cost              bigint      NOT NULL CHECK (cost BETWEEN 0 AND 100000000000000),
    hold_amount       bigint      NOT NULL DEFAULT 0 CHECK (hold_amount BETWEEN 0 AND 100000000000000),
    estimated         boolean     NOT NULL DEFAULT false,
    status            text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'accounted')),
    seq               bigint,     -- the charge entry's seq once accounted
    created_at        timestamptz NOT NULL DEFAULT now(),
    CHECK ((status = 'pending') = (seq IS NULL))
);
-- Pending events only (the index stays small: rows leave it when accounted).
--   AccountPending's discovery: ORDER BY created_at LIMIT n  → usage_events_pending_fifo
--   one org's claim (worker, snapshot), OrgsToSettle          → usage_events_pending_org
CREATE INDEX usage_events_pending_fifo ON usage_events (created_at) WHERE status = 'pending';
CREATE INDEX usage_events_pending_org ON usage_events (org_id, created_at, id) WHERE status = 'pending';

-- An org's ledger: entries numbered 1, 2, 3 … per org with no gap; accounts.balance is the sum of
-- the deltas and accounts.ledger_seq the last seq.
CREATE TABLE ledger_entries (
    org_id     text        NOT NULL,
    seq        bigint      NOT NULL CHECK (seq > 0),
    delta      bigint      NOT NULL CHECK (abs(delta) <= 100000000000000),
    kind       text        NOT NULL CHECK (kind IN ('charge', 'credit', 'adjust')),
    hold_id    uuid,
    ref        text,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, seq),
    CHECK (CASE kind WHEN 'charge' THEN delta <= 0 WHEN 'credit' THEN delta > 0 ELSE delta <> 0 END)
);
-- A credit's (or adjustment's) payment reference is unique across all orgs.
CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref) WHERE ref IS NOT NULL;
