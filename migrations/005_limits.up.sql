-- Limits (issue 13; DESIGN.md "Limits"): caps per org, project or key by window, freezes, and
-- what a charge needs to be attributed to them (its key, its key's project at reserve time and
-- its reserve time on the Redis clock).

-- Every change of an org's limits, freezes, projects or key → project map raises
-- limits_version in the same transaction (the account row is the lock of those changes and of
-- snapshots); the hot state records the version it was seeded with.
ALTER TABLE accounts ADD COLUMN limits_version bigint NOT NULL DEFAULT 0 CHECK (limits_version >= 0);
ALTER TABLE accounts ADD COLUMN frozen boolean NOT NULL DEFAULT false;

-- A project is a named group of an org's keys; a key is in at most one project.
CREATE TABLE projects (
    org_id     text        NOT NULL REFERENCES accounts (org_id),
    id         text        NOT NULL CHECK (id ~ '^[!-~]{1,128}$' AND id !~ '[,;:|]'),
    frozen     boolean     NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, id)
);
ALTER TABLE api_keys ADD COLUMN project_id text;
ALTER TABLE api_keys ADD COLUMN frozen boolean NOT NULL DEFAULT false;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_project FOREIGN KEY (org_id, project_id) REFERENCES projects (org_id, id);

-- A limit: scope × window × cap. Ids come from an identity (never reused, deleted limits
-- included); scope and window never change (a change is a new limit); a deleted limit keeps its
-- row for the record.
CREATE TABLE limits (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    org_id     text        NOT NULL REFERENCES accounts (org_id),
    scope      text        NOT NULL CHECK (scope IN ('org', 'project', 'key')),
    scope_id   text        NOT NULL DEFAULT '' CHECK ((scope = 'org') = (scope_id = '')),
    period     text        NOT NULL CHECK (period IN ('lifetime', 'hour', 'day', 'week', 'month')),
    cap        bigint      NOT NULL CHECK (cap > 0 AND cap <= 100000000000000),
    created_at timestamptz NOT NULL DEFAULT now(),
    changed_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz
);
CREATE INDEX limits_org ON limits (org_id, id) WHERE deleted_at IS NULL;

-- Attribution. reserved_at is the Redis clock at reserve (whole milliseconds, stored exactly);
-- a charge entry copies its event's key and project, and its reserve time, or the event's
-- record time when it has none (fail-open requests).
ALTER TABLE usage_events ADD COLUMN project text;
ALTER TABLE usage_events ADD COLUMN reserved_at timestamptz;
ALTER TABLE ledger_entries ADD COLUMN key_id text;
ALTER TABLE ledger_entries ADD COLUMN project text;
ALTER TABLE ledger_entries ADD COLUMN reserved_at timestamptz;

-- The seed's grouped sum: an org's charges from a window start on, by reserve time (older
-- entries have none: their own time), with what the sum needs in the index.
CREATE INDEX ledger_entries_org_reserved ON ledger_entries (org_id, (coalesce(reserved_at, created_at)))
    INCLUDE (seq, delta, key_id, project) WHERE kind = 'charge';
