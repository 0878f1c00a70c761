-- Scoped admin tokens (issue 36): besides the bootstrap token of the configuration, tokens made
-- through the admin API, each with one scope (read, admin, org:<id>); only a hash of the secret.
-- A rotated token stays valid until expires_at, alongside its successor (rotated_to).
CREATE TABLE admin_tokens (
    id         text        PRIMARY KEY,
    hash       bytea       NOT NULL UNIQUE,
    name       text        NOT NULL DEFAULT '' CHECK (octet_length(name) <= 200),
    scope      text        NOT NULL CHECK (scope IN ('read', 'admin') OR scope LIKE 'org:%'),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz,
    rotated_to text REFERENCES admin_tokens (id)
);

-- The audit trail names the token of each write ('' for the bootstrap token of the configuration).
ALTER TABLE admin_audit ADD COLUMN token_id text NOT NULL DEFAULT '';
