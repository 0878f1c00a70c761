-- Webhooks (issue 14): endpoints, an outbox of events written in the same transaction as the
-- ledger change that triggers them, and one delivery row per (endpoint, event) that the delivery
-- workers claim (FOR UPDATE SKIP LOCKED, with a lease) and retry with backoff.
-- (Reserved number: 006 once the limits (004) and anthropic (005) migrations are merged.)

-- An org's low-balance threshold: a balance.low event fires when a change to the ledger balance
-- takes it from >= threshold to < threshold. NULL: none.
ALTER TABLE accounts ADD COLUMN low_balance_threshold bigint
    CHECK (abs(low_balance_threshold) <= 100000000000000);

-- The secret signs deliveries (HMAC-SHA256), so it is kept as is; it is shown once, at creation.
CREATE TABLE webhook_endpoints (
    id         text        PRIMARY KEY,
    url        text        NOT NULL CHECK (octet_length(url) BETWEEN 1 AND 2048),
    secret     text        NOT NULL,
    events     text[]      NOT NULL CHECK (cardinality(events) > 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The outbox: one row per event, its body (the JSON every endpoint receives, byte for byte, on
-- every attempt) made when the event is written.
CREATE TABLE webhook_events (
    id         uuid        PRIMARY KEY,
    type       text        NOT NULL,
    org_id     text        NOT NULL,
    body       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- One row per event and subscribed endpoint. attempts counts the claims (a claim is an attempt);
-- while an attempt is in flight next_attempt_at is its lease's end, so a worker that died
-- mid-attempt leaves the delivery due again after the lease.
CREATE TABLE webhook_deliveries (
    id              bigserial   PRIMARY KEY,
    endpoint_id     text        NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    event_id        uuid        NOT NULL REFERENCES webhook_events (id),
    status          text        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts        int         NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text        NOT NULL DEFAULT '',
    last_status     int         NOT NULL DEFAULT 0,
    delivered_at    timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (endpoint_id, event_id)
);
-- The workers' claim: due pending deliveries only.
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at, id) WHERE status = 'pending';
-- An endpoint's deliveries, newest first.
CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries (endpoint_id, id);
