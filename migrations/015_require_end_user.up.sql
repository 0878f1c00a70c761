-- A limit of each end user apart may require an end user (issue 26): a request of the org that
-- names none is then refused (400) instead of being counted by no end-user limit. A constant
-- default: the ALTER rewrites no table.
ALTER TABLE limits ADD COLUMN require_end_user boolean NOT NULL DEFAULT false;
ALTER TABLE limits ADD CONSTRAINT limits_require_end_user_check CHECK (NOT require_end_user OR (scope = 'end_user' AND scope_id = ''));
