-- A key limited to models (issue 36): NULL serves every model; else the model names it may use,
-- an entry ending in '*' a prefix. Others are answered 404 model_not_found, as if absent.
ALTER TABLE api_keys ADD COLUMN models text[];

-- Exempt orgs (issue 36): the platform's own users. Their requests are authenticated, limited by
-- their limits, metered and charged to their ledger (a negative balance allowed), but never held
-- and never refused for balance. Off by default.
ALTER TABLE accounts ADD COLUMN exempt boolean NOT NULL DEFAULT false;
