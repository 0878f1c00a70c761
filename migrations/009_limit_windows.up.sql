-- Limit crossings (issue 14; DESIGN.md "Limits"): the ledger's spend in each limit's current
-- (and later) windows, kept by the account pass in the transaction that writes the charges, so a
-- limit.crossed webhook event fires when a batch takes a window from below 80 % (100 %) of the
-- cap to at or above it, without summing the window's history again. A row is made the first
-- time a batch charges its window (from the window's charges already in the ledger), and a
-- limit's rows of past windows are dropped then. Only orgs with limits have rows.
CREATE TABLE limit_windows (
    limit_id     bigint      NOT NULL REFERENCES limits (id),
    window_start timestamptz NOT NULL, -- the Unix epoch for a lifetime limit
    used         bigint      NOT NULL CHECK (used >= 0),
    PRIMARY KEY (limit_id, window_start)
);
