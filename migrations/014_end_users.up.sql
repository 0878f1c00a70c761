-- End users (issue 26; DESIGN.md "Limits", third wave): the request's end user (the OpenAI user
-- field, Anthropic metadata.user_id or a configured header) is attribution like the key and the
-- project: kept on the usage event and copied to its charge entry (NULL: none), counted by the
-- limits of scope end_user — without a scope_id ('') each end user apart, with one that end user.
-- The new columns are nullable without a default, so the ALTERs rewrite no table.
ALTER TABLE usage_events ADD COLUMN end_user text;
ALTER TABLE ledger_entries ADD COLUMN end_user text;

ALTER TABLE limits DROP CONSTRAINT limits_scope_check;
ALTER TABLE limits ADD CONSTRAINT limits_scope_check CHECK (scope IN ('org', 'project', 'key', 'end_user'));
ALTER TABLE limits DROP CONSTRAINT limits_check;
ALTER TABLE limits ADD CONSTRAINT limits_scope_id_check CHECK (CASE scope
    WHEN 'org' THEN scope_id = ''
    WHEN 'end_user' THEN true -- '': each end user apart
    ELSE scope_id <> '' END);

-- A limit of each end user apart has one window row per end user (limit.crossed fires per end
-- user); '' for every other limit. limit_windows holds current windows only: changing its key is
-- cheap.
ALTER TABLE limit_windows ADD COLUMN end_user text NOT NULL DEFAULT '';
ALTER TABLE limit_windows DROP CONSTRAINT limit_windows_pkey;
ALTER TABLE limit_windows ADD PRIMARY KEY (limit_id, window_start, end_user);

-- The first charge of an end user in a window starts its window row from that end user's
-- charges already in the window (a limit created mid-window): without this index each new end
-- user would scan the whole window's charges of the org. Only charges with an end user are in
-- it; building it reads ledger_entries once (existing rows have none, so it starts empty).
CREATE INDEX ledger_entries_org_end_user ON ledger_entries (org_id, end_user, (coalesce(reserved_at, created_at)))
    INCLUDE (seq, delta, tokens) WHERE kind = 'charge' AND end_user IS NOT NULL;
