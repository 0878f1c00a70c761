-- Credit grants (DESIGN.md "Money in", docs/grants.md). Every credit is a grant with a priority (lower is spent
-- first; 0 promotional, 100 paid) and maybe an expiry. Charges (and debits) spend the grants live
-- at their reserve time, in order (priority, soonest expiry, oldest); the unspent rest of an
-- expired grant leaves as one 'expire' entry (reference expire:<org>:<seq>), written once.
CREATE TABLE grants (
    org_id         text        NOT NULL REFERENCES accounts (org_id),
    seq            bigint      NOT NULL,                    -- its credit entry
    amount         bigint      NOT NULL CHECK (amount > 0),
    priority       integer     NOT NULL CHECK (priority BETWEEN 0 AND 1000),
    expires_at     timestamptz,                             -- NULL: never
    rest           bigint      NOT NULL CHECK (rest >= 0),
    expired_seq    bigint,                                  -- its expire entry
    expired_amount bigint,
    ref            text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (org_id, seq)
);
-- The grants a charge may spend, and the expiries to write.
CREATE INDEX grants_open ON grants (org_id) WHERE rest > 0 AND expired_seq IS NULL;
CREATE INDEX grants_due ON grants (expires_at) WHERE expires_at IS NOT NULL AND expired_seq IS NULL;

-- An org that has had a grant that expires: its entry reads carry the rests per expiry.
ALTER TABLE accounts ADD COLUMN grants_expiring boolean NOT NULL DEFAULT false;

-- What an entry is to the grants: a credit of a grant that expires (its expiry), or an expire
-- entry (the expiry it closes, and whether it is the last of that time's).
ALTER TABLE ledger_entries ADD COLUMN grant_expires_at timestamptz;
ALTER TABLE ledger_entries ADD COLUMN expire_last boolean;
ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_kind_check;
ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_check;
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_kind_check CHECK (kind IN ('charge', 'credit', 'adjust', 'expire'));
ALTER TABLE ledger_entries ADD CONSTRAINT ledger_entries_kind_delta_check
    CHECK (CASE kind WHEN 'charge' THEN delta <= 0 WHEN 'expire' THEN delta <= 0 WHEN 'credit' THEN delta > 0 ELSE delta <> 0 END);

-- escrow_spend_grants: the charges of an account pass (one element per entry, grouped by org and
-- in seq order within it: its org, cost, reserve time) spend the grants live at their reserve
-- times, in order. One pass over the entries: an org with open grants has them read once, spent
-- in memory, and the changed rests written back; an org without any costs one array test.
-- Returns the rests per expiry (expires_at NULL: an org that has had expiring grants and has
-- none pending) of every org of the pass that has had a grant that expires.
CREATE FUNCTION escrow_spend_grants(p_orgs text[], p_costs bigint[], p_ats timestamptz[])
RETURNS TABLE (org_id text, expires_at timestamptz, rest bigint)
LANGUAGE plpgsql AS $$
DECLARE
    open_orgs text[];
    cur text := NULL;
    has boolean := false;
    seqs bigint[];
    rests bigint[];
    orig bigint[];
    exps timestamptz[];
    n integer := 0;
    i integer;
    j integer;
    left_ bigint;
    take bigint;
BEGIN
    SELECT array_agg(DISTINCT g.org_id) INTO open_orgs FROM grants g
     WHERE g.org_id = ANY (p_orgs) AND g.rest > 0 AND g.expired_seq IS NULL;
    IF open_orgs IS NOT NULL THEN
        FOR i IN 1 .. coalesce(array_length(p_orgs, 1), 0) LOOP
            IF cur IS DISTINCT FROM p_orgs[i] THEN
                IF has THEN
                    UPDATE grants g SET rest = x.r FROM unnest(seqs, rests, orig) AS x(s, r, o0)
                     WHERE g.org_id = cur AND g.seq = x.s AND x.r <> x.o0;
                END IF;
                cur := p_orgs[i];
                has := cur = ANY (open_orgs);
                IF has THEN
                    SELECT array_agg(g.seq ORDER BY g.priority, g.expires_at NULLS LAST, g.seq),
                           array_agg(g.rest ORDER BY g.priority, g.expires_at NULLS LAST, g.seq),
                           array_agg(g.expires_at ORDER BY g.priority, g.expires_at NULLS LAST, g.seq)
                      INTO seqs, rests, exps
                      FROM grants g WHERE g.org_id = cur AND g.rest > 0 AND g.expired_seq IS NULL;
                    n := coalesce(array_length(seqs, 1), 0);
                    orig := rests;
                END IF;
            END IF;
            CONTINUE WHEN NOT has;
            left_ := p_costs[i];
            j := 1;
            WHILE left_ > 0 AND j <= n LOOP
                IF rests[j] > 0 AND (exps[j] IS NULL OR exps[j] > p_ats[i]) THEN
                    take := least(left_, rests[j]);
                    rests[j] := rests[j] - take;
                    left_ := left_ - take;
                END IF;
                j := j + 1;
            END LOOP;
        END LOOP;
        IF has THEN
            UPDATE grants g SET rest = x.r FROM unnest(seqs, rests, orig) AS x(s, r, o0)
             WHERE g.org_id = cur AND g.seq = x.s AND x.r <> x.o0;
        END IF;
    END IF;
    RETURN QUERY
        SELECT a.org_id, d.expires_at, coalesce(d.rest, 0)::bigint
          FROM accounts a LEFT JOIN LATERAL (
               SELECT g.expires_at, sum(g.rest)::bigint AS rest FROM grants g
                WHERE g.org_id = a.org_id AND g.expires_at IS NOT NULL AND g.expired_seq IS NULL
                GROUP BY g.expires_at) d ON true
         WHERE a.org_id = ANY (p_orgs) AND a.grants_expiring;
END $$;
