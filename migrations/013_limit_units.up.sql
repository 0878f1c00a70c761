-- Limits in requests and tokens, and per minute (DESIGN.md "Limits", third wave). A limit counts
-- money (micro-units, as before), requests (1 per charge) or tokens (a charge's input + output
-- tokens); its unit never changes, like its scope and window. A charge entry keeps its tokens, so
-- the seed counts a tokens limit's window from the ledger alone. The column default makes the
-- ALTERs catalogue-only: no table is rewritten.
ALTER TABLE limits ADD COLUMN unit text NOT NULL DEFAULT 'money' CHECK (unit IN ('money', 'requests', 'tokens'));
ALTER TABLE limits DROP CONSTRAINT limits_period_check;
ALTER TABLE limits ADD CONSTRAINT limits_period_check CHECK (period IN ('lifetime', 'minute', 'hour', 'day', 'week', 'month'));
ALTER TABLE ledger_entries ADD COLUMN tokens bigint NOT NULL DEFAULT 0 CHECK (tokens >= 0);
