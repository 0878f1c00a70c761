-- Each usage event written once, never updated (issue 24; DESIGN.md "Postgres"). Until now an
-- event went pending → accounted by an UPDATE of its row that could not be HOT (status was in
-- three partial indexes): a new row version and its index entries per event. Now the pending
-- state is a queue of its own: one usage_pending row per RecordUsage call (a recorder batch),
-- holding the ids of the events that call inserted and each one's org, written in the same
-- statement as the events. The account pass (and a seed's snapshot) claims queue rows FOR UPDATE,
-- writes the charges and, in the same transaction, deletes the rows it emptied (or rewrites the
-- ids it left, an update that touches no indexed column). An event is pending while its id is in
-- the queue; it is accounted when it has a charge entry (ledger_entries.hold_id, the same
-- transaction). usage_events.status is now 'recorded' for every new event (whether pending or
-- accounted is read from the queue and the entries), 'voided' for a tombstone (migration 002),
-- and 'accounted' (with seq) for the rows accounted before this migration.
CREATE TABLE usage_pending (
    id   bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    n    integer NOT NULL CHECK (n > 0),
    ids  uuid[]  NOT NULL,
    orgs text[]  NOT NULL,
    CHECK (cardinality(ids) = n AND cardinality(orgs) = n)
) WITH (fillfactor = 70);

ALTER TABLE usage_events DROP CONSTRAINT usage_events_status_check;
ALTER TABLE usage_events ADD CONSTRAINT usage_events_status_check CHECK (status IN ('pending', 'accounted', 'voided', 'recorded'));
ALTER TABLE usage_events ALTER COLUMN status SET DEFAULT 'recorded';

-- The events pending now stay pending: queued (one row per org), then 'recorded'.
INSERT INTO usage_pending (n, ids, orgs)
SELECT count(*), array_agg(id ORDER BY created_at, id), array_agg(org_id ORDER BY created_at, id)
FROM usage_events WHERE status = 'pending' GROUP BY org_id;
UPDATE usage_events SET status = 'recorded' WHERE status = 'pending';

-- A process still running the code before this migration (a rolling deployment) inserts its
-- events as 'pending' with no queue row: this trigger queues them, so no served request goes
-- unbilled. (It fires only for such rows: new code never inserts 'pending'.)
CREATE FUNCTION usage_events_queue_legacy() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO usage_pending (n, ids, orgs) VALUES (1, ARRAY[NEW.id], ARRAY[NEW.org_id]);
    UPDATE usage_events SET status = 'recorded' WHERE id = NEW.id;
    RETURN NULL;
END $$;
CREATE TRIGGER usage_events_queue_legacy AFTER INSERT ON usage_events
    FOR EACH ROW WHEN (NEW.status = 'pending') EXECUTE FUNCTION usage_events_queue_legacy();

-- Their readers now read the queue (pending) and the charge entries (accounted): an event row
-- is in no index but its primary key and the BRIN on its time, and is never updated.
DROP INDEX usage_events_pending_fifo;
DROP INDEX usage_events_pending_org;
DROP INDEX usage_events_org_accounted;

-- Account rows updated HOT: the account pass and the settled marks update balance, ledger_seq
-- and settled_seq; accounts_unsettled's predicate named two of them, so no such update could be
-- HOT. OrgsToSettle and the backlog read the (one row per org) table instead. A fillfactor that
-- leaves room on each page for the new row versions (pages written from now on; a table
-- rewrite, e.g. VACUUM FULL at a quiet time, applies it to the existing ones).
DROP INDEX accounts_unsettled;
ALTER TABLE accounts SET (fillfactor = 50);
