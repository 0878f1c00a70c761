-- Customer views at O(1) per call (issue 34; server/view.go): the sums the views show, kept by
-- the writes that change them instead of summed over every charge on each call.
--   accounts.charged  the org's charges (sum of -delta of its 'charge' entries); the total it
--                     was credited (credits and adjustments) is balance + charged, so credit
--                     and adjust entries need no second column.
--   api_keys.charged  the same per key (the entries whose key_id is the key).
--   key_days          the same per key and UTC day of the charge's time (its reserve time, else
--                     its record time, as limits count it): a key's day, week and month read at
--                     most 31 rows.
-- The account pass's one grouped statement adds to all three (no extra statement, no write per
-- event: one row per org, key and key-day of a batch). Neither column is indexed, so the
-- account rows stay HOT-updated (migration 016).
ALTER TABLE accounts ADD COLUMN charged bigint NOT NULL DEFAULT 0;
ALTER TABLE api_keys ADD COLUMN charged bigint NOT NULL DEFAULT 0;
CREATE TABLE key_days (
    key_id  text   NOT NULL,
    day     date   NOT NULL,
    charged bigint NOT NULL,
    PRIMARY KEY (key_id, day)
);

-- Backfill from the entries already written.
UPDATE accounts a SET charged = s.charged
FROM (SELECT org_id, sum(-delta) AS charged FROM ledger_entries WHERE kind = 'charge' GROUP BY org_id) s
WHERE a.org_id = s.org_id;
UPDATE api_keys k SET charged = s.charged
FROM (SELECT key_id, sum(-delta) AS charged FROM ledger_entries WHERE kind = 'charge' AND key_id IS NOT NULL GROUP BY key_id) s
WHERE k.id = s.key_id;
INSERT INTO key_days (key_id, day, charged)
SELECT key_id, (coalesce(reserved_at, created_at) AT TIME ZONE 'UTC')::date, sum(-delta)
FROM ledger_entries WHERE kind = 'charge' AND key_id IS NOT NULL
GROUP BY 1, 2;
