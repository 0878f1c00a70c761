-- Lifetime limits of each end user apart loaded per end user (issue 34; DESIGN.md "Limits"): the
-- seed no longer writes one field per end user ever served; a reserve that misses one has the
-- end user's sum read as of the hot balance's watermark (EndUserUsed): the account pass's
-- limit_windows row, which counts every charge of the end user up to the org's ledger_seq, less
-- the end user's charges after the watermark. This index finds those few charges (and, when no
-- row is kept yet, sums the end user's charges up to the watermark) without reading every charge
-- the end user ever made, which is what ledger_entries_org_end_user (by time) would cost. Only
-- charges with an end user are in it. Building it reads ledger_entries once and blocks writes to
-- it meanwhile (a migration runs in a transaction: not CONCURRENTLY).
CREATE INDEX ledger_entries_org_end_user_seq ON ledger_entries (org_id, end_user, seq)
    INCLUDE (delta, tokens) WHERE kind = 'charge' AND end_user IS NOT NULL;
