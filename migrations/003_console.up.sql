-- The seller's console (issue 14): display names for orgs and keys, the audit trail of admin
-- writes, and the indexes of the read API.

ALTER TABLE accounts ADD COLUMN name text NOT NULL DEFAULT '' CHECK (octet_length(name) <= 200);
ALTER TABLE api_keys ADD COLUMN name text NOT NULL DEFAULT '' CHECK (octet_length(name) <= 200);

-- ListKeys: an org's keys in (created_at, id) order, from the cursor on.
CREATE INDEX api_keys_org_created ON api_keys (org_id, created_at, id);

-- UsageReport: an org's accounted requests in a time range (cost, tokens, model and key are in
-- the event row; its charge entry has the same cost).
CREATE INDEX usage_events_org_accounted ON usage_events (org_id, created_at) WHERE status = 'accounted';

-- Every admin write: who, what, when.
CREATE TABLE admin_audit (
    id     bigserial   PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text        NOT NULL,
    action text        NOT NULL,
    target text        NOT NULL DEFAULT '',
    status int         NOT NULL,
    detail text        NOT NULL DEFAULT ''
);
