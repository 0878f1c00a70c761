-- Auto top-up (DESIGN.md "Money in", issue 35): each org's settings and its attempts. An attempt
-- is started in one transaction that locks the org's settings row, so that any number of
-- workers start at most one; the partial unique index below is the backstop (one pending
-- attempt per org). An attempt's id is the processor's idempotency key; it is credited only by
-- the processor's webhook (a credit entry whose reference is the payment).
CREATE TABLE topup_settings (
    org_id         text        PRIMARY KEY REFERENCES accounts (org_id),
    threshold      bigint      NOT NULL,
    amount         bigint      NOT NULL CHECK (amount > 0),
    currency       text        NOT NULL,
    customer       text        NOT NULL,
    payment_method text        NOT NULL,
    daily_cap      bigint      NOT NULL,
    monthly_cap    bigint      NOT NULL,
    stopped        text        NOT NULL DEFAULT '',
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX topup_settings_customer ON topup_settings (customer);

CREATE TABLE topup_attempts (
    id          text        PRIMARY KEY,
    org_id      text        NOT NULL REFERENCES accounts (org_id),
    amount      bigint      NOT NULL,
    currency    text        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
    payment     text        NOT NULL DEFAULT '',
    reason      text        NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL,
    finished_at timestamptz
);
CREATE INDEX topup_attempts_org ON topup_attempts (org_id, created_at DESC);
CREATE UNIQUE INDEX topup_attempts_one_pending ON topup_attempts (org_id) WHERE status = 'pending';
